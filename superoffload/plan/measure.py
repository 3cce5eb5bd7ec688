"""Microbenchmarks that build a HardwareProfile for the machine at hand (DESIGN.md §5).

Measured: link transfers over message sizes (pinned host <-> CUDA device; without CUDA, the CPU
backend's transfer is a memcpy, so that is what is timed), host memory bandwidth (a copy,
read + write), our CPU Adam kernel's throughput per thread count (kernels.adam_step_multi),
fp32 -> bf16 cast rates, and the device's matmul rate. Each figure is the best of a few
repetitions (on a shared machine noise only adds time). The result is cached as JSON (one file per host and variant) so later calls are
instant; `force=True` measures again.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from superoffload.plan.profiles import HardwareProfile

CACHE_ENV = "SUPEROFFLOAD_CACHE_DIR"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """`override`, else $SUPEROFFLOAD_CACHE_DIR, else ~/.cache/superoffload."""
    if override is not None:
        return Path(override)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "superoffload"


def _best_time(fn: Callable[[], Any], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up (page faults, allocator, lazy init)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # noise on a shared machine only adds time: keep the best run


def measure_local(*, quick: bool = False, force: bool = False, progress: bool = True,
                  cache: str | os.PathLike[str] | None = None, use_cache: bool = True
                  ) -> HardwareProfile:
    """Profile of this machine. `quick` uses small sizes (seconds; for tests), the default takes
    well under a minute. Cached in `cache_dir()/profile-<host>[-quick].json`."""
    import torch  # measuring needs tensors; the rest of plan/ stays torch-free

    path = cache_dir(cache) / f"profile-{socket.gethostname()}{'-quick' if quick else ''}.json"
    if use_cache and not force and path.exists():
        try:
            return HardwareProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, json.JSONDecodeError):
            pass  # a stale or foreign file: measure again and overwrite it
    from tqdm.auto import tqdm

    from superoffload import kernels

    cuda = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    reps = 3 if quick else 5
    big = (1 << 22) if quick else (1 << 25)  # elements for bandwidth tests (16 / 128 MB fp32)
    adam_n = (1 << 18) if quick else (1 << 23)
    sizes = [1 << s for s in (range(16, 24, 3) if quick else range(16, 29, 2))]
    thread_counts = sorted({1, cores} | ({cores // 2} if cores >= 4 else set()))
    steps = ["host bandwidth", "casts", "matmul"] + [f"adam x{t}" for t in thread_counts] + [
        f"link {s >> 10} KiB" for s in sizes]
    bar = tqdm(total=len(steps), desc="measure_local", disable=not progress, leave=False)
    raw: dict[str, Any] = {"quick": quick, "cuda": cuda, "torch": torch.__version__,
                           "kernel_backend": kernels.backend()}
    saved_threads = torch.get_num_threads()
    try:
        # host memory bandwidth: a copy reads and writes every byte
        a = torch.empty(big, dtype=torch.float32).fill_(1.0)
        b = torch.empty_like(a)
        t = _best_time(lambda: b.copy_(a), reps)
        host_bw = 2 * a.numel() * 4 / t / 1e9
        raw["host_copy_s"] = t
        bar.update()
        # host cast fp32 -> bf16 (6 B per element)
        lp = torch.empty(big, dtype=torch.bfloat16)
        t = _best_time(lambda: lp.copy_(a), reps)
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
        n = (4096 if not quick else 2048) if cuda else (512 if quick else 1024)
        dtype = torch.bfloat16 if cuda else torch.float32
        x = torch.randn(n, n, dtype=dtype, device="cuda" if cuda else "cpu")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        t = _best_time(lambda: x @ x, reps, sync)
        tflops = 2 * n**3 / t / 1e12
        raw["matmul_n"], raw["matmul_s"] = n, t
        bar.update()
        # our CPU Adam kernel per thread count
        table = []
        g = torch.randn(adam_n) * 1e-3
        p, m, v = torch.randn(adam_n), torch.zeros(adam_n), torch.zeros(adam_n)
        for threads in thread_counts:
            torch.set_num_threads(threads)  # the torch fallback follows torch's pool
            step = [0]

            def one(threads: int = threads, step: list[int] = step) -> None:
                step[0] += 1
                kernels.adam_step_multi([p], [g], [m], [v], step=step[0], lr=1e-3, beta1=0.9,
                                        beta2=0.999, eps=1e-8, weight_decay=0.01,
                                        threads=threads)

            t = _best_time(one, reps)
            table.append((threads, adam_n / t))
            bar.update()
        torch.set_num_threads(saved_threads)
        # link: pinned host <-> device per message size; without CUDA, the CPU backend's memcpy
        h2d, d2h = [], []
        for size in sizes:
            src = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
            dst = torch.empty_like(src, device="cuda" if cuda else "cpu")
            if cuda:
                src = src.pin_memory()
                back = torch.empty_like(src).pin_memory()
            else:
                back = torch.empty_like(src)

            def up(s: torch.Tensor = src, d: torch.Tensor = dst) -> None:
                d.copy_(s, non_blocking=True)

            def down(d: torch.Tensor = dst, h: torch.Tensor = back) -> None:
                h.copy_(d, non_blocking=True)

            # small copies are cheap: repeat them more, so one preemption cannot decide the figure
            n_reps = max(reps, min(50, int(2e7 // size)))
            t_h2d = _best_time(up, n_reps, sync)
            t_d2h = _best_time(down, n_reps, sync)
            h2d.append((float(size), size / t_h2d / 1e9))
            d2h.append((float(size), size / t_d2h / 1e9))
            bar.update()
    finally:
        torch.set_num_threads(saved_threads)
        bar.close()

    host_mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    dev_mem = float(torch.cuda.mem_get_info()[1]) if cuda else host_mem
    per_core = table[0][1] / table[0][0]
    adam_peak = max(r for _, r in table)
    prof = HardwareProfile(
        name=f"local-{socket.gethostname()}",
        device_name=torch.cuda.get_device_name() if cuda else "this machine's CPU (CPU backend)",
        cpu_name=_cpu_name(),
        device_peak_tflops=tflops,
        device_achieved_tflops=tflops,
        device_memory_bytes=dev_mem,
        device_mem_bw_gbps=device_bw,
        host_memory_bytes=host_mem,
        host_mem_bw_gbps=host_bw,
        cpu_cores=cores,
        cpu_adam_params_per_s_per_core=per_core,
        cpu_adam_bw_efficiency=min(1.0, adam_peak * 28 / (host_bw * 1e9)),
        cpu_adam_table=tuple(table),
        h2d_gbps=max(r for _, r in h2d),
        d2h_gbps=max(r for _, r in d2h),
        link_latency_s=0.0,
        h2d_table=tuple(h2d),
        d2h_table=tuple(d2h),
        device_cast_gelems=device_cast,
        host_cast_gelems=host_cast,
        shared_memory=not cuda,
        sources=tuple((k, "measured by plan.measure_local" + (" (quick)" if quick else ""))
                      for k in ("device_achieved_tflops", "device_mem_bw_gbps", "host_mem_bw_gbps",
                                "cpu_adam_params_per_s_per_core", "h2d_gbps", "d2h_gbps",
                                "device_cast_gelems", "host_cast_gelems")),
        notes="Measured on this machine; device_peak_tflops is the measured matmul rate, not a "
              "vendor peak. Without CUDA the 'device' is the CPU and transfers are memcpys.",
        extra=raw,
    ).validate()
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof.to_dict(), indent=1))
    return prof


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
