"""Hooks on FSDP2's units that order its collectives with the engine (docs/distributed.md).

FSDP2 all-gathers a unit in its own forward pre-hook, before any hook of the modules inside
it, and reduce-scatters it in backward. ``UnitHooks`` puts three hooks on every unit; the FSDP2
engine installs them (fsdp_engine.py: FSDP2 is applied to the model at the edge, not in the step),
and they call the transport and the engine one way -- nothing here is called back:

* ``_Publish``, prepended (runs before FSDP2's): the transport's last publish of the buckets
  holding the unit's parameters, and those of the units it prefetches, has landed
  (``FsdpTransport.wait_published``); on CUDA FSDP2's all-gather streams then wait for the
  H2D events (``_gather_after``: ``set_post_optim_event`` is one event per root, not per
  unit);
* ``_Sync``, prepended on the root: this micro-step reduce-scatters (the last of an optimizer
  step, or each with ``grad_accum_on="host"``) or FSDP2 keeps summing unsharded gradients
  (``set_requires_gradient_sync``), as the engine's rule says;
* ``_Usage``, after FSDP2's (the unit's parameters are the unsharded ones): which parameters
  got a gradient on this rank (``UsageLog``). FSDP2 reduces zeros for a parameter a rank did
  not use (``set_reduce_scatter_unused_params``, else the collectives would not match), so
  the engine steps a parameter iff some rank used it (as DDP + torch.optim): the transport's
  validation reduce carries the log's set.

Each holds its targets weakly (runtime/lifetime.py: a model must not keep an engine alive).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from superoffload.distributed.fsdp.units import Unit
from superoffload.runtime.hook_base import PicklableHook, eager, in_backward


class PublishWaits(Protocol):
    """What a unit's pre-hook waits on (``FsdpTransport``)."""

    def wait_published(self, indices: Sequence[int]) -> list[Any]:
        """Wait for the last publish of every bucket holding parameters ``indices``; their
        results (on CUDA the H2D events)."""
        ...


class UsageLog:
    """Parameter indices that got a gradient on this rank since the optimizer step began."""

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
            # unsharded (autograd accumulates into it) and trained: a frozen one has no hook
            if not hasattr(p, "device_mesh") and p.requires_grad:
                log.watch(p, index)


class _Publish(PicklableHook):
    """Prepended pre-hook of a unit: its buckets' (and its prefetched units') last publish."""

    def __init__(self, waits: weakref.ref[PublishWaits], indices: tuple[int, ...],
                 root: weakref.ref[torch.nn.Module]) -> None:
        self.waits, self.indices, self.root = waits, indices, root

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        waits = self.waits()
        # a recompute in backward gathers what it has
        if waits is None or in_backward():
            return
        events = [e for e in waits.wait_published(self.indices) if e is not None]
        root = self.root()
        # on the CPU a landed publish is all there is
        if events and root is not None:
            _gather_after(events, root)


class _Sync(PicklableHook):
    """Prepended pre-hook of the root: reduce this micro-step's gradients or keep summing."""

    def __init__(self, rule: weakref.WeakMethod[Callable[[], bool]]) -> None:
        self.rule = rule

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        rule = self.rule()
        if rule is None or not torch.is_grad_enabled() or in_backward():
            return
        # set every forward: a training loop may have set it meanwhile
        module.set_requires_gradient_sync(rule())  # type: ignore[operator]


class UnitHooks:
    """The engine's hooks on every FSDP2 unit of one model (see the module docstring).
    ``units``: ``fsdp_units``, root first. The engine's hook list holds this object, so
    ``remove()`` takes every hook off with the engine's own (runtime/lifetime.py)."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = list(units)
        self.usage = UsageLog()
        self.prefetch: dict[int, list[Any]] = {}
        """id(unit module) -> the modules FSDP2 all-gathers during its forward."""
        self.handles: list[Any] = []
        self._targets: tuple[dict[int, int], weakref.ref[PublishWaits],
                             weakref.WeakMethod[Callable[[], bool]]] | None = None

    def set_prefetch(self, modules: Sequence[Any], depth: int) -> None:
        """FSDP2 all-gathers the next ``depth`` of ``modules`` (forward order) during each
        one's forward; the publish waits follow (a prefetched unit's all-gather is issued
        in its predecessor's pre-hook)."""
        self.prefetch = {}
        for k, module in enumerate(modules):
            ahead = list(modules[k + 1:k + 1 + depth])
            module.set_modules_to_forward_prefetch(ahead)
            self.prefetch[id(module)] = ahead
        # installed and not removed: the waits follow now
        if self._targets is not None:
            self._install(*self._targets)

    def install(self, index: Mapping[int, int], waits: PublishWaits,
                rule: Callable[[], bool]) -> None:
        """Register the three hooks on every unit. ``index``: id(parameter) -> its index,
        every parameter of the model (the transport maps them to its buckets at each wait,
        so a re-plan needs no new hooks); ``waits``: the transport; ``rule``: the engine's
        ``() -> bool``, does this micro-step's backward reduce-scatter."""
        self._targets = (dict(index), weakref.ref(waits), weakref.WeakMethod(rule))
        self._install(*self._targets)

    def _install(self, index: dict[int, int], waits: weakref.ref[PublishWaits],
                 rule: weakref.WeakMethod[Callable[[], bool]]) -> None:
        self._remove_handles()
        owner = {id(m): u for u in self.units for m in u.modules}
        root = weakref.ref(self.units[0].modules[0])

        def members(unit: Unit) -> list[int]:
            return [index[id(p)] for p in unit.params if id(p) in index]

        for unit in self.units:
            own = members(unit)
            # a grouped unit: FSDP2 gathers it at the first
            for module in unit.modules:
                ahead = [i for m in self.prefetch.get(id(module), []) if id(m) in owner
                         for i in members(owner[id(m)])]
                self.handles.append(module.register_forward_pre_hook(
                    _Publish(waits, tuple(own + ahead), root), prepend=True))
                names = {id(p): n for n, p in module.named_parameters()}
                watched = [(names[id(p)], index[id(p)]) for p in unit.params
                           if id(p) in index and id(p) in names]
                self.handles.append(module.register_forward_pre_hook(
                    _Usage(self.usage, watched)))
        self.handles.append(self.units[0].modules[0].register_forward_pre_hook(
            _Sync(rule), prepend=True))

    def _remove_handles(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def remove(self) -> None:
        """Every hook off the model (idempotent); a later ``set_prefetch`` puts none back."""
        self._targets = None
        self._remove_handles()
        self.usage.close()


def _gather_after(events: Sequence[Any], root: Any) -> None:
    """FSDP2's copy-in and all-gather streams wait for ``events`` (the H2D copies' events)."""
    streams = _all_gather_streams(root)
    for event in events:
        for stream in streams:
            stream.wait_event(event)


def _all_gather_streams(unit: Any) -> list[Any]:
    """FSDP2's copy-in and all-gather streams (one pair per root, shared by its units): the
    one place this package reads FSDP2's private state (torch 2.13 ``FSDPCommContext``)."""
    ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
    return [s for s in (getattr(ctx, "all_gather_copy_in_stream", None),
                        getattr(ctx, "all_gather_stream", None)) if s is not None]
