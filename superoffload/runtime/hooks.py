"""Module and parameter hooks that drive the schedule (paper §4.2; DESIGN.md §3 steps 1-2).

* post-accumulate-grad hook per trainable parameter: counts the bucket's final gradients on
  the last micro-step and launches the bucket when all have arrived (a tied parameter has
  one AccumulateGrad node, so it fires once, after all its uses);
* forward pre-hook per module owning parameters: waits for *that* bucket's H2D only, so
  the first layers (GPU tail buckets) start while the CPU finishes the last buckets;
* forward pre/post hooks on the root module: the forward span of the timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from superoffload.runtime.iteration import Flight
from superoffload.telemetry.events import KIND_FORWARD, KIND_WAIT, LANE_COMPUTE

if TYPE_CHECKING:
    from superoffload.runtime.engine import OffloadEngine


def register(engine: OffloadEngine) -> list[Any]:
    """Install every hook; returns the handles (``.remove()`` on close)."""
    handles: list[Any] = []
    for i in engine._trainable:
        handles.append(engine._params[i].register_post_accumulate_grad_hook(_grad_hook(engine, i)))
    for module in engine.model.modules():
        own = [engine._index[id(p)] for p in module.parameters(recurse=False)
               if id(p) in engine._index and p.requires_grad]
        if own:
            handles.append(module.register_forward_pre_hook(_wait_hook(engine, tuple(own))))
    start: list[float] = []

    def forward_start(module: torch.nn.Module, args: Any) -> None:
        engine._raise_if_failed()
        start.append(engine.telemetry.now())

    def forward_end(module: torch.nn.Module, args: Any, output: Any) -> None:
        t0 = start.pop() if start else engine.telemetry.now()
        engine.telemetry.add(LANE_COMPUTE, KIND_FORWARD, t0, engine.telemetry.now(),
                             iteration=engine.iteration)

    handles.append(engine.model.register_forward_pre_hook(forward_start))
    handles.append(engine.model.register_forward_hook(forward_end))
    return handles


def _wait_hook(engine: OffloadEngine, indices: tuple[int, ...]) -> Any:
    def hook(module: torch.nn.Module, args: Any) -> None:
        buckets = {engine._bucket_of[i][0] for i in indices if i in engine._bucket_of}
        for b in sorted(buckets):
            fut = engine._h2d_pending.pop(b, None)
            if fut is None:
                continue
            t0 = engine.telemetry.now()
            engine.backend.wait(engine._wait(fut, f"H2D of bucket {b}"))
            engine.telemetry.add(LANE_COMPUTE, KIND_WAIT, t0, engine.telemetry.now(),
                                 iteration=engine.iteration, bucket=b)
    return hook


def _grad_hook(engine: OffloadEngine, index: int) -> Any:
    def hook(param: torch.Tensor) -> None:
        it = engine._it
        if not it.armed:
            return  # not the last micro-step: gradients keep accumulating in .grad
        b, pos = engine._bucket_of[index]
        with engine._hook_lock:  # CUDA runs hooks on autograd's device threads
            fired = it.fired.setdefault(b, set())
            fired.add(pos)
            complete = len(fired) == len(engine._buffers[b].params) and b not in it.flights
            if complete:
                it.flights[b] = Flight.placeholder(b)
        if complete:
            engine._launch(b)
    return hook
