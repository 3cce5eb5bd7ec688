"""superoffload: train models larger than GPU memory by offloading optimizer work to the CPU.

After SuperOffload (Lian, Tanaka, Ruwase, Zhang, ASPLOS 2026, arXiv 2509.21271).

    import superoffload as so
    engine = so.initialize(model, optimizer={"lr": 3e-4}, config=so.presets.tiny_cpu())
"""

from __future__ import annotations

import importlib
from typing import Any

from superoffload import kernels
from superoffload.config import ConfigError, OffloadConfig

__version__ = "0.1.0"

# Names resolved on first use, so that `import superoffload` stays light (no plotly, no
# threads) and each part can be imported without the others.
_LAZY: dict[str, tuple[str, str | None]] = {
    "CPUAdam": ("superoffload.kernels.optimizer", "CPUAdam"),
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


__all__ = ["ConfigError", "OffloadConfig", "__version__", "kernels", *_LAZY]
