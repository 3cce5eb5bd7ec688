"""Device-memory accounting for the CPU backend, where the "device" is the CPU (DESIGN.md §3).

On CUDA ``torch.cuda.max_memory_allocated`` answers "how much device memory did this
iteration need"; on a CPU-only machine nothing does, so weight-flow's memory claim (paper
§4.5: only ``prefetch_depth + 1`` blocks resident) would be untestable. ``DeviceMeter``
counts the three things that live on the device during training:

* weights: every parameter's current ``.data`` (a released weight-flow block holds 0
  elements, a fetched one its full buffer);
* gradients: every parameter's live ``.grad`` (weight-flow frees a block's gradients once
  its bucket has left for the host);
* activations: tensors autograd saves for backward (``torch.autograd.graph.
  saved_tensors_hooks``), counted by storage while the graph holds them -- parameters are
  excluded (they are the weights above), and checkpointed regions save only their inputs.

It samples the sum at every save and every gradient accumulation (weight-flow fetches
precede the saves of their block, releases follow them), and keeps the peak. ``limit_bytes`` turns it into a cap: exceeding it raises
``DeviceBudgetExceeded`` at the sample (a simulated out-of-memory).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class DeviceBudgetExceeded(MemoryError):
    """The simulated device ran out of memory (DeviceMeter.limit_bytes)."""


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class DeviceMeter:
    """Peak device bytes of a model's weights + gradients + saved activations."""

    def __init__(self, model: torch.nn.Module, *, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 1:
            raise ValueError(f"DeviceMeter(limit_bytes={limit_bytes}): use a positive byte count")
        self.model = model
        self.limit_bytes = limit_bytes
        self._params = list({id(p): p for p in model.parameters()}.values())
        self._storages: dict[int, list[int]] = {}
        """storage pointer -> [bytes, live saved references]."""
        self.activation_bytes = 0
        self.peak_bytes = 0
        self.peak_parts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ parts
    def weight_bytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self._params)

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self._params
                   if p.grad is not None)

    def sample(self) -> int:
        """Record the current total; raise when over the limit."""
        parts = {"weights": self.weight_bytes(), "grads": self.grad_bytes(),
                 "activations": self.activation_bytes}
        total = sum(parts.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_parts = total, parts
        if self.limit_bytes is not None and total > self.limit_bytes:
            raise DeviceBudgetExceeded(
                f"simulated device memory {total} B exceeds limit_bytes={self.limit_bytes} "
                f"(weights {parts['weights']}, grads {parts['grads']}, activations "
                f"{parts['activations']})")
        return total

    # ------------------------------------------------------------------ saved activations
    def _pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        weights = {p.untyped_storage().data_ptr() for p in self._params if p.data.numel()}
        if isinstance(t, torch.nn.Parameter) or ptr in weights:
            return t  # a weight (or a view of one): counted under weights
        nbytes = t.untyped_storage().nbytes()
        with self._lock:
            entry = self._storages.setdefault(ptr, [nbytes, 0])
            if entry[1] == 0:
                self.activation_bytes += nbytes
            entry[1] += 1
        box = _Saved(t)
        weakref.finalize(box, self._unref, ptr)
        self.sample()
        return box

    def _unref(self, ptr: int) -> None:
        with self._lock:
            entry = self._storages.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.activation_bytes -= entry[0]
                del self._storages[ptr]

    @staticmethod
    def _unpack(box: Any) -> torch.Tensor:
        return box.tensor if isinstance(box, _Saved) else box

    @contextmanager
    def track(self) -> Iterator[DeviceMeter]:
        """Meter everything run inside (forward and backward of one or more iterations)."""
        def on_grad(_param: torch.Tensor) -> None:
            self.sample()

        self._handles = [p.register_post_accumulate_grad_hook(on_grad)
                         for p in self._params if p.requires_grad]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
