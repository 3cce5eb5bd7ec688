"""A profile built from a real machine's measurements: one H200 on PCIe Gen5 with a 16-core
Xeon host (FACTS.md, "Measured on a lent H200 machine", 2026-11-30, project at ef04687).

Every figure says where it comes from. Three kinds:
  measured  a FACTS.md row as measured (links, casts, host bandwidth, Adam, matmul);
  derived   a measured row turned into what the model needs, with the arithmetic written
            out (the host bus from the copy bandwidth; device memory bandwidth from the cast);
  fitted    chosen so ONE measured row is reproduced (device_achieved_tflops from the plain
            PyTorch row) -- every other row of the calibration table is then a prediction;
  estimate  ours, not measured (per-bucket CPU-lane overhead, launch cost).
The calibration table it must reproduce, and the engine variant it is read with, are in
plan/facts.py; tests/test_plan_calibration.py pins both.
"""

from __future__ import annotations

from superoffload.plan.hardware import GB, GiB, HardwareProfile

MiB = 1 << 20

# FACTS.md: host memory bandwidth 71 GB/s as measure_local counted a copy (2 B per byte
# copied). A copy with ordinary stores also reads each destination line before writing it
# (x86 write-allocate; McCalpin's STREAM FAQ: STREAM does not count that read), so the bus
# carried 3/2 of it. That is the ~110 GB/s end of DESIGN.md §6's "~71-110 GB/s".
COPY_GBPS = 71.0
HOST_BUS_GBPS = COPY_GBPS * 3 / 2

# FACTS.md: device cast 529 G elements/s, 6 B per element (read fp32, write bf16): the rate an
# elementwise pass reaches in HBM (the H200's 4.8 TB/s is the vendor's peak).
DEVICE_CAST_GELEMS = 529.0
DEVICE_BW_GBPS = DEVICE_CAST_GELEMS * 6

# Fitted: FACTS.md plain row, GPT 24 x 2048 (vocab 256, learned positions, tied head, no
# activation checkpointing), bf16, batch 8 x 1024: 132.6 ms = forward + backward (6.4397e13
# executed FLOPs) + validation + fused AdamW (28 B/param over DEVICE_BW_GBPS, one launch per
# bucket). ``calibrate.fit_compute(profile, plan.facts.H200_SHAPE, 0.1326)`` solves it: 533.4
# TFLOP/s, 75% of the 708 TFLOP/s matmul probe (layer norms, GELU, attention, autocast).
ACHIEVED_TFLOPS = 533.4


def h200_pcie_measured() -> HardwareProfile:
    """The lent H200 machine as FACTS.md measured it (see the module docstring)."""
    fm = "FACTS.md (H200 machine, measured)"
    return HardwareProfile(
        name="h200-pcie-measured",
        device_name="H200 141 GB (PCIe Gen5 x16)",
        cpu_name="16-core Xeon host, 125 GiB",
        device_peak_tflops=836.0,
        device_achieved_tflops=ACHIEVED_TFLOPS,
        device_memory_bytes=141 * GB,
        device_mem_bw_gbps=DEVICE_BW_GBPS,
        host_memory_bytes=125 * GiB,
        host_mem_bw_gbps=HOST_BUS_GBPS,
        cpu_cores=16,
        cpu_adam_params_per_s_per_core=0.61e9,
        cpu_adam_bw_efficiency=1.0,
        cpu_adam_table=((1, 0.61e9), (8, 3.3e9), (16, 8.4e9)),
        h2d_gbps=54.8,
        d2h_gbps=55.2,
        link_latency_s=0.0,
        h2d_table=((64 * 1024, 3.9), (1 * MiB, 30.0), (16 * MiB, 52.0), (256 * MiB, 54.8)),
        d2h_table=((64 * 1024, 3.9), (1 * MiB, 30.0), (16 * MiB, 52.0), (256 * MiB, 55.2)),
        device_cast_gelems=DEVICE_CAST_GELEMS,
        host_cast_gelems=21.0,
        collective_gbps=25.0,
        collective_latency_s=10e-6,
        device_launch_s=10e-6,
        cpu_call_s=60e-6,
        shared_memory=False,
        device_type="cuda",
        host_write_allocate=True,
        flags=("cpu_adam_table was measured on one warm 134 MB buffer (cache, not DRAM: 8.4 G "
               "params/s x 28 B = 235 GB/s, above the 106.5 GB/s bus); it bounds the kernel's "
               "compute only, the host-memory lane caps it (plan/cost.py)",),
        sources=(
            ("device_peak_tflops", "spec: NVIDIA H200 NVL datasheet (836 dense bf16); "
                                   f"{fm}: 708 TFLOP/s bf16 matmul probe"),
            ("device_achieved_tflops", "fitted to the plain row of FACTS.md's bench_engine table "
                                       "(132.6 ms); arithmetic in plan/profiles_measured.py"),
            ("device_memory_bytes", "spec: FACTS.md: one NVIDIA H200 (141 GB)"),
            ("device_mem_bw_gbps", f"derived: {fm}: device cast 529 G elements/s x 6 B/element"),
            ("host_memory_bytes", f"measured: {fm}: 125 GiB RAM"),
            ("host_mem_bw_gbps", f"derived: {fm}: 71 GB/s copy (measure_local, 2 B per byte) x 3/2 "
                                 "for the copy's write-allocate read (STREAM FAQ)"),
            ("cpu_cores", f"measured: {fm}: 16-core Xeon host"),
            ("cpu_adam_params_per_s_per_core", f"measured: {fm}: our CPU Adam, 1 thread, 0.61 G "
                                               "params/s (warm buffer)"),
            ("cpu_adam_table", f"measured: {fm}: 0.61 / 3.3 / 8.4 G params/s at 1 / 8 / 16 "
                               "threads, one warm "
                               "134 MB buffer (cache-resident: a compute bound only)"),
            ("cpu_adam_bw_efficiency", "derived: host_mem_bw_gbps is itself measured, so the cap "
                                       "is 1.0 of it"),
            ("h2d_gbps", f"measured: {fm}: pinned H2D 54.8 GB/s at 256 MiB"),
            ("d2h_gbps", f"measured: {fm}: pinned D2H 55.2 GB/s at 256 MiB"),
            ("h2d_table", f"measured: {fm}: 3.9 GB/s at 64 KiB, 30 at 1 MiB, 52 at 16 MiB, 54.8 at "
                          "256 MiB"),
            ("d2h_table", f"measured: {fm}: 3.9 GB/s at 64 KiB, 30 at 1 MiB, 52 at 16 MiB, 55.2 at "
                          "256 MiB"),
            ("device_cast_gelems", f"measured: {fm}: device cast 529 G elements/s"),
            ("host_cast_gelems", f"measured: {fm}: host bf16 cast 21 G elements/s"),
            ("collective_gbps", "estimate: one GPU, no peer (PCIe P2P through the host, ~25 GB/s)"),
            ("collective_latency_s", "estimate: ~10 us per ring step"),
            ("device_launch_s", "estimate: ~10 us per kernel launch or event record"),
            ("cpu_call_s", "estimate: per-bucket work of the CPU lane besides the kernel pass "
                           "(validation with a host float(), 5-6 ffi.new, a span, a future and "
                           "the queue hand-off)"),
            ("host_write_allocate", "spec: x86 stores allocate (write-allocate reads)"),
            ("link_latency_s", "derived: 0, the measured tables carry the latency of each size"),
        ),
        notes="The H200 machine of FACTS.md: links, casts, host copy bandwidth and the warm "
              "Adam probe as measured; the host bus derived from the copy; compute fitted to "
              "the plain row. Read with plan.facts.H200_ENGINE (the engine it was measured with).",
    )
