"""Microbenchmarks that build a HardwareProfile for the machine at hand (DESIGN.md §5).

Measured: link transfers over message sizes (pinned host <-> CUDA device; without CUDA, the CPU
backend's transfer is a memcpy, so that is what is timed), host memory bandwidth (a copy),
our CPU Adam kernel's throughput per thread count, fp32 -> bf16 cast rates, and the device's
matmul rate, and the host's cost of one model operation (plan/probe.py's dispatch probe).
Every probe is the median of its trials after a warm-up call, with the spread recorded in
``extra["spread"]``; a spread above 10% or a load average above the usable cores adds a
"busy host" flag (plan/timing.py). ``plan.probe.probe_model`` then measures a given model's
own matmul shapes, attention and element-wise passes on the same device.

The CPU Adam rate is measured the way the engine runs it (DESIGN.md §6; FACTS.md H200: a warm
134 MB buffer gave 8.4 G params/s, cache speed, 3x what the engine got): the engine's variant
(bf16 gradients in, fp32 master and moments, the bf16 copy out, ``kernels.adam_step_multi``
with ``params_lp``), one call per bucket-sized chunk, over >= 2 GiB of buffers cycled so no
chunk is cache-resident (``quick``: 64 MiB, for tests), the median of the calls after a warm-up
pass.
The host bus bandwidth counts a copy's write-allocate read on x86 (3 B per byte copied; the
STREAM FAQ). When the Adam rate implies more bus traffic than that bandwidth the profile says
so in ``flags`` (never silently clamped); the cost model caps it by the bus anyway
(plan/cost.py). The result is cached as JSON (one file per host and variant) so later calls
are instant; `force=True` measures again.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.probe import dispatch_op_s
from superoffload.plan.timing import busy_flags, load_average, relative_spread, repeat

CACHE_ENV = "SUPEROFFLOAD_CACHE_DIR"
PROFILE_FORMAT = 3
"""Version of what measure_local measures; a cached profile of another version is re-measured
(version 1 timed Adam on one warm buffer and counted a copy as 2 B per byte; version 2 kept
the best of the trials and had no per-operation cost)."""
ADAM_BUFFER_BYTES = 2 << 30
"""Engine-variant Adam buffers cycled per thread count (16 B/param: p, m, v fp32, g and the
copy bf16): well past any last-level cache."""
ADAM_BUFFER_BYTES_QUICK = 64 << 20
"""quick=True (tests): 64 MiB, cheap with the torch fallback too; not DRAM-resident."""
ADAM_CHUNK_PARAMS = 16 << 20
"""Parameters per kernel call: a 64 MiB bucket (OffloadConfig's default bucket_bytes)."""
ADAM_CHUNK_PARAMS_QUICK = 1 << 20
ENGINE_KERNEL_BUS_BYTES = 28
"""Bytes one engine-variant step moves per parameter: read g (2) + p, m, v (12), write p, m, v
(12) + the bf16 copy (2); +2 for the copy's write-allocate read on x86."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """`override`, else $SUPEROFFLOAD_CACHE_DIR, else ~/.cache/superoffload."""
    if override is not None:
        return Path(override)
    env = os.environ.get(CACHE_ENV)
    # An empty variable counts as unset, as a shell's `VAR= cmd` means.
    return Path(env) if env else Path.home() / ".cache" / "superoffload"


def _cache_path(cache: str | os.PathLike[str] | None, quick: bool) -> Path:
    # quick profiles (small sizes, for tests) must never stand in for a full measurement.
    suffix = "-quick" if quick else ""
    return cache_dir(cache) / f"profile-{socket.gethostname()}{suffix}.json"


def cached_profile(*, quick: bool = False, cache: str | os.PathLike[str] | None = None
                   ) -> HardwareProfile | None:
    """This host's cached profile when one of the current PROFILE_FORMAT exists, else None; never
    measures (for callers that must stay fast, e.g. the engine's weights="auto" default)."""
    path = _cache_path(cache, quick)
    if not path.exists():
        return None
    try:
        hit = HardwareProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, json.JSONDecodeError):
        # A stale or foreign file: measure_local measures again and overwrites it.
        return None
    # Another PROFILE_FORMAT measured something else (see its docstring): not a hit.
    return hit if hit.extra.get("format") == PROFILE_FORMAT else None


def measure_local(*, quick: bool = False, force: bool = False, progress: bool = True,
                  cache: str | os.PathLike[str] | None = None, use_cache: bool = True,
                  storage: str | os.PathLike[str] | None = None) -> HardwareProfile:
    """Profile of this machine. `quick` uses small sizes (seconds; for tests), the default takes
    well under a minute. Cached in `cache_dir()/profile-<host>[-quick].json`. ``storage``: a
    folder on the storage tier, measured with the project's own I/O engine each call (not
    cached: plan/measure_storage.py) and made the profile's tier."""
    prof = _measure_local(quick=quick, force=force, progress=progress, cache=cache,
                          use_cache=use_cache)
    if storage is None:
        return prof
    from superoffload.plan.measure_storage import measure_storage_tier
    from superoffload.plan.storage_presets import with_tier

    return with_tier(prof, measure_storage_tier(storage, quick=quick))


def _measure_local(*, quick: bool, force: bool, progress: bool,
                   cache: str | os.PathLike[str] | None, use_cache: bool) -> HardwareProfile:
    # Measuring needs tensors; the rest of plan/ stays torch-free.
    import torch

    path = _cache_path(cache, quick)
    if use_cache and not force:
        hit = cached_profile(quick=quick, cache=cache)
        if hit is not None:
            return hit
    from tqdm.auto import tqdm

    from superoffload import kernels
    from superoffload.threads import optimizer_threads, runtime_threads, usable_cores

    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    cores = usable_cores()
    # x86 reads a destination line before writing it (write-allocate); ARM hosts such as
    # Grace stream the write, so the copy's bus traffic differs (module docstring).
    write_allocate = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    if quick:
        # Elements for the bandwidth tests (16 MB fp32) and link sizes 64 KiB..4 MiB.
        reps, big, exponents = 3, 1 << 22, range(16, 24, 3)
    else:
        # 128 MB fp32, well past the last-level cache; link sizes 64 KiB..256 MiB.
        reps, big, exponents = 5, 1 << 25, range(16, 29, 2)
    sizes = [1 << s for s in exponents]
    # The thread count the engine will give Adam, so the table holds its operating point.
    engine_threads = optimizer_threads(cores, 0.9, reserved=runtime_threads(device_type))
    thread_set = {1, cores, engine_threads}
    if cores >= 4:
        # A midpoint, so the table can interpolate the curve between 1 and all cores.
        thread_set.add(cores // 2)
    thread_counts = sorted(thread_set)
    steps = ["host bandwidth", "casts", "matmul"] + [f"adam x{t}" for t in thread_counts] + [
        f"link {s >> 10} KiB" for s in sizes]
    bar = tqdm(total=len(steps), desc="measure_local", disable=not progress, leave=False)
    raw: dict[str, Any] = {"format": PROFILE_FORMAT, "quick": quick, "cuda": cuda,
                           "torch": torch.__version__, "kernel_backend": kernels.backend(),
                           "load_average": load_average()}
    spreads: dict[str, float] = {}

    def _best_time(fn: Callable[[], Any], reps: int, sync: Callable[[], None] = lambda: None,
                   name: str = "") -> float:
        """Median of `reps` timed calls after a warm-up (plan/timing.py); spread recorded."""
        t, spread = repeat(fn, reps, sync)
        key = name or "probe"
        spreads[key] = max(spreads.get(key, 0.0), spread)
        return t

    saved_threads = torch.get_num_threads()
    try:
        # host memory bandwidth: a copy reads the source and writes the destination, and on
        # x86 reads each destination line first (write-allocate): 3 B on the bus per byte
        a = torch.empty(big, dtype=torch.float32).fill_(1.0)
        b = torch.empty_like(a)
        t = _best_time(lambda: b.copy_(a), reps, name="host copy")
        copy_gbps = 2 * a.numel() * 4 / t / 1e9
        # Bus bytes, not copied bytes: 3 B per byte copied where writes allocate, else 2 B.
        host_bw = copy_gbps * (1.5 if write_allocate else 1.0)
        raw["host_copy_s"], raw["host_copy_gbps"] = t, copy_gbps
        bar.update()
        # host cast fp32 -> bf16 (6 B per element)
        lp = torch.empty(big, dtype=torch.bfloat16)
        t = _best_time(lambda: lp.copy_(a), reps, name="host cast")
        host_cast = big / t / 1e9
        raw["host_cast_s"] = t
        if cuda:
            dev = torch.device("cuda")
            da, dlp = a.to(dev), lp.to(dev)
            t = _best_time(lambda: dlp.copy_(da), reps, torch.cuda.synchronize)
            device_cast = big / t / 1e9
            db = torch.empty_like(da)
            t = _best_time(lambda: db.copy_(da), reps, torch.cuda.synchronize)
            device_bw = 2 * big * 4 / t / 1e9
        else:
            device_cast, device_bw = host_cast, host_bw
        bar.update()
        # device compute: a square matmul in the training dtype (bf16 on CUDA, fp32 on a CPU)
        sync: Callable[[], None]
        if cuda:
            # Large enough to reach the tensor cores' steady rate, not their launch overhead.
            n = 2048 if quick else 4096
            dtype, sync = torch.bfloat16, torch.cuda.synchronize
        else:
            n = 512 if quick else 1024
            dtype, sync = torch.float32, (lambda: None)
        x = torch.randn(n, n, dtype=dtype, device=device_type)
        t = _best_time(lambda: x @ x, reps, sync, name="matmul")
        tflops = 2 * n**3 / t / 1e12
        raw["matmul_n"], raw["matmul_s"] = n, t
        # the host's cost of one operation of a model's forward/backward (plan/probe.py); at
        # least 5 trials even when quick: one op is microseconds and noisy
        op_s, spreads["dispatch"] = dispatch_op_s(device_type, dtype, max(reps, 5), sync)
        bar.update()
        # our CPU Adam kernel per thread count, DRAM-resident, in the engine's variant
        table, adam_raw = _adam_table(thread_counts, quick)
        raw["adam_samples_s"] = adam_raw
        for threads, times in adam_raw.items():
            spreads[f"adam x{threads}"] = relative_spread(times)
        for _ in thread_counts:
            bar.update()
        # link: pinned host <-> device per message size; without CUDA, the CPU backend's memcpy
        h2d, d2h = [], []
        for size in sizes:
            src = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
            dst = torch.empty_like(src, device=device_type)
            if cuda:
                # Pinned host memory: what the engine's buffers use, and the only kind the
                # copy engines read asynchronously at full rate.
                src = src.pin_memory()
                back = torch.empty_like(src).pin_memory()
            else:
                back = torch.empty_like(src)

            def up(s: torch.Tensor = src, d: torch.Tensor = dst) -> None:
                d.copy_(s, non_blocking=True)

            def down(d: torch.Tensor = dst, h: torch.Tensor = back) -> None:
                h.copy_(d, non_blocking=True)

            # small copies are cheap: repeat them more, so one preemption cannot decide the
            # figure
            n_reps = max(reps, min(50, int(2e7 // size)))
            t_h2d = _best_time(up, n_reps, sync, name="link")
            t_d2h = _best_time(down, n_reps, sync, name="link")
            h2d.append((float(size), size / t_h2d / 1e9))
            d2h.append((float(size), size / t_d2h / 1e9))
            bar.update()
    finally:
        torch.set_num_threads(saved_threads)
        bar.close()

    host_mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    # Without CUDA the "device" is the CPU backend: its memory is the host's.
    dev_mem = float(torch.cuda.mem_get_info()[1]) if cuda else host_mem
    # table[0] is the single-thread row (thread_counts is sorted and holds 1).
    per_core = table[0][1] / table[0][0]
    adam_peak = max(r for _, r in table)
    raw["spread"] = spreads
    flags = _adam_flags(adam_peak, host_bw, write_allocate) + busy_flags(
        spreads, load=raw["load_average"])
    if cuda:
        device_name = torch.cuda.get_device_name()
    else:
        device_name = "this machine's CPU (CPU backend)"
    source = "measured by plan.measure_local" + (" (quick)" if quick else "")
    prof = HardwareProfile(
        name=f"local-{socket.gethostname()}",
        device_name=device_name,
        cpu_name=_cpu_name(),
        device_peak_tflops=tflops,
        device_achieved_tflops=tflops,
        device_memory_bytes=dev_mem,
        device_mem_bw_gbps=device_bw,
        device_op_s=op_s,
        device_nongemm_gbps=device_bw,
        host_memory_bytes=host_mem,
        host_mem_bw_gbps=host_bw,
        cpu_cores=cores,
        cpu_adam_params_per_s_per_core=per_core,
        # the bus figure is measured: the cap is all of it
        cpu_adam_bw_efficiency=1.0,
        cpu_adam_table=tuple(table),
        h2d_gbps=max(r for _, r in h2d),
        d2h_gbps=max(r for _, r in d2h),
        # per-size rates in the tables already include the fixed cost of each copy
        link_latency_s=0.0,
        h2d_table=tuple(h2d),
        d2h_table=tuple(d2h),
        device_cast_gelems=device_cast,
        host_cast_gelems=host_cast,
        shared_memory=not cuda,
        device_type=device_type,
        host_write_allocate=write_allocate,
        flags=flags,
        sources=tuple((k, source)
                      for k in ("device_achieved_tflops", "device_mem_bw_gbps",
                                "host_mem_bw_gbps", "device_op_s", "device_nongemm_gbps",
                                "cpu_adam_params_per_s_per_core", "cpu_adam_table", "h2d_gbps",
                                "d2h_gbps", "device_cast_gelems", "host_cast_gelems",
                                "device_peak_tflops", "device_memory_bytes",
                                "host_memory_bytes", "cpu_cores", "cpu_adam_bw_efficiency",
                                "link_latency_s")),
        notes="Measured on this machine; device_peak_tflops is the measured matmul rate, not a "
              "vendor peak (calibrate.fit_compute fits the achieved rate to a measured plain "
              "iteration). CPU Adam: DRAM-resident, the engine's variant. Without CUDA the "
              "'device' is the CPU and transfers are memcpys.",
        extra=raw,
    ).validate()
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof.to_dict(), indent=1))
    return prof


def _adam_table(thread_counts: list[int], quick: bool
                ) -> tuple[list[tuple[int, float]], dict[str, list[float]]]:
    """[(threads, params/s)] of the engine-variant step, DRAM-resident (module docstring)."""
    import torch

    from superoffload import kernels

    if quick:
        # tests: small and cheap, not DRAM-resident (ADAM_BUFFER_BYTES_QUICK)
        chunk, total = ADAM_CHUNK_PARAMS_QUICK, ADAM_BUFFER_BYTES_QUICK
    else:
        chunk, total = ADAM_CHUNK_PARAMS, ADAM_BUFFER_BYTES
    # 16 B per parameter (module docstring); at least two chunks so no call finds its
    # buffers still in cache from the previous one
    n_chunks = max(2, total // (16 * chunk))
    bufs = [(torch.full((chunk,), 0.5), torch.full((chunk,), 1e-3, dtype=torch.bfloat16),
             torch.zeros(chunk), torch.zeros(chunk), torch.empty(chunk, dtype=torch.bfloat16))
            for _ in range(n_chunks)]
    saved = torch.get_num_threads()
    table, raw = [], {}
    step = 0
    try:
        for threads in thread_counts:
            # the torch fallback follows torch's pool
            torch.set_num_threads(threads)
            times = []
            # the first sweep warms up (page faults, thread start) and is not timed
            for sweep in range(2):
                for p, g, m, v, lp in bufs:
                    step += 1
                    t0 = time.perf_counter()
                    kernels.adam_step_multi([p], [g], [m], [v], step=step, lr=1e-4, beta1=0.9,
                                            beta2=0.999, eps=1e-8, weight_decay=0.01,
                                            params_lp=[lp], threads=threads)
                    if sweep:
                        times.append(time.perf_counter() - t0)
            table.append((threads, chunk / statistics.median(times)))
            raw[str(threads)] = times
    finally:
        torch.set_num_threads(saved)
    return table, raw


def _adam_flags(adam_peak: float, host_bw_gbps: float, write_allocate: bool) -> tuple[str, ...]:
    """A flag when the Adam rate implies more bus traffic than the measured bandwidth (+10%)."""
    per_param = ENGINE_KERNEL_BUS_BYTES + (2 if write_allocate else 0)
    implied = adam_peak * per_param / 1e9
    # 10% slack: the two probes are separate medians, each with its own noise.
    if implied <= 1.1 * host_bw_gbps:
        return ()
    return (f"CPU Adam measured at {adam_peak / 1e9:.2f} G params/s, i.e. {implied:.0f} GB/s of "
            f"host traffic at {per_param} B/param, above the measured host bus "
            f"{host_bw_gbps:.0f} GB/s: the buffers were cache-resident or the bandwidth probe "
            "is low; the cost model caps the rate by the bus (plan/cost.py)",)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
