"""Ready-made OffloadConfigs (plain functions, like torchtitan's ``llama3_debugmodel()``).

Each returns a validated config; change fields with ``.replace(...)``.
"""

from __future__ import annotations

from superoffload.config import MiB, OffloadConfig


def tiny_cpu() -> OffloadConfig:
    """CPU-only machine, tiny models (tests, notebooks, CI): small buckets so a small model
    still has several, half the work offloaded, adaptive STV, host-side casting."""
    return OffloadConfig(
        device="cpu", bucket_bytes=256 * 1024, ratio=0.5, speculation="adaptive",
        grad_cast="host", param_cast="host", cpu_threads=1, pin_memory=False,
        watchdog_s=120.0,
    ).validate()


def gh200() -> OffloadConfig:
    """GH200 Superchip (paper's setting): 64 MiB buckets saturate NVLink-C2C (§4.2), 90% of
    the work offloaded (DeepSpeed's example ``ratio: 0.90``), gradients cast on the GPU and
    moved fp32 over the fast link, bf16 weights written by the CPU kernel (§4.4), 90% of
    Grace's cores for the optimizer (``cpuadam_cores_perc: 0.90``)."""
    return OffloadConfig(
        device="auto", bucket_bytes=64 * MiB, ratio=0.9, speculation="adaptive",
        grad_cast="device", param_cast="host", cpu_cores_frac=0.9, pin_memory=True,
    ).validate()


def pcie_host() -> OffloadConfig:
    """A discrete GPU on PCIe (~32-64 GB/s per direction, FACTS.md): move bf16 both ways
    (cast on the host, half the bytes), bigger share of the state kept on the GPU."""
    return OffloadConfig(
        device="auto", bucket_bytes=32 * MiB, ratio=0.7, speculation="adaptive",
        grad_cast="host", param_cast="host", cpu_cores_frac=0.9, pin_memory=True,
    ).validate()


CONFIG_PRESETS = {"tiny_cpu": tiny_cpu, "gh200": gh200, "pcie_host": pcie_host}
