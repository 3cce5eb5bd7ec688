"""Hooks that drive ZeroOffloadEngine's schedule (as runtime/hooks.py does for one process).

* post-accumulate-grad hook per trainable parameter: on the last micro-step, counts the
  bucket's final gradients; a complete bucket is marked ready and the engine issues its
  collectives in bucket order (zero.py ``_mark_ready``);
* forward pre-hook per module owning parameters: waits for *that* bucket's last all-gather
  only, so a module runs as soon as its own weights are back (paper §4.2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from superoffload.distributed.zero import ZeroOffloadEngine


def register(engine: ZeroOffloadEngine) -> list[Any]:
    """Install every hook; returns the handles (``.remove()`` on close)."""
    handles: list[Any] = []
    for i in engine._trainable:
        handles.append(engine._params[i].register_post_accumulate_grad_hook(_grad_hook(engine, i)))
    for module in engine.model.modules():
        own = tuple(engine._index[id(p)] for p in module.parameters(recurse=False)
                    if id(p) in engine._index and engine._index[id(p)] in engine._bucket_of)
        if own:
            handles.append(module.register_forward_pre_hook(_wait_hook(engine, own)))
    return handles


def _grad_hook(engine: ZeroOffloadEngine, index: int) -> Any:
    def hook(param: torch.Tensor) -> None:
        it = engine._it
        if not it.armed:
            return  # not the last micro-step: gradients keep accumulating in .grad
        b = engine._bucket_of[index]
        with engine._lock:  # CUDA runs hooks on autograd's device threads
            fired = it.fired.setdefault(b, set())
            fired.add(index)
            if len(fired) == len(engine.bucket_plan.buckets[b].param_indices):
                engine._mark_ready(b)
    return hook


def _wait_hook(engine: ZeroOffloadEngine, indices: tuple[int, ...]) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        engine._raise_if_failed()
        for b in sorted({engine._bucket_of[i] for i in indices}):
            fut = engine._pending.pop(b, None)
            if fut is not None:
                engine.backend.wait(engine._wait(fut, f"all-gather of bucket {b}"))
    return hook
