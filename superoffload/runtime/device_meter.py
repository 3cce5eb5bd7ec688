"""Device-memory accounting for the CPU device ops, where the "device" is the CPU (DESIGN.md §3).

On CUDA ``torch.cuda.max_memory_allocated`` answers "how much device memory did this
iteration need"; on a CPU-only machine nothing does, so the memory claims -- weight-flow's
(paper §4.5: only ``prefetch_depth + 1`` blocks resident) and the gradients' (an offloaded
bucket's gradients leave the device with it, runtime/departures.py) -- would be untestable.
``DeviceMeter`` counts what lives on the device during training:

* weights: every parameter's current ``.data`` (a released weight-flow block holds 0
  elements, a fetched one its full buffer);
* gradients: every gradient tensor from its first accumulation until it is freed -- not
  only while it is ``p.grad``: a bucket's freed gradients stay alive in its D2H task until
  the copy has run, and count until then;
* activations: tensors autograd saves for backward (``torch.autograd.graph.
  saved_tensors_hooks``), counted by storage while the graph holds them -- parameters are
  excluded (they are the weights above), and checkpointed regions save only their inputs;
* optimizer state (``engine=`` given): the GPU tail buckets' device buffers (fp32 master
  unless the parameter is its own, and the moments).

It samples the sum at every save and every gradient accumulation (weight-flow fetches
precede the saves of their block, releases follow them), and keeps the peak and the parts
at the peak; ``peak_grad_bytes`` is the gradients' own peak. ``limit_bytes`` turns it into
a cap: exceeding it raises ``DeviceBudgetExceeded`` at the sample (a simulated
out-of-memory). Temporaries of an operator (freed before it returns) are not counted.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``t``: an FSDP2 DTensor's local shard, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


class DeviceBudgetExceeded(MemoryError):
    """The simulated device ran out of memory (DeviceMeter.limit_bytes)."""


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class DeviceMeter:
    """Peak device bytes of a model's weights + gradients + saved activations."""

    def __init__(self, model: torch.nn.Module, *, limit_bytes: int | None = None,
                 engine: Any = None) -> None:
        if limit_bytes is not None and limit_bytes < 1:
            raise ValueError(f"DeviceMeter(limit_bytes={limit_bytes}): use a positive byte count")
        self.model = model
        self.limit_bytes = limit_bytes
        self.engine = engine
        self._params = list({id(p): p for p in model.parameters()}.values())
        self._storages: dict[int, list[int]] = {}
        """storage pointer -> [bytes, live saved references]."""
        self._grads: dict[int, int] = {}
        """id of a live gradient tensor -> its bytes (removed when it is freed)."""
        self.activation_bytes = 0
        self.peak_bytes = 0
        self.peak_grad_bytes = 0
        self.peak_parts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ parts
    def weight_bytes(self) -> int:
        return sum(_nbytes(p.data) for p in self._params)

    def _see_grads(self) -> None:
        """Start counting every gradient a parameter holds now, until that tensor is freed."""
        for p in self._params:
            g = p.grad
            if g is None:
                continue
            with self._lock:
                if id(g) in self._grads:
                    continue
                self._grads[id(g)] = _nbytes(g)
            weakref.finalize(g, self._grad_freed, id(g))

    def _grad_freed(self, key: int) -> None:
        with self._lock:
            self._grads.pop(key, None)

    def grad_bytes(self) -> int:
        self._see_grads()
        with self._lock:
            return sum(self._grads.values())

    def optimizer_state_bytes(self) -> int:
        """The GPU tail buckets' device buffers (0 without ``engine=``)."""
        if self.engine is None:
            return 0
        return sum(f.numel() * f.element_size() for buf in self.engine.state.buffers
                   if buf.on_device for f in buf.flat)

    def sample(self) -> int:
        """Record the current total; raise when over the limit."""
        parts = {"weights": self.weight_bytes(), "grads": self.grad_bytes(),
                 "activations": self.activation_bytes,
                 "optimizer_state": self.optimizer_state_bytes()}
        total = sum(parts.values())
        self.peak_grad_bytes = max(self.peak_grad_bytes, parts["grads"])
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_parts = total, parts
        if self.limit_bytes is not None and total > self.limit_bytes:
            raise DeviceBudgetExceeded(
                f"simulated device memory {total} B exceeds limit_bytes={self.limit_bytes} "
                f"(weights {parts['weights']}, grads {parts['grads']}, activations "
                f"{parts['activations']}, optimizer state {parts['optimizer_state']})")
        return total

    # ------------------------------------------------------------------ saved activations
    def _pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        weights = {_local(p).untyped_storage().data_ptr() for p in self._params
                   if p.data.numel()}
        if isinstance(t, torch.nn.Parameter) or ptr in weights:
            # a weight (or a view of one): counted under weights
            return t
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
