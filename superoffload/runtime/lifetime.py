"""What the single-process engine and the ZeRO engine (superoffload.distributed.zero) share
about their lifetime: gradient zeroing across micro-steps, watchdog waits, context manager.

The engines differ in how they fail (`_raise_if_failed`) and close (`close`); those stay in
each engine.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from superoffload.config import OffloadConfig
from superoffload.runtime.transfers import wait_for

_E = TypeVar("_E", bound="EngineLifetime")


class EngineLifetime:
    """Mixin; the engine sets these attributes in its constructor."""

    config: OffloadConfig
    optimizer: Any
    _it: Any  # the iteration in progress (has `micro_step`)
    _params: list[torch.nn.Parameter]
    _trainable: list[int]

    def _raise_if_failed(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        # through the optimizer view, so optimizer.zero_grad() and engine.zero_grad() agree
        self.optimizer.zero_grad(set_to_none)

    def _zero_grad_impl(self, set_to_none: bool = True) -> None:
        if 0 < self._it.micro_step < self.config.grad_accum_steps:
            return  # mid-accumulation: keep the partial sums
        for i in self._trainable:
            p = self._params[i]
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def _wait(self, future: Future[Any], what: str) -> Any:
        """Wait with the watchdog; a lane failure surfaces as the engine's own error."""
        try:
            return wait_for(future, self.config.watchdog_s, what)
        except Exception:
            self._raise_if_failed()
            raise

    def __enter__(self: _E) -> _E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
