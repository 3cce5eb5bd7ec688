"""Hooks on FSDP2's units that order its collectives with the engine (docs/distributed.md).

FSDP2 all-gathers a unit in its own forward pre-hook, before any hook of the modules inside
it, and reduce-scatters it in backward. Per engine:

* ``_Publish``, prepended (runs before FSDP2's): the last publish of the buckets holding the
  unit's parameters, and those of the units it prefetches, has landed; on CUDA FSDP2's
  all-gather streams wait for the H2D event (``wait_publish``: ``set_post_optim_event`` is
  one event per root, not per unit);
* ``_Sync``, prepended on the root: this micro-step reduce-scatters (the last of an optimizer
  step, or each with ``grad_accum_on="host"``) or FSDP2 keeps summing unsharded gradients
  (``set_requires_gradient_sync``);
* ``_Usage``, after FSDP2's (the unit's parameters are the unsharded ones): which parameters
  got a gradient on this rank. FSDP2 reduces zeros for a parameter a rank did not use
  (``set_reduce_scatter_unused_params``, else the collectives would not match), so the engine
  steps a parameter iff some rank used it (as DDP + torch.optim), carrying this set in its
  validation reduce.

Each holds its targets weakly (runtime/lifetime.py: a model must not keep an engine alive).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from superoffload.distributed.fsdp.units import Unit
from superoffload.runtime.hook_base import PicklableHook, eager, in_backward


class UsageLog:
    """Parameter indices that got a gradient on this rank since the iteration started."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self._watched: dict[int, Any] = {}
        """id(unsharded parameter) -> its hook handle (registered once: FSDP2 keeps the
        unsharded parameter object after its first all-gather and refills its storage)."""

    def watch(self, param: torch.Tensor, index: int) -> None:
        if id(param) in self._watched:
            return
        ref = weakref.ref(self)

        def mark(_: torch.Tensor) -> None:
            log = ref()
            if log is not None:
                log.used.add(index)
        self._watched[id(param)] = param.register_post_accumulate_grad_hook(mark)

    def close(self) -> None:
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()


class _Usage(PicklableHook):
    """After FSDP2's pre-hook: watch the unit's unsharded parameters (see the docstring)."""

    def __init__(self, log: UsageLog, members: Sequence[tuple[str, int]]) -> None:
        self.log = weakref.ref(log)
        self.members = tuple(members)

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        log = self.log()
        if log is None or not torch.is_grad_enabled():
            return
        for name, index in self.members:
            p = module.get_parameter(name)
            if not hasattr(p, "device_mesh"):  # unsharded: autograd accumulates into it
                log.watch(p, index)


class _Publish(PicklableHook):
    """Prepended pre-hook of a unit: its buckets' (and its prefetched units') last publish."""

    def __init__(self, wait: Callable[[tuple[int, ...]], None], buckets: tuple[int, ...]) -> None:
        self.wait = weakref.WeakMethod(wait)  # type: ignore[arg-type]
        self.buckets = buckets

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        wait = self.wait()
        if wait is not None and not in_backward():
            wait(self.buckets)


class _Sync(PicklableHook):
    """Prepended pre-hook of the root: reduce this micro-step's gradients or keep summing."""

    def __init__(self, sync: Callable[[], bool | None]) -> None:
        self.sync = weakref.WeakMethod(sync)  # type: ignore[arg-type]

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        sync = self.sync()
        if sync is None or not torch.is_grad_enabled() or in_backward():
            return
        wanted = sync()  # set every forward: a training loop may have set it meanwhile
        if wanted is not None:
            module.set_requires_gradient_sync(wanted)  # type: ignore[operator]


def install(units: Sequence[Unit], *, index: dict[int, int],
            buckets_of: Callable[[Sequence[int]], tuple[int, ...]],
            prefetched: Callable[[Any], Sequence[Any]], wait: Callable[[tuple[int, ...]], None],
            sync: Callable[[], bool | None], log: UsageLog) -> list[Any]:
    """Register the three hooks on every unit (``units``: ``fsdp_units``, root first);
    returns the handles. ``buckets_of``: the buckets holding these parameter indices;
    ``prefetched``: the modules a module's forward prefetches. Every module of a grouped
    unit waits for the whole unit (FSDP2 gathers it at whichever runs first)."""
    owner = {id(m): u for u in units for m in u.modules}

    def members(unit: Unit) -> list[int]:
        return [index[id(p)] for p in unit.params if id(p) in index]

    handles: list[Any] = []
    for unit in units:
        own = members(unit)
        for module in unit.modules:
            ahead = [i for m in prefetched(module) if id(m) in owner for i in members(owner[id(m)])]
            handles.append(module.register_forward_pre_hook(
                _Publish(wait, buckets_of(own + ahead)), prepend=True))
            names = {id(p): n for n, p in module.named_parameters()}
            watched = [(names[id(p)], index[id(p)]) for p in unit.params
                       if id(p) in index and id(p) in names]
            handles.append(module.register_forward_pre_hook(_Usage(log, watched)))
    handles.append(units[0].modules[0].register_forward_pre_hook(_Sync(sync), prepend=True))
    return handles


def wait_publish(futures: Sequence[Future[Any]], wait: Callable[[Future[Any]], Any],
                 unit: Any = None) -> None:
    """CPU-wait for ``futures``; on CUDA their results are events of the H2D stream, which
    FSDP2's all-gather streams must wait on (``unit`` holds them)."""
    for fut in futures:
        event = wait(fut)
        if event is not None and unit is not None:
            streams = _all_gather_streams(unit)
            for stream in streams:
                stream.wait_event(event)


def _all_gather_streams(unit: Any) -> list[Any]:
    """FSDP2's copy-in and all-gather streams (one pair per root, shared by its units): the
    one place this package reads FSDP2's private state (torch 2.13 ``FSDPCommContext``)."""
    ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
    return [s for s in (getattr(ctx, "all_gather_copy_in_stream", None),
                        getattr(ctx, "all_gather_stream", None)) if s is not None]
