"""Module and parameter hooks that drive the schedule (paper §4.2; DESIGN.md §3 steps 1-2).

* post-accumulate-grad hook per trainable parameter: on the last micro-step, tells the
  scheduler its gradient is final (a tied parameter has one AccumulateGrad node, so it
  fires once, after all its uses); a bucket launches when all of its have;
* forward pre-hook per module owning parameters: waits for *that* bucket's last publish
  only, so the first layers (GPU tail buckets) start while the CPU finishes the last ones;
* forward pre/post hooks on the root module: the forward span of the timeline, and a
  failed lane surfacing before any work is done.

The hooks hold only weak references to the scheduler, the module and the parameter they
were registered for: a dropped engine is collected (runtime/lifetime.py removes them), and
a deep copy of the model (whose hook tables are copied) does nothing on the copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from superoffload.runtime.hook_base import PicklableHook, eager
from superoffload.runtime.scheduler import IterationScheduler
from superoffload.telemetry.events import KIND_FORWARD, LANE_COMPUTE


def in_backward() -> bool:
    """True inside autograd's backward pass (activation-checkpoint recompute re-enters module
    forwards there). One place for the private call: ``torch._C._current_graph_task_id()`` is
    -1 outside a graph task (torch/csrc/autograd/python_engine.cpp)."""
    return bool(torch._C._current_graph_task_id() != -1)


def register(model: torch.nn.Module, sched: IterationScheduler,
             raise_if_failed: Callable[[], None]) -> list[Any]:
    """Install every hook; returns the handles (``.remove()`` on close)."""
    st = sched.state
    ref = weakref.ref(sched)
    handles: list[Any] = []
    for i in st.trainable:
        p = st.params[i]
        handles.append(p.register_post_accumulate_grad_hook(_GradReady(ref, weakref.ref(p), i)))
    for module in model.modules():
        own = tuple(st.index[id(p)] for p in module.parameters(recurse=False)
                    if id(p) in st.index and st.index[id(p)] in st.bucket_of)
        if own:
            handles.append(module.register_forward_pre_hook(
                _WaitWeights(ref, weakref.ref(module), own)))
    timeline = _Timeline(ref, weakref.ref(model), weakref.WeakMethod(raise_if_failed))  # type: ignore[arg-type]
    handles += [model.register_forward_pre_hook(timeline.start),
                model.register_forward_hook(timeline.end)]
    return handles


class _Timeline(PicklableHook):
    """The forward span on the device's clock, and a failed lane surfacing before any work."""

    def __init__(self, ref: weakref.ref[IterationScheduler], owner: weakref.ref[torch.nn.Module],
                 check: weakref.WeakMethod[Any]) -> None:
        self.ref, self.owner, self.check = ref, owner, check
        self.starts: list[float] = []
        self.start = _Bound(self, True)
        self.end = _Bound(self, False)

    def on_start(self, module: torch.nn.Module) -> None:
        sched, raise_if_failed = self.ref(), self.check()
        if sched is None or module is not self.owner():
            return
        if raise_if_failed is not None:
            raise_if_failed()
        sched.publishes.check_writes_before_forward()  # a write racing a publish, before any module
        if torch.is_grad_enabled():  # evaluation forwards stay out of the training timeline
            self.starts.append(sched.recorder.mark())  # the device's clock (recorder.py)

    def on_end(self, module: torch.nn.Module) -> None:
        sched = self.ref()
        if sched is None or module is not self.owner() or not torch.is_grad_enabled():
            return
        end = sched.recorder.mark()
        sched.recorder.add_marks(LANE_COMPUTE, KIND_FORWARD,
                                 self.starts.pop() if self.starts else end, end,
                                 iteration=sched.iteration)


class _Bound(PicklableHook):
    """``_Timeline``'s pre-hook (``start``) or post-hook (``end``)."""

    def __init__(self, timeline: _Timeline, start: bool) -> None:
        self.timeline, self.is_start = timeline, start

    @eager
    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if self.is_start:
            self.timeline.on_start(module)
        else:
            self.timeline.on_end(module)


class _WaitWeights(PicklableHook):
    """Forward pre-hook of a module owning parameters: wait for its own buckets' publish."""

    def __init__(self, ref: weakref.ref[IterationScheduler], owner: weakref.ref[torch.nn.Module],
                 indices: tuple[int, ...]) -> None:
        self.ref, self.owner, self.indices = ref, owner, indices

    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        sched = self.ref()
        if sched is not None and module is self.owner():
            sched.publishes.wait_for_weights(self.indices)


class _GradReady(PicklableHook):
    """Post-accumulate-grad hook: the parameter's gradient is final (tied: after all uses)."""

    def __init__(self, ref: weakref.ref[IterationScheduler], owner: weakref.ref[torch.Tensor],
                 index: int) -> None:
        self.ref, self.owner, self.index = ref, owner, index

    @eager
    def __call__(self, param: torch.Tensor) -> None:
        sched = self.ref()
        if sched is not None and param is self.owner():
            sched.on_grad_ready(self.index)
