"""superoffload: train models larger than GPU memory by offloading optimizer work to the CPU.

After SuperOffload (Lian, Tanaka, Ruwase, Zhang, ASPLOS 2026, arXiv 2509.21271).

    import superoffload as so
    engine = so.initialize(model, optimizer={"lr": 3e-4}, config=so.presets.tiny_cpu())

``import superoffload`` starts no thread, writes no environment variable and imports
neither torch nor the kernel: each part loads on first use. The compiled kernel's first
call settles the process's OpenMP wait policy (it may start one daemon thread,
``superoffload-omp-throttle``; docs/kernel.md, "Threads, the work split and the OpenMP wait
policy"); ``python -m superoffload`` owns its process and sets ``OMP_WAIT_POLICY=PASSIVE``
before torch loads, unless the user set it (superoffload/process_env.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from superoffload.config import ConfigError, OffloadConfig

__version__ = "0.1.0"

# Names resolved on first use, so that `import superoffload` stays light (no torch, no
# plotly, no threads) and each part can be imported without the others.
_LAZY: dict[str, tuple[str, str | None]] = {
    "CPUAdam": ("superoffload.kernels.cpu_adam_optimizer", "CPUAdam"),
    "kernels": ("superoffload.kernels", None),
    "initialize": ("superoffload.runtime.initialize", "initialize"),
    "OffloadEngine": ("superoffload.runtime.engine", "OffloadEngine"),
    "from_deepspeed": ("superoffload.ds_config", "from_deepspeed"),
    "presets": ("superoffload.presets", None),
    "plan": ("superoffload.plan", None),
    "telemetry": ("superoffload.telemetry", None),
    "widgets": ("superoffload.widgets", None),
    "models": ("superoffload.models", None),
    "data": ("superoffload.data", None),
    "distributed": ("superoffload.distributed", None),
    # a run as a Hugging Face folder
    "export_hf": ("superoffload.export", "export_hf"),
    # the engine's contract errors (runtime/contract.py), caught as so.ContractError & co
    **{name: ("superoffload.runtime.contract", name) for name in (
        "ContractError", "GradientEdited", "WeightsWrittenInFlight", "MidIterationState",
        "RanksDisagree")},
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'superoffload' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ConfigError", "OffloadConfig", "__version__", *_LAZY]
