"""Hardware profile presets: what the cost model and the simulator know about known machines.

A profile is plain data (DESIGN.md §5; the type is plan/hardware.py): device compute, device
and host memory, the link in each direction as a function of message size, cast rates on each
side, CPU Adam throughput as a function of cores, host memory bandwidth. `h200-pcie-measured`
(plan/profiles_measured.py) is built from a real machine's measurements (FACTS.md). Presets cite where each figure comes from
(`sources`); a figure marked "estimate" is ours, not a vendor's or the paper's, and is the first
thing to replace with `measure_local()` / `calibrate()` figures from the real machine.

Units: bytes, seconds, GB/s = 1e9 B/s, TFLOPS = 1e12 FLOP/s, params/s.
"""

from __future__ import annotations

from superoffload.plan.hardware import GB, HardwareProfile
from superoffload.plan.profiles_measured import h200_pcie_measured

__all__ = ["NAMES", "PROFILES", "get", "names"]


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
    host_write_allocate=False,
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
        ("host_write_allocate", "estimate: Neoverse V2 detects streaming writes and skips the allocate read (Arm write streaming mode)"),
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
    host_write_allocate=False,
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
        ("host_write_allocate", "estimate: Neoverse V2 detects streaming writes and skips the allocate read (Arm write streaming mode)"),
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

def _sxm(name: str, device: str, peak: float, mem: float, bw: float, link: float,
         nvlink: float, host: str, host_gb: float, host_bw: float, cores: int, datasheet: str,
         server: str) -> HardwareProfile:
    """One SXM GPU of an 8-GPU HGX/DGX server with the server's host to itself (a single-GPU
    run; eight ranks share it: ``--dp 8 --ranks-per-host 8``)."""
    x86_core = 0.8e9  # FACTS.md: single-pass AVX-512 probe, 828 M params/s on one thread
    return HardwareProfile(
        name=name,
        device_name=device,
        cpu_name=host,
        device_peak_tflops=peak,
        device_achieved_tflops=round(peak * 2 / 3, 1),
        device_memory_bytes=mem,
        device_mem_bw_gbps=bw,
        host_memory_bytes=host_gb * GB,
        host_mem_bw_gbps=host_bw,
        cpu_cores=cores,
        cpu_adam_params_per_s_per_core=x86_core,
        cpu_adam_bw_efficiency=0.8,
        h2d_gbps=link,
        d2h_gbps=link,
        link_latency_s=10e-6,
        collective_gbps=nvlink,
        collective_latency_s=5e-6,
        device_cast_gelems=bw * 0.7 / 6,
        host_cast_gelems=host_bw * 0.6 / 6,
        sources=(
            ("device_peak_tflops", f"{datasheet}: dense BF16 Tensor Core (half the sparsity figure)"),
            ("device_achieved_tflops", "estimate: 2/3 of peak (FACTS.md: H200 SXM reaches ~790 of 989 on an 8192^3 matmul; a training step less)"),
            ("device_memory_bytes", f"{datasheet}: GPU memory"),
            ("device_mem_bw_gbps", f"{datasheet}: GPU memory bandwidth"),
            ("host_memory_bytes", f"{server}: system memory (a single-GPU run has all of it)"),
            ("host_mem_bw_gbps", "estimate: two sockets' DDR channels (theoretical) at ~80%"),
            ("cpu_cores", f"{server}: both sockets' cores"),
            ("cpu_adam_params_per_s_per_core", "FACTS.md: single-pass AVX-512 probe ~828 M params/s per thread"),
            ("cpu_adam_bw_efficiency", "estimate: as the PCIe hosts (Adam-shaped traffic ~1.6x STREAM triad on x86, FACTS.md)"),
            ("h2d_gbps", f"estimate: {datasheet} gives the PCIe link both ways together; ~85% of one direction for pinned copies"),
            ("d2h_gbps", f"estimate: {datasheet} gives the PCIe link both ways together; ~85% of one direction for pinned copies"),
            ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
            ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
            ("collective_gbps", f"estimate from the {datasheet.split(' (')[0]}: NVLink between the server's GPUs is given both ways together; half of it per direction, the peak (NCCL reaches less)"),
            ("collective_latency_s", "estimate: ~5 us per ring step inside an NVLink domain"),
        ),
        notes=f"One SXM GPU of {server.split(' datasheet')[0]}, the host to itself: PCIe to the host, NVLink between GPUs.",
    )


_A100_SXM = _sxm(
    "a100-sxm", "A100 SXM 80 GB", 312.0, 80 * GB, 2039.0, 27.0, 300.0,
    "2x AMD EPYC 7742 (Rome), 128 cores, DDR4-3200", 2048, 410.0 * 0.8, 128,
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: BF16 312 TFLOPS dense / 624 sparse, 80 GB HBM2e, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s)",
    "DGX A100 datasheet (2x AMD EPYC 7742, 2 TB)")
_H100_SXM = _sxm(
    "h100-sxm", "H100 SXM 80 GB", 989.0, 80 * GB, 3350.0, 55.0, 450.0,
    "2x Intel Xeon Platinum 8480C, 112 cores, DDR5-4800", 2048, 614.0 * 0.8, 112,
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 1,979 TFLOPS with sparsity, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s)",
    "DGX H100 datasheet (2x Intel Xeon Platinum 8480C, 2 TB)")
_H200_SXM = _sxm(
    "h200-sxm", "H200 SXM 141 GB", 989.0, 141 * GB, 4800.0, 55.0, 450.0,
    "2x Intel Xeon Platinum 8480C, 112 cores, DDR5-4800", 2048, 614.0 * 0.8, 112,
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: BF16 1,979 TFLOPS with sparsity, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s)",
    "DGX H200 datasheet (2x Intel Xeon Platinum 8480C, 2 TB)")

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
    device_type="cpu",
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
    p.name: p.validate() for p in (_GH200, _GB200, _MI300A, _H100_PCIE, _H200_PCIE, _A100_SXM,
                                   _H100_SXM, _H200_SXM, _LAPTOP, h200_pcie_measured())
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
