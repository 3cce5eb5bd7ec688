"""The hardware profile type: what the cost model and the simulator know about one machine.

Plain data (DESIGN.md §5): device compute, device and host memory, the link per direction as
a function of message size, cast rates on each side, CPU Adam throughput per core count, the
host memory bus. Presets live in plan/profiles.py; ``measure_local`` (plan/measure.py) and
``calibrate`` (plan/calibrate.py) build profiles of a real machine.

Units: bytes, seconds, GB/s = 1e9 B/s, TFLOPS = 1e12 FLOP/s, params/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

GB = 1e9
GiB = float(1 << 30)

# Bytes one fp32 Adam step touches per parameter: read p, g, m, v (16 B), write p, m, v (12 B).
# DESIGN.md §4; the step is memory-bandwidth bound, so time ~ bytes / bandwidth.
ADAM_BYTES_PER_PARAM = 28

DEVICE_TYPES = ("cpu", "cuda")

PROVENANCES = ("spec", "measured", "derived", "fitted", "calibrated", "estimate")
"""What a figure's source says it is (``HardwareProfile.provenance``): its first word."""
OPTIONAL_FIGURES = frozenset({"device_op_s", "device_nongemm_gbps", "storage_read_gbps",
                              "storage_write_gbps", "storage_bytes", "storage_queue_depth"})
"""Figures whose 0 means "not modelled" (no dispatch cost, no element-wise term, no storage
tier): not a figure then, so no provenance is asked of it."""
DEFAULT_SOURCES = {
    "cpu_adam_bw_efficiency": "estimate: 0.7 of the host bus with all cores (fused peers "
                              "reach 0.8-0.9 of their floor on x86, FACTS.md)",
    "cpu_adam_bf16_moments_relative": "estimate: ~1.3 vs ~3 G params/s per thread in cache, "
                                      "measured on the 2-core Sapphire Rapids only "
                                      "(docs/kernel.md)",
    "deepspeed_adam_relative": "measured: FACTS.md (Grace, 1B params: DeepSpeed CPUAdam "
                               "0.098 s vs GraceAdam 0.082 s)",
    "torch_adam_relative": "measured: FACTS.md (Grace, 1B params: PyTorch CPU Adam 0.289 s "
                           "vs GraceAdam 0.082 s)",
    "link_latency_s": "estimate: the fixed cost of one transfer",
    "collective_gbps": "estimate: a ring collective's bus bandwidth per rank",
    "collective_latency_s": "estimate: ~10 us per ring step",
    "device_launch_s": "estimate: ~10 us per kernel launch or event record",
    "cpu_call_s": "estimate: per-bucket work of the CPU lane besides the kernel pass",
    "gpus_per_host": "estimate: one GPU has the host to itself",
}
"""Sources of the figures a profile leaves at their defaults (``HardwareProfile.source``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One machine: a device (GPU, or the CPU itself) attached to a host CPU."""

    name: str
    """Short key, e.g. "gh200"."""
    device_name: str
    """Human name of the device, e.g. "H100 (GH200 Hopper)"."""
    cpu_name: str
    """Human name of the host CPU."""
    device_peak_tflops: float
    """Dense bf16 peak of the device (vendor figure)."""
    device_achieved_tflops: float
    """What transformer training matmuls reach in practice (the compute rate the model uses)."""
    device_memory_bytes: float
    """Device memory (HBM); for a shared-memory machine, the same pool as host memory."""
    device_mem_bw_gbps: float
    """Device memory bandwidth; bounds the device optimizer step (28 B/param)."""
    host_memory_bytes: float
    """Host memory usable for optimizer state and staging buffers."""
    host_mem_bw_gbps: float
    """Host memory bus bandwidth: bytes that really cross the bus per second, write-allocate
    reads included (``measure_local`` counts a copy as 3 B per byte copied where stores
    allocate; STREAM's own counts leave that read out, McCalpin's STREAM FAQ). Shared by the
    CPU Adam step and both DMA directions (the host-memory lane, plan/cost.py)."""
    cpu_cores: int
    """Physical cores of the host."""
    cpu_adam_params_per_s_per_core: float
    """Our CPU Adam kernel, fp32, one core (before the bandwidth cap)."""
    cpu_adam_bw_efficiency: float = 0.7
    """Fraction of host_mem_bw_gbps the host traffic (Adam step + DMA) reaches with all
    cores: the cap of the host-memory lane, applied with or without a measured table."""
    cpu_adam_table: tuple[tuple[int, float], ...] = ()
    """Measured (threads, params/s) points of our kernel, DRAM-resident in the engine's
    variant (``measure_local``); they replace the per-core model, and the host-memory cap
    still applies on top (plan/cost.py)."""
    cpu_adam_bf16_moments_relative: float = 1.3 / 3.0
    """Compute throughput of our kernel with bf16 moments (stochastic rounding: widen, update,
    hash, narrow m and v) relative to its fp32-moment pass, before the bandwidth cap.
    docs/kernel.md (2-core Sapphire Rapids, AVX-512): ~1.3 G params/s per thread with the
    data in cache vs ~3 G for fp32 -- an estimate on every other CPU until measured there."""
    deepspeed_adam_relative: float = 0.082 / 0.098
    """DeepSpeed CPUAdam throughput relative to ours (FACTS.md: Grace, 1B params, 0.098 vs
    0.082 s)."""
    torch_adam_relative: float = 0.082 / 0.289
    """PyTorch CPU Adam throughput relative to ours (FACTS.md: Grace, 0.289 vs 0.082 s)."""
    h2d_gbps: float
    """Link peak, host to device, per direction."""
    d2h_gbps: float
    """Link peak, device to host, per direction."""
    link_latency_s: float = 10e-6
    """Fixed cost of one transfer; with peak it gives bandwidth(size) = size / (lat + size/peak)."""
    h2d_table: tuple[tuple[float, float], ...] = ()
    """Measured (message bytes, GB/s) points, H2D; interpolated in log(size) when present."""
    d2h_table: tuple[tuple[float, float], ...] = ()
    """Measured (message bytes, GB/s) points, D2H."""
    device_cast_gelems: float
    """fp32<->bf16 casts on the device, 1e9 elements/s."""
    host_cast_gelems: float
    """fp32<->bf16 casts on the host as a separate pass, 1e9 elements/s, all cores."""
    collective_gbps: float = 50.0
    """Bandwidth one rank reaches in a ring collective (NCCL "bus bandwidth"), per direction,
    GB/s: the slowest hop between data-parallel ranks (NVLink inside an NVL domain, the NIC
    across nodes). The planner's reduce-scatter / all-gather model (plan/parallel.py)."""
    collective_latency_s: float = 10e-6
    """Fixed cost of one ring step of a collective (a ring over N ranks takes N - 1 steps)."""
    device_launch_s: float = 10e-6
    """Fixed cost of one device-side operation (kernel launch, event record)."""
    device_op_s: float = 0.0
    """Host cost of issuing one operation of the model's forward or backward (Python,
    autograd, dispatch, launch), measured by plan/probe.py; 0: not modelled (presets: their
    achieved TFLOPS stand for the whole layer). plan/compute.py."""
    device_nongemm_gbps: float = 0.0
    """Bandwidth of the model's element-wise passes (norms, activations, residual adds) on
    the device, GB/s; 0: not modelled (presets' achieved TFLOPS include them)."""
    cpu_call_s: float = 30e-6
    """Fixed cost of one CPU optimizer call on one bucket (hand-off, thread wake-up)."""
    shared_memory: bool = False
    """True when device and host draw on one memory pool (APU, or a CPU-only machine)."""
    device_type: str = "cuda"
    """"cpu" when the device is the CPU itself (the engine's CPU backend: ``cpu-laptop`` and
    CPU-only ``measure_local`` profiles), else "cuda". The rule book (plan/schedule.py)
    takes it as ``ScheduleFacts.device_type``, as the engine passes its backend's."""
    gpus_per_host: int = 1
    """GPUs whose jobs share this host: its memory, cores, memory bus, host casts and storage
    (8 on an HGX/DGX server). The planner gives one GPU 1/gpus_per_host of them
    (``plan.parallel.rank_profile``, DESIGN.md §7: the host budget is per GPU) unless told
    otherwise: ``replace(gpus_per_host=1)``, ``--gpus-per-host 1`` on the command line, for a
    job that has the whole host. The host figures above are the whole host's; the link to the
    device is per GPU and not shared."""
    storage_read_gbps: float = 0.0
    """The storage tier's sequential read rate, GB/s, at ``storage_queue_depth`` requests in
    flight (docs/storage.md); 0: no storage tier on this machine."""
    storage_write_gbps: float = 0.0
    """The storage tier's sequential write rate, GB/s (reads and writes share the drives)."""
    storage_bytes: float = 0.0
    """Capacity of the storage tier: what the files of the optimizer state (and weights kept
    there) may take."""
    storage_queue_depth: int = 0
    """Requests of ``OffloadConfig.storage_block_bytes`` in flight the rates above need."""
    storage_name: str = ""
    """What the storage tier is, e.g. "4 x PCIe Gen5 NVMe (Samsung PM1743)"."""
    host_write_allocate: bool = True
    """A store to a cache line not in cache first reads it (x86 write-allocate), so a
    write-only output (the kernel's bf16 weight copy, a cast's destination) costs its bytes
    twice on the host memory bus. False for cores that detect streaming writes (Arm
    Neoverse "write streaming mode"). Used by the host-memory lane (plan/cost.py)."""
    flags: tuple[str, ...] = ()
    """Inconsistencies found while building the profile (e.g. by ``measure_local``: a CPU
    Adam rate the measured host bandwidth cannot carry). Reported, never silently fixed."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, source) pairs; a source starting with "estimate" is not a published figure."""
    notes: str = ""
    """Free text: what the profile stands for, caveats."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Measurement details (e.g. raw timings of measure_local); never read by the model."""

    def provenance(self, field_name: str) -> str | None:
        """Where figure ``field_name`` comes from, one of ``PROVENANCES`` (the first word of
        its source: "spec" a vendor's or an author's published figure, "measured" measured
        on the machine (or published measurements), "derived" arithmetic on those, "fitted"
        / "calibrated" fitted to a measured run, "estimate" ours); a field left at its
        default takes ``DEFAULT_SOURCES``' word; None: uncited."""
        source = self.source(field_name)
        if source is None:
            return None
        # the provenance is the first word: "spec: ...", "measured, ..." and "estimate ..." alike
        words = source.replace(":", " ").replace(",", " ").split(maxsplit=1)
        word = words[0].lower() if words else ""
        # an older file's free text names no provenance: uncited
        return word if word in PROVENANCES else None

    def source(self, field_name: str) -> str | None:
        """The source of ``field_name``'s figure: the profile's own, else the default's when
        the field holds its default (``DEFAULT_SOURCES``), else None."""
        own = dict(self.sources).get(field_name)
        if own is not None:
            return own
        f = next((f for f in dataclasses.fields(self) if f.name == field_name), None)
        if f is not None and getattr(self, field_name) == f.default:
            return DEFAULT_SOURCES.get(field_name)
        return None

    def figures(self) -> list[tuple[str, float, str | None]]:
        """(field, value, provenance) of every figure the model reads: each numeric field,
        except an optional one left at 0 (not modelled: ``OPTIONAL_FIGURES``)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if f.name in OPTIONAL_FIGURES and value == 0:
                continue
            out.append((f.name, float(value), self.provenance(f.name)))
        return out

    def validate(self) -> HardwareProfile:
        """Raise ValueError naming the field when a figure is missing, negative or inconsistent."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and (not math.isfinite(float(value)) or value < 0):
                raise ValueError(
                    f"HardwareProfile({self.name}).{f.name}={value!r}: use a finite number >= 0"
                )
        positive = (
            "device_peak_tflops", "device_achieved_tflops", "device_memory_bytes",
            "device_mem_bw_gbps", "host_memory_bytes", "host_mem_bw_gbps", "cpu_cores",
            "cpu_adam_params_per_s_per_core", "cpu_adam_bw_efficiency",
            "cpu_adam_bf16_moments_relative", "deepspeed_adam_relative",
            "torch_adam_relative", "h2d_gbps", "d2h_gbps", "device_cast_gelems",
            "host_cast_gelems", "collective_gbps",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareProfile({self.name}).{name} must be > 0 (figure "
                                 "missing?)")
        if self.device_achieved_tflops > self.device_peak_tflops:
            raise ValueError(
                f"HardwareProfile({self.name}).device_achieved_tflops="
                f"{self.device_achieved_tflops} exceeds "
                f"device_peak_tflops={self.device_peak_tflops}"
            )
        if self.cpu_adam_bw_efficiency > 1:
            raise ValueError(f"HardwareProfile({self.name}).cpu_adam_bw_efficiency must be <= 1")
        for tname in ("h2d_table", "d2h_table", "cpu_adam_table"):
            for point in getattr(self, tname):
                if len(point) != 2 or not all(p > 0 for p in point):
                    raise ValueError(
                        f"HardwareProfile({self.name}).{tname} holds {point!r}: use (x, y) pairs > "
                        "0"
                    )
        if not self.name:
            raise ValueError("HardwareProfile.name is empty: give the profile a key")
        if not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 1:
            raise ValueError(f"HardwareProfile({self.name}).gpus_per_host={self.gpus_per_host!r}: "
                             "use a whole number >= 1 (1: one GPU has the host to itself)")
        tier = (self.storage_read_gbps, self.storage_write_gbps, self.storage_bytes)
        if any(tier) and not all(tier):
            raise ValueError(f"HardwareProfile({self.name}): a storage tier needs "
                             "storage_read_gbps, storage_write_gbps and storage_bytes all > 0 "
                             f"(got {tier}); all 0 for no tier")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"HardwareProfile({self.name}).device_type={self.device_type!r}: "
                             f"use one of {DEVICE_TYPES}")
        return self

    def replace(self, **changes: Any) -> HardwareProfile:
        """A validated copy with `changes` applied (e.g. h2d_gbps=900 for a what-if)."""
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (tables become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Inverse of `to_dict`; unknown keys raise ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown HardwareProfile key(s) {unknown}; known: {sorted(names)}")
        fixed = dict(data)
        if "flags" in fixed:
            fixed["flags"] = tuple(fixed["flags"])
        for key in ("h2d_table", "d2h_table", "cpu_adam_table", "sources"):
            if key in fixed:
                fixed[key] = tuple(tuple(p) for p in fixed[key])
        return cls(**fixed).validate()

    def is_estimate(self, field_name: str) -> bool:
        """True when the figure's source is marked as our estimate (or is not cited)."""
        return self.provenance(field_name) in (None, "estimate")

    @property
    def has_storage(self) -> bool:
        """Whether the machine has a storage tier (``storage_*`` figures)."""
        return self.storage_read_gbps > 0
