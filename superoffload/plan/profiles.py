"""Hardware profile presets: what the cost model and the simulator know about known machines.

A profile is plain data (DESIGN.md §5; the type is plan/hardware.py): device compute, device and
host memory, the link in each direction as a function of message size, cast rates on each side,
CPU Adam throughput as a function of cores, host memory bandwidth. `h200-pcie-measured`
(plan/profiles_measured.py) is built from a real machine's measurements (FACTS.md). Presets cite
where each figure comes from (`sources`); a figure marked "estimate" is ours, not a vendor's or
the paper's, and is the first thing to replace with `measure_local()` / `calibrate()` figures
from the real machine.

Units: bytes, seconds, GB/s = 1e9 B/s, TFLOPS = 1e12 FLOP/s, params/s.
"""

from __future__ import annotations

from superoffload.plan.hardware import GB, HardwareProfile
from superoffload.plan.profiles_measured import h200_pcie_measured
from superoffload.plan.storage_presets import nvme, with_tier

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
    h2d_gbps=375.0,
    d2h_gbps=297.0,
    link_latency_s=20e-6,
    collective_gbps=50.0,
    collective_latency_s=10e-6,
    device_cast_gelems=4000.0 * 0.7 / 6,
    host_cast_gelems=500.0 * 0.6 / 6,
    host_write_allocate=False,
    sources=(
        ("device_peak_tflops", "spec: FACTS.md: Hopper dense bf16 ~989 TFLOP/s (NVIDIA)"),
        ("device_achieved_tflops", "estimate: 2/3 of peak; the paper reports up to ~600 TFLOPS "
                                   "fine-tuning on one GH200"),
        ("device_memory_bytes", "spec: FACTS.md: 96 GB HBM3 (a 144 GB HBM3e variant exists)"),
        ("device_mem_bw_gbps", "spec: FACTS.md: HBM3 ~4 TB/s"),
        ("host_memory_bytes", "spec: FACTS.md: up to 480 GB LPDDR5X"),
        ("host_mem_bw_gbps", "spec: FACTS.md: ~500 GB/s LPDDR5X"),
        ("cpu_cores", "spec: FACTS.md: 72 Neoverse V2 cores"),
        ("cpu_adam_params_per_s_per_core", "measured: FACTS.md: GraceAdam 1B params in 0.082 s on "
                                           "72 cores (the paper's measurement), split evenly "
                                           "(per-core scaling estimated)"),
        ("cpu_adam_bw_efficiency", "estimate: 0.7 of STREAM (fused peers reach 0.8-0.9 of their "
                                   "floor on x86, FACTS.md)"),
        ("h2d_gbps", "measured: FACTS.md: published measurements of the GH200's NVLink-C2C, ~375 "
                     "GB/s host-to-device (the spec: 450 per direction)"),
        ("d2h_gbps", "measured: FACTS.md: published measurements of the GH200's NVLink-C2C, ~297 "
                     "GB/s device-to-host (the spec: 450 per direction)"),
        ("link_latency_s", "estimate: 20 us, so a 64 MB transfer reaches ~90% of the measured rate "
                           "(FACTS.md: near saturation from ~64 MB)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of LPDDR5X bandwidth at 6 B/element"),
        ("collective_gbps", "estimate: InfiniBand NDR 400 Gb/s = 50 GB/s per direction per GPU, "
                            "one NIC per GH200 (multi-node clusters); inside a GH200 NVL32 NVLink "
                            "domain use 450 (NVLink 4, 900 GB/s bidirectional per GPU, NVIDIA "
                            "GH200 NVL32 material)"),
        ("collective_latency_s", "estimate: ~10 us per ring step (NCCL over InfiniBand, small "
                                 "messages)"),
        ("host_write_allocate", "estimate: Neoverse V2 detects streaming writes and skips the "
                                "allocate read (Arm write streaming mode)"),
        ("gpus_per_host", "spec: FACTS.md: one Hopper GPU per Grace CPU (a Superchip)"),
    ),
    notes="One GH200 Superchip as in the SuperOffload paper's single-chip experiments; a "
          "storage tier of 4 PCIe Gen5 NVMe drives assumed (the drives are the operator's "
          "choice: --storage names another).",
)
_GH200 = with_tier(_GH200, nvme(4, "gen5", why="an assumption: no GH200 datasheet fixes the "
                                               "drives; 4 is FACTS.md's ZeRO-Infinity array"))

_GB200 = HardwareProfile(
    name="gb200",
    device_name="B200 186 GB HBM3e (one GPU of a GB200 Superchip)",
    cpu_name="Grace, 72 cores, shared by the Superchip's two B200",
    device_peak_tflops=2500.0,
    device_achieved_tflops=1500.0,
    device_memory_bytes=186 * GB,
    device_mem_bw_gbps=8000.0,
    host_memory_bytes=480 * GB,
    host_mem_bw_gbps=500.0,
    cpu_cores=72,
    cpu_adam_params_per_s_per_core=_GRACE_ADAM / 72,
    h2d_gbps=225.0,
    d2h_gbps=225.0,
    link_latency_s=20e-6,
    collective_gbps=900.0,
    collective_latency_s=5e-6,
    device_cast_gelems=8000.0 * 0.7 / 6,
    host_cast_gelems=500.0 * 0.6 / 6,
    host_write_allocate=False,
    gpus_per_host=2,
    sources=(
        ("device_peak_tflops", "spec: NVIDIA GB200 NVL72 datasheet (~5 PFLOPS dense bf16 per 2 "
                               "GPUs); not in FACTS.md"),
        ("device_achieved_tflops", "estimate: 60% of peak"),
        ("device_memory_bytes", "spec: NVIDIA GB200 datasheet (186 GB HBM3e per GPU); not in "
                                "FACTS.md"),
        ("device_mem_bw_gbps", "spec: NVIDIA GB200 datasheet (8 TB/s per GPU)"),
        ("host_memory_bytes", "spec: FACTS.md: Grace's 480 GB LPDDR5X"),
        ("host_mem_bw_gbps", "spec: FACTS.md: Grace's ~500 GB/s"),
        ("cpu_cores", "spec: FACTS.md: Grace's 72 cores"),
        ("gpus_per_host", "spec: NVIDIA GB200 datasheet: one Grace CPU and two B200 GPUs per "
                          "Superchip"),
        ("cpu_adam_params_per_s_per_core", "measured: FACTS.md GraceAdam figure per core (per-core "
                                           "scaling estimated)"),
        ("h2d_gbps", "estimate: half of NVLink-C2C's 450 GB/s per direction (FACTS.md), shared by "
                     "two GPUs"),
        ("link_latency_s", "estimate: 20 us, as GH200's C2C"),
        ("d2h_gbps", "estimate: half of NVLink-C2C's 450 GB/s per direction (FACTS.md)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
        ("collective_gbps", "estimate from NVIDIA GB200 NVL72 datasheet: NVLink 5, 1.8 TB/s "
                            "bidirectional per GPU = 900 GB/s per direction (NCCL reaches less); "
                            "not in FACTS.md"),
        ("collective_latency_s", "estimate: ~5 us per ring step inside an NVLink domain"),
        ("host_write_allocate", "estimate: Neoverse V2 detects streaming writes and skips the "
                                "allocate read (Arm write streaming mode)"),
    ),
    notes="One B200 of a GB200 Superchip: the Grace CPU (memory, cores) is shared by two B200s "
          "(gpus_per_host=2), the C2C split between them.",
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
        ("device_peak_tflops", "spec: AMD MI300A datasheet (980.6 dense bf16); not in FACTS.md"),
        ("device_achieved_tflops", "estimate: ~50% of peak"),
        ("device_memory_bytes", "spec: AMD MI300A datasheet: 128 GB unified HBM3 (one pool with "
                                "the host)"),
        ("device_mem_bw_gbps", "spec: AMD MI300A datasheet: 5.3 TB/s"),
        ("host_memory_bytes", "spec: AMD MI300A datasheet: the same 128 GB pool as device memory "
                              "(shared_memory=True)"),
        ("host_mem_bw_gbps", "estimate: what 24 Zen 4 cores can draw from HBM"),
        ("cpu_cores", "spec: AMD MI300A datasheet: 24 Zen 4 cores"),
        ("cpu_adam_params_per_s_per_core", "estimate: FACTS.md x86 single-thread ~0.8 G/s "
                                           "(measured on another x86)"),
        ("h2d_gbps", "estimate: an in-HBM copy (no physical link)"),
        ("d2h_gbps", "estimate: an in-HBM copy (no physical link)"),
        ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of CPU-side bandwidth at 6 B/element"),
        ("collective_gbps", "estimate from AMD MI300A material: Infinity Fabric links between the "
                            "4 APUs of a node, ~128 GB/s per direction per peer; not in FACTS.md"),
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
            ("device_achieved_tflops", "estimate: ~2/3 of peak (FACTS.md: H200 SXM reaches ~790 of "
                                       "989 on an 8192^3 matmul)"),
            ("device_memory_bytes", mem_src),
            ("device_mem_bw_gbps", mem_src),
            ("host_memory_bytes", "estimate: a typical 512 GB single-socket host"),
            ("host_mem_bw_gbps", "estimate: 8 channels DDR5-4800 (307 GB/s theoretical) at ~80%"),
            ("cpu_cores", "estimate: a 32-core socket"),
            ("cpu_adam_params_per_s_per_core", "estimate: FACTS.md's single-pass AVX-512 probe, "
                                               "~828 M params/s per thread on a 2-core Sapphire "
                                               "Rapids (not this host)"),
            ("cpu_adam_bw_efficiency", "estimate: 0.8 (FACTS.md: Adam-shaped traffic reaches ~1.6x "
                                       "STREAM triad on x86)"),
            ("h2d_gbps", "estimate: 55 GB/s of pinned copies over PCIe Gen5 x16 (~64 GB/s "
                         "theoretical, FACTS.md; 54.8 measured on FACTS.md's H200 host)"),
            ("d2h_gbps", "estimate: 55 GB/s of pinned copies over PCIe Gen5 x16 (~64 GB/s "
                         "theoretical, FACTS.md; 55.2 measured on FACTS.md's H200 host)"),
            ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
            ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
            ("collective_gbps", "estimate: GPU-to-GPU over PCIe Gen5 through the host (no NVLink), "
                                "~25 GB/s of the ~64 GB/s x16 theoretical (FACTS.md); set 50 for "
                                "InfiniBand NDR 400 Gb/s across nodes"),
            ("collective_latency_s", "estimate: ~10 us per ring step"),
        ),
        notes="A discrete GPU on PCIe Gen5 in an x86 server: the link is ~8x slower than C2C.",
    )


_H100_PCIE = _pcie(
    "h100-pcie", "H100 PCIe 80 GB", 756.0, 500.0, 80 * GB, 2000.0,
    "spec: NVIDIA H100 PCIe datasheet (756 dense bf16); not in FACTS.md",
    "spec: NVIDIA H100 PCIe datasheet (80 GB HBM2e, 2 TB/s)",
)
_H200_PCIE = _pcie(
    "h200-pcie", "H200 NVL 141 GB (PCIe)", 836.0, 560.0, 141 * GB, 4800.0,
    "spec: NVIDIA H200 NVL datasheet (836 dense bf16); FACTS.md: ~790 measured on H200 SXM",
    "spec: FACTS.md: H200 141 GB HBM3e, 4.8 TB/s",
)

def _sxm(name: str, device: str, peak: float, mem: float, bw: float, link: float,
         nvlink: float, host: str, host_gb: float, host_bw: float, cores: int, datasheet: str,
         server: str, drives: int) -> HardwareProfile:
    """One SXM GPU of an 8-GPU HGX/DGX server. The host figures are the server's; the eight
    GPUs share them (``gpus_per_host=8``), so one GPU's job gets an eighth of the memory,
    cores, memory bus and internal NVMe drives unless told it has the whole host
    (``replace(gpus_per_host=1)``, ``--gpus-per-host 1``)."""
    tier = nvme(drives, "gen4", why=f"{server}: {drives} x 3.84 TB NVMe U.2 internal storage; "
                                    "the datasheet names no drive model")
    return with_tier(_sxm_base(name, device, peak, mem, bw, link, nvlink, host, host_gb,
                               host_bw, cores, datasheet, server), tier)


def _sxm_base(name: str, device: str, peak: float, mem: float, bw: float, link: float,
              nvlink: float, host: str, host_gb: float, host_bw: float, cores: int,
              datasheet: str, server: str) -> HardwareProfile:
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
        gpus_per_host=8,
        sources=(
            ("device_peak_tflops", f"spec: {datasheet}: dense BF16 Tensor Core (half the sparsity "
                                   "figure)"),
            ("device_achieved_tflops", "estimate: 2/3 of peak (FACTS.md: H200 SXM reaches ~790 of "
                                       "989 on an 8192^3 matmul; a training step less)"),
            ("device_memory_bytes", f"spec: {datasheet}: GPU memory"),
            ("device_mem_bw_gbps", f"spec: {datasheet}: GPU memory bandwidth"),
            ("host_memory_bytes", f"spec: {server}: system memory, the whole server's (one GPU's "
                                  "share: 1/gpus_per_host)"),
            ("host_mem_bw_gbps", "estimate: two sockets' DDR channels (theoretical) at ~80%"),
            ("cpu_cores", f"spec: {server}: both sockets' cores (one GPU's share: "
                          "1/gpus_per_host)"),
            ("gpus_per_host", f"spec: {server}: 8 GPUs share the host"),
            ("cpu_adam_params_per_s_per_core", "estimate: FACTS.md's single-pass AVX-512 probe, "
                                               "~828 M params/s per thread on a 2-core Sapphire "
                                               "Rapids (not this host)"),
            ("cpu_adam_bw_efficiency", "estimate: as the PCIe hosts (Adam-shaped traffic ~1.6x "
                                       "STREAM triad on x86, FACTS.md)"),
            ("h2d_gbps", f"estimate: {datasheet} gives the PCIe link both ways together; ~85% of "
                         "one direction for pinned copies"),
            ("d2h_gbps", f"estimate: {datasheet} gives the PCIe link both ways together; ~85% of "
                         "one direction for pinned copies"),
            ("device_cast_gelems", "estimate: 70% of HBM bandwidth at 6 B/element"),
            ("host_cast_gelems", "estimate: 60% of host bandwidth at 6 B/element"),
            ("collective_gbps", f"estimate from the {datasheet.split(' (')[0]}: NVLink between the "
                                "server's GPUs is given both ways together; half of it per "
                                "direction, the peak (NCCL reaches less)"),
            ("collective_latency_s", "estimate: ~5 us per ring step inside an NVLink domain"),
        ),
        notes=f"One SXM GPU of {server.split(' datasheet')[0]}: PCIe to the host, NVLink between "
              "GPUs; the host (memory, cores, drives) shared by 8 GPUs.",
    )


_A100_SXM = _sxm(
    "a100-sxm", "A100 SXM 80 GB", 312.0, 80 * GB, 2039.0, 27.0, 300.0,
    "2x AMD EPYC 7742 (Rome), 128 cores, DDR4-3200", 2048, 410.0 * 0.8, 128,
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM: BF16 312 TFLOPS dense / 624 sparse, 80 "
    "GB HBM2e, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s)",
    "DGX A100 datasheet (2x AMD EPYC 7742, 2 TB)", 4)
_H100_SXM = _sxm(
    "h100-sxm", "H100 SXM 80 GB", 989.0, 80 * GB, 3350.0, 55.0, 450.0,
    "2x Intel Xeon Platinum 8480C, 112 cores, DDR5-4800", 2048, 614.0 * 0.8, 112,
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 1,979 TFLOPS with sparsity, 80 GB HBM3, "
    "3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s)",
    "DGX H100 datasheet (2x Intel Xeon Platinum 8480C, 2 TB)", 8)
_H200_SXM = _sxm(
    "h200-sxm", "H200 SXM 141 GB", 989.0, 141 * GB, 4800.0, 55.0, 450.0,
    "2x Intel Xeon Platinum 8480C, 112 cores, DDR5-4800", 2048, 614.0 * 0.8, 112,
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: BF16 1,979 TFLOPS with sparsity, 141 GB "
    "HBM3e, 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s)",
    "DGX H200 datasheet (2x Intel Xeon Platinum 8480C, 2 TB)", 8)

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
        ("host_memory_bytes", "estimate: the same 32 GB pool (shared_memory=True)"),
        ("host_mem_bw_gbps", "estimate: dual-channel DDR5"),
        ("cpu_cores", "estimate: an 8-core laptop"),
        ("cpu_adam_params_per_s_per_core", "estimate, below FACTS.md's 828 M/s server-core figure"),
        ("h2d_gbps", "estimate: a memcpy on the CPU backend's transfer thread"),
        ("link_latency_s", "estimate: ~5 us to hand a copy to the transfer thread"),
        ("d2h_gbps", "estimate: a memcpy on the CPU backend's transfer thread"),
        ("device_cast_gelems", "estimate: 60% of the memory bandwidth at 6 B/element"),
        ("host_cast_gelems", "estimate: 60% of the memory bandwidth at 6 B/element"),
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
