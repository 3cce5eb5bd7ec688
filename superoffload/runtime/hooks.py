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
        handles.append(p.register_post_accumulate_grad_hook(_grad_hook(ref, weakref.ref(p), i)))
    for module in model.modules():
        own = tuple(st.index[id(p)] for p in module.parameters(recurse=False)
                    if id(p) in st.index and st.index[id(p)] in st.bucket_of)
        if own:
            handles.append(module.register_forward_pre_hook(
                _wait_hook(ref, weakref.ref(module), own)))
    handles += _timeline_hooks(model, ref, weakref.WeakMethod(raise_if_failed))  # type: ignore[arg-type]
    return handles


def _timeline_hooks(model: torch.nn.Module, ref: weakref.ref[IterationScheduler],
                    check: weakref.WeakMethod[Any]) -> list[Any]:
    owner = weakref.ref(model)
    start: list[float] = []

    def forward_start(module: torch.nn.Module, args: Any) -> None:
        sched, raise_if_failed = ref(), check()
        if sched is None or module is not owner():
            return
        if raise_if_failed is not None:
            raise_if_failed()
        if torch.is_grad_enabled():  # evaluation forwards stay out of the training timeline
            start.append(sched.recorder.mark())  # the device's clock (recorder.py)

    def forward_end(module: torch.nn.Module, args: Any, output: Any) -> None:
        sched = ref()
        if sched is None or module is not owner() or not torch.is_grad_enabled():
            return
        end = sched.recorder.mark()
        sched.recorder.add_marks(LANE_COMPUTE, KIND_FORWARD, start.pop() if start else end,
                                 end, iteration=sched.iteration)

    return [model.register_forward_pre_hook(forward_start),
            model.register_forward_hook(forward_end)]


def _wait_hook(ref: weakref.ref[IterationScheduler], owner: weakref.ref[torch.nn.Module],
               indices: tuple[int, ...]) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        sched = ref()
        if sched is not None and module is owner():
            sched.wait_for_weights(indices)
    return hook


def _grad_hook(ref: weakref.ref[IterationScheduler], owner: weakref.ref[torch.Tensor],
               index: int) -> Any:
    def hook(param: torch.Tensor) -> None:
        sched = ref()
        if sched is not None and param is owner():
            sched.on_grad_ready(index)
    return hook
