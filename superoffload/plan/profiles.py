"""Hardware profiles: what the cost model and the simulator need to know about one machine.

A profile is plain data (DESIGN.md §5): device compute, device and host memory, the link in
each direction as a function of message size, cast rates on each side, CPU Adam throughput as
a function of cores, host memory bandwidth. Presets cite where each figure comes from
(`sources`); a figure marked "estimate" is ours, not a vendor's or the paper's, and is the first
thing to replace with `measure_local()` / `calibrate()` figures from the real machine.

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
    """Host memory bandwidth (STREAM-like)."""
    cpu_cores: int
    """Physical cores of the host."""
    cpu_adam_params_per_s_per_core: float
    """Our CPU Adam kernel, fp32, one core (before the bandwidth cap)."""
    cpu_adam_bw_efficiency: float = 0.7
    """Fraction of host_mem_bw_gbps the Adam step reaches with all cores (the cap)."""
    cpu_adam_table: tuple[tuple[int, float], ...] = ()
    """Measured (threads, params/s) points; when present they replace the per-core model."""
    deepspeed_adam_relative: float = 0.082 / 0.098
    """DeepSpeed CPUAdam throughput relative to ours (FACTS.md: Grace, 1B params, 0.098 vs 0.082 s)."""
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
    cpu_call_s: float = 30e-6
    """Fixed cost of one CPU optimizer call on one bucket (hand-off, thread wake-up)."""
    shared_memory: bool = False
    """True when device and host draw on one memory pool (APU, or a CPU-only machine)."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, source) pairs; a source starting with "estimate" is not a published figure."""
    notes: str = ""
    """Free text: what the profile stands for, caveats."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Measurement details (e.g. raw timings of measure_local); never read by the model."""

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
            "cpu_adam_params_per_s_per_core", "cpu_adam_bw_efficiency", "deepspeed_adam_relative",
            "torch_adam_relative", "h2d_gbps", "d2h_gbps", "device_cast_gelems",
            "host_cast_gelems", "collective_gbps",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareProfile({self.name}).{name} must be > 0 (figure missing?)")
        if self.device_achieved_tflops > self.device_peak_tflops:
            raise ValueError(
                f"HardwareProfile({self.name}).device_achieved_tflops="
                f"{self.device_achieved_tflops} exceeds device_peak_tflops={self.device_peak_tflops}"
            )
        if self.cpu_adam_bw_efficiency > 1:
            raise ValueError(f"HardwareProfile({self.name}).cpu_adam_bw_efficiency must be <= 1")
        for tname in ("h2d_table", "d2h_table", "cpu_adam_table"):
            for point in getattr(self, tname):
                if len(point) != 2 or not all(p > 0 for p in point):
                    raise ValueError(
                        f"HardwareProfile({self.name}).{tname} holds {point!r}: use (x, y) pairs > 0"
                    )
        if not self.name:
            raise ValueError("HardwareProfile.name is empty: give the profile a key")
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
        for key in ("h2d_table", "d2h_table", "cpu_adam_table", "sources"):
            if key in fixed:
                fixed[key] = tuple(tuple(p) for p in fixed[key])
        return cls(**fixed).validate()

    def is_estimate(self, field_name: str) -> bool:
        """True when the figure's source is marked as our estimate (or is not cited)."""
        src = dict(self.sources).get(field_name)
        return src is None or src.lower().startswith("estimate")


_GRACE_ADAM = 1e9 / 0.082  # FACTS.md: GraceAdam, 1B params in 0.082 s on 72 Grace cores

_GH200 = HardwareProfile(
    name="gh200",
    device_name="H100 96 GB HBM3 (GH200 Hopper)",
    cpu_name="Grace, 72 Neoverse V2 cores",
    device_peak_tflops=989.0,
    device_achieved_tflops=660.0,
    device_memory_bytes=96 * GB,
    device_mem_bw_gbps=4000.0,
    host_memory_bytes=480 * GB,
    host_mem_bw_gbps=500.0,
    cpu_cores=72,
    cpu_adam_params_per_s_per_core=_GRACE_ADAM / 72,
    cpu_adam_bw_efficiency=0.7,
    h2d_gbps=450.0,
    d2h_gbps=450.0,
    link_latency_s=20e-6,
    collective_gbps=50.0,
    collective_latency_s=10e-6,
    device_cast_gelems=4000.0 * 0.7 / 6,
    host_cast_gelems=500.0 * 0.6 / 6,
    sources=(
        ("device_peak_tflops", "FACTS.md: Hopper dense bf16 ~989 TFLOP/s (NVIDIA)"),
        ("device_achieved_tflops", "estimate: 2/3 of peak; the paper reports up to ~600 TFLOPS fine-tuning on one GH200"),
        ("device_memory_bytes", "FACTS.md: 96 GB HBM3 (a 144 GB HBM3e variant exists)"),
        ("device_mem_bw_gbps", "FACTS.md: HBM3 ~4 TB/s"),
        ("host_memory_bytes", "FACTS.md: up to 480 GB LPDDR5X"),
        ("host_mem_bw_gbps", "FACTS.md: ~500 GB/s LPDDR5X"),
        ("cpu_cores", "FACTS.md: 72 Neoverse V2 cores"),
        ("cpu_adam_params_per_s_per_core", "FACTS.md: GraceAdam 1B params in 0.082 s on 72 cores, split evenly (estimate of per-core scaling)"),
        ("cpu_adam_bw_efficiency", "estimate: 0.7 of STREAM (fused peers reach 0.8-0.9 of their floor on x86, FACTS.md)"),
        ("h2d_gbps", "FACTS.md: NVLink-C2C 450 GB/s per direction"),
        ("d2h_gbps", "FACTS.md: NVLink-C2C 450 GB/s per direction"),
        ("link_latency_s", "estimate: 20 us, so a 64 MB transfer reaches ~87% of peak (FACTS.md: near saturation from ~64 MB)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of LPDDR5X bandwidth at 6 B/element"),
        ("collective_gbps", "estimate: InfiniBand NDR 400 Gb/s = 50 GB/s per direction per GPU, one NIC per GH200 (multi-node clusters); inside a GH200 NVL32 NVLink domain use 450 (NVLink 4, 900 GB/s bidirectional per GPU, NVIDIA GH200 NVL32 material)"),
        ("collective_latency_s", "estimate: ~10 us per ring step (NCCL over InfiniBand, small messages)"),
    ),
    notes="One GH200 Superchip as in the SuperOffload paper's single-chip experiments.",
)

_GB200 = HardwareProfile(
    name="gb200",
    device_name="B200 186 GB HBM3e (one GPU of a GB200 Superchip)",
    cpu_name="Grace, half of 72 cores (one Grace serves two B200)",
    device_peak_tflops=2500.0,
    device_achieved_tflops=1500.0,
    device_memory_bytes=186 * GB,
    device_mem_bw_gbps=8000.0,
    host_memory_bytes=240 * GB,
    host_mem_bw_gbps=250.0,
    cpu_cores=36,
    cpu_adam_params_per_s_per_core=_GRACE_ADAM / 72,
    h2d_gbps=225.0,
    d2h_gbps=225.0,
    link_latency_s=20e-6,
    collective_gbps=900.0,
    collective_latency_s=5e-6,
    device_cast_gelems=8000.0 * 0.7 / 6,
    host_cast_gelems=250.0 * 0.6 / 6,
    sources=(
        ("device_peak_tflops", "estimate from NVIDIA GB200 NVL72 datasheet (~5 PFLOPS dense bf16 per 2 GPUs); not in FACTS.md"),
        ("device_achieved_tflops", "estimate: 60% of peak"),
        ("device_memory_bytes", "estimate from NVIDIA GB200 datasheet (186 GB HBM3e per GPU); not in FACTS.md"),
        ("device_mem_bw_gbps", "estimate from NVIDIA GB200 datasheet (8 TB/s per GPU)"),
        ("host_memory_bytes", "estimate: half of Grace's 480 GB (FACTS.md), shared by two GPUs"),
        ("host_mem_bw_gbps", "estimate: half of Grace's ~500 GB/s (FACTS.md)"),
        ("cpu_cores", "estimate: half of Grace's 72 cores (FACTS.md)"),
        ("cpu_adam_params_per_s_per_core", "FACTS.md GraceAdam figure per core (estimate of scaling)"),
        ("h2d_gbps", "estimate: half of NVLink-C2C's 450 GB/s per direction (FACTS.md), shared by two GPUs"),
        ("d2h_gbps", "estimate: half of NVLink-C2C's 450 GB/s per direction (FACTS.md)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
        ("collective_gbps", "estimate from NVIDIA GB200 NVL72 datasheet: NVLink 5, 1.8 TB/s bidirectional per GPU = 900 GB/s per direction; not in FACTS.md"),
        ("collective_latency_s", "estimate: ~5 us per ring step inside an NVLink domain"),
    ),
    notes="Per-GPU view of a GB200 Superchip: the Grace CPU and C2C are shared by two B200s.",
)

_MI300A = HardwareProfile(
    name="mi300a",
    device_name="MI300A (CDNA3, 228 CUs)",
    cpu_name="MI300A, 24 Zen 4 cores on the same package",
    device_peak_tflops=980.0,
    device_achieved_tflops=500.0,
    device_memory_bytes=128 * GB,
    device_mem_bw_gbps=5300.0,
    host_memory_bytes=128 * GB,
    host_mem_bw_gbps=400.0,
    cpu_cores=24,
    cpu_adam_params_per_s_per_core=0.8e9,
    h2d_gbps=1000.0,
    d2h_gbps=1000.0,
    link_latency_s=10e-6,
    collective_gbps=128.0,
    collective_latency_s=10e-6,
    device_cast_gelems=5300.0 * 0.7 / 6,
    host_cast_gelems=400.0 * 0.6 / 6,
    shared_memory=True,
    sources=(
        ("device_peak_tflops", "estimate from AMD MI300A datasheet (980.6 dense bf16); not in FACTS.md"),
        ("device_achieved_tflops", "estimate: ~50% of peak"),
        ("device_memory_bytes", "estimate from AMD datasheet: 128 GB unified HBM3 (one pool with the host)"),
        ("device_mem_bw_gbps", "estimate from AMD datasheet: 5.3 TB/s"),
        ("host_memory_bytes", "same pool as device memory (shared_memory=True)"),
        ("host_mem_bw_gbps", "estimate: what 24 Zen 4 cores can draw from HBM"),
        ("cpu_cores", "estimate from AMD datasheet: 24 Zen 4 cores"),
        ("cpu_adam_params_per_s_per_core", "estimate: FACTS.md x86 single-thread ~0.8 G/s"),
        ("h2d_gbps", "estimate: an in-HBM copy (no physical link)"),
        ("d2h_gbps", "estimate: an in-HBM copy (no physical link)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of CPU-side bandwidth at 6 B/element"),
        ("collective_gbps", "estimate from AMD MI300A material: Infinity Fabric links between the 4 APUs of a node, ~128 GB/s per direction per peer; not in FACTS.md"),
        ("collective_latency_s", "estimate: ~10 us per ring step"),
    ),
    notes="APU: one 128 GB pool; offloading saves no capacity, only device-side compute time.",
)


def _pcie(name: str, device: str, peak: float, achieved: float, mem: float, bw: float,
          peak_src: str, mem_src: str) -> HardwareProfile:
    x86_core = 0.8e9  # FACTS.md: single-pass AVX-512 probe, 828 M params/s on one thread
    return HardwareProfile(
        name=name,
        device_name=device,
        cpu_name="x86 server socket, 32 cores, DDR5",
        device_peak_tflops=peak,
        device_achieved_tflops=achieved,
        device_memory_bytes=mem,
        device_mem_bw_gbps=bw,
        host_memory_bytes=512 * GB,
        host_mem_bw_gbps=250.0,
        cpu_cores=32,
        cpu_adam_params_per_s_per_core=x86_core,
        cpu_adam_bw_efficiency=0.8,
        h2d_gbps=55.0,
        d2h_gbps=55.0,
        link_latency_s=10e-6,
        collective_gbps=25.0,
        collective_latency_s=10e-6,
        device_cast_gelems=bw * 0.7 / 6,
        host_cast_gelems=250.0 * 0.6 / 6,
        sources=(
            ("device_peak_tflops", peak_src),
            ("device_achieved_tflops", "estimate: ~2/3 of peak (FACTS.md: H200 SXM reaches ~790 of 989 on an 8192^3 matmul)"),
            ("device_memory_bytes", mem_src),
            ("device_mem_bw_gbps", mem_src),
            ("host_memory_bytes", "estimate: a typical 512 GB single-socket host"),
            ("host_mem_bw_gbps", "estimate: 8 channels DDR5-4800 (307 GB/s theoretical) at ~80%"),
            ("cpu_cores", "estimate: a 32-core socket"),
            ("cpu_adam_params_per_s_per_core", "FACTS.md: single-pass AVX-512 probe ~828 M params/s per thread"),
            ("cpu_adam_bw_efficiency", "FACTS.md: Adam-shaped traffic reaches ~1.6x STREAM triad on x86; 0.8 is an estimate"),
            ("h2d_gbps", "FACTS.md: PCIe Gen5 x16 ~64 GB/s theoretical; 55 is an estimate of pinned copies"),
            ("d2h_gbps", "FACTS.md: PCIe Gen5 x16 ~64 GB/s theoretical; 55 is an estimate of pinned copies"),
            ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
            ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
            ("collective_gbps", "estimate: GPU-to-GPU over PCIe Gen5 through the host (no NVLink), ~25 GB/s of the ~64 GB/s x16 theoretical (FACTS.md); set 50 for InfiniBand NDR 400 Gb/s across nodes"),
            ("collective_latency_s", "estimate: ~10 us per ring step"),
        ),
        notes="A discrete GPU on PCIe Gen5 in an x86 server: the link is ~8x slower than C2C.",
    )


_H100_PCIE = _pcie(
    "h100-pcie", "H100 PCIe 80 GB", 756.0, 500.0, 80 * GB, 2000.0,
    "estimate from NVIDIA H100 PCIe datasheet (756 dense bf16); not in FACTS.md",
    "estimate from NVIDIA H100 PCIe datasheet (80 GB HBM2e, 2 TB/s)",
)
_H200_PCIE = _pcie(
    "h200-pcie", "H200 NVL 141 GB (PCIe)", 836.0, 560.0, 141 * GB, 4800.0,
    "estimate from NVIDIA H200 NVL datasheet (836 dense bf16); FACTS.md: ~790 measured on H200 SXM",
    "FACTS.md: H200 141 GB HBM3e, 4.8 TB/s",
)

_LAPTOP = HardwareProfile(
    name="cpu-laptop",
    device_name="laptop CPU as the device (fp32, AVX2)",
    cpu_name="8-core laptop CPU",
    device_peak_tflops=0.8,
    device_achieved_tflops=0.3,
    device_memory_bytes=32 * GB,
    device_mem_bw_gbps=60.0,
    host_memory_bytes=32 * GB,
    host_mem_bw_gbps=60.0,
    cpu_cores=8,
    cpu_adam_params_per_s_per_core=0.6e9,
    h2d_gbps=20.0,
    d2h_gbps=20.0,
    link_latency_s=5e-6,
    collective_gbps=5.0,
    collective_latency_s=50e-6,
    device_cast_gelems=60.0 * 0.6 / 6,
    host_cast_gelems=60.0 * 0.6 / 6,
    shared_memory=True,
    sources=(
        ("device_peak_tflops", "estimate: 8 cores x 3 GHz x 32 fp32 FLOP/cycle"),
        ("device_achieved_tflops", "estimate: ~40% of peak in torch matmuls"),
        ("device_memory_bytes", "estimate: 32 GB laptop, one pool with the host"),
        ("device_mem_bw_gbps", "estimate: dual-channel DDR5"),
        ("host_memory_bytes", "same pool (shared_memory=True)"),
        ("host_mem_bw_gbps", "estimate: dual-channel DDR5"),
        ("cpu_cores", "estimate"),
        ("cpu_adam_params_per_s_per_core", "estimate, below FACTS.md's 828 M/s server-core figure"),
        ("h2d_gbps", "estimate: a memcpy on the CPU backend's transfer thread"),
        ("d2h_gbps", "estimate: a memcpy on the CPU backend's transfer thread"),
        ("device_cast_gelems", "estimate"),
        ("host_cast_gelems", "estimate"),
        ("collective_gbps", "estimate: gloo over loopback between processes on one CPU"),
        ("collective_latency_s", "estimate: ~50 us per gloo ring step"),
    ),
    notes="CPU-only: the engine's CPU backend, where the 'device' and the optimizer share cores.",
)

PROFILES: dict[str, HardwareProfile] = {
    p.name: p.validate() for p in (_GH200, _GB200, _MI300A, _H100_PCIE, _H200_PCIE, _LAPTOP)
}
NAMES: tuple[str, ...] = tuple(PROFILES)


def get(name: str) -> HardwareProfile:
    """The preset called `name` (case-insensitive); ValueError lists the known names."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; known profiles: {', '.join(NAMES)}")
    return PROFILES[key]


def names() -> list[str]:
    """The preset keys, in display order."""
    return list(NAMES)
