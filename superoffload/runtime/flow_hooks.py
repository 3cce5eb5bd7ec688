"""Weight-flow's hooks on the model (runtime/weightflow.py, paper §4.5).

Each hook holds only weak references (to the WeightFlow and to the module or parameter it was
registered for), so the model never keeps a dropped engine alive and a deep copy of the model
does nothing on the copy (runtime/lifetime.py). ``wrap_output`` puts an identity autograd node
after a block's output whose backward fetches the block before the block's own backward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from superoffload.runtime.fetch import WeightFlowError
from superoffload.runtime.hook_base import PicklableHook, eager


class _FlowHook(PicklableHook):
    def __init__(self, ref: weakref.ref[Any], owner: weakref.ref[Any], k: int) -> None:
        self.ref, self.owner, self.k = ref, owner, k


class _Pre(_FlowHook):
    @eager
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        flow = self.ref()
        if flow is not None and module is self.owner():
            flow.on_pre(self.k)


class _Post(_FlowHook):
    @eager
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        flow = self.ref()
        if flow is not None and module is self.owner():
            return flow.on_post(self.k, output)
        return None


class _Grad(_FlowHook):
    @eager
    def __call__(self, param: torch.Tensor) -> None:
        flow = self.ref()
        if flow is not None and param is self.owner():
            flow.on_grad(self.k, id(param))


def pre_hook(ref: weakref.ref[Any], owner: weakref.ref[torch.nn.Module], k: int) -> Any:
    return _Pre(ref, owner, k)


def post_hook(ref: weakref.ref[Any], owner: weakref.ref[torch.nn.Module], k: int) -> Any:
    return _Post(ref, owner, k)


def grad_hook(ref: weakref.ref[Any], owner: weakref.ref[torch.Tensor], k: int) -> Any:
    return _Grad(ref, owner, k)


class _BackwardFetch(torch.autograd.Function):
    """Identity whose backward runs before the block's own backward: fetch the block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flow: Any, k: int) -> torch.Tensor:
        ctx.flow, ctx.k = flow, k
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.flow.enter_backward(ctx.k)
        return grad, None, None


def wrap_output(output: Any, flow: Any, k: int) -> Any:
    if isinstance(output, torch.Tensor):
        # an output no gradient flows through has no backward to fetch the block for
        if not output.requires_grad:
            return None
        return _BackwardFetch.apply(output, flow, k)
    if isinstance(output, tuple):
        for i, t in enumerate(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return (*output[:i], _BackwardFetch.apply(t, flow, k), *output[i + 1:])
    raise WeightFlowError(
        f"block {k} returned {type(output).__name__} with no tensor requiring grad; weight-flow "
        "needs a tensor (or a tuple holding one) to fetch the block before its backward"
    )
