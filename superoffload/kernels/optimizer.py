"""`CPUAdam`: a torch.optim.Optimizer over the CPU Adam kernel, with rollback.

NOTE: it subclasses torch.optim.Optimizer (as torchao's CPUOffloadOptimizer does, STYLE.md
§4) so LR schedulers, zero_grad, param groups and state_dict/load_state_dict (through
torch.save) work as with torch.optim.AdamW; the per-parameter state uses AdamW's keys
(`step` as a float tensor, `exp_avg`, `exp_avg_sq`), so the two load each other's state.

step() makes ONE multi-tensor kernel call per param group (per distinct step count and grad
dtype inside the group), so all tensors are updated in one OpenMP parallel region.
rollback() undoes the last step exactly (to a few ulps, DESIGN.md §4) using the gradients
still in .grad; call it before scheduler.step() changes the learning rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from superoffload import kernels
from superoffload.kernels.validate import check_threads


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 CPU parameters, backed by superoffload.kernels."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, threads: int | None = None,
                 bias_correction: bool = True, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not support amsgrad=True; use torch.optim.AdamW "
                             "(amsgrad=True) instead")
        if not isinstance(lr, torch.Tensor) and not float(lr) >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.threads = check_threads(threads)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "adamw_mode": adamw_mode, "bias_correction": bias_correction,
                    "amsgrad": False}
        super().__init__(params, defaults)
        # (group index, step number taken, params) of each kernel call of the last step()
        self._last_stepped: list[tuple[int, int, list[torch.Tensor]]] = []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", False):
            raise ValueError("CPUAdam does not support amsgrad=True in a param group")
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.device.type != "cpu":
                raise ValueError(f"CPUAdam updates CPU parameters only, got one on {p.device}; "
                                 "use torch.optim.AdamW on the device or superoffload's engine")
            if p.dtype != torch.float32:
                raise TypeError(f"CPUAdam needs torch.float32 parameters (the fp32 master "
                                f"copy), got {p.dtype}")
            if not p.is_contiguous():
                raise ValueError("CPUAdam needs contiguous parameters; pass p.data = "
                                 "p.data.contiguous() first")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict() lands here: groups saved by torch.optim.AdamW lack our keys
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("adamw_mode", "bias_correction", "amsgrad"):
                group.setdefault(key, self.defaults[key])
            if group["amsgrad"]:
                raise ValueError("CPUAdam does not support amsgrad=True in a param group")
        self.__dict__.setdefault("_last_stepped", [])

    def _batches(self, group: dict[str, Any]) -> dict[tuple[int, torch.dtype], list[torch.Tensor]]:
        """The group's params with a grad, keyed by (step count, grad dtype)."""
        batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError("CPUAdam does not support sparse gradients; use "
                                "torch.optim.SparseAdam")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            key = (int(state["step"].item()), p.grad.dtype)
            batches.setdefault(key, []).append(p)
        return batches

    def _call(self, group: dict[str, Any], step: int, ps: list[torch.Tensor],
              rollback: bool) -> None:
        beta1, beta2 = group["betas"]
        fn = kernels.adam_rollback_multi if rollback else kernels.adam_step_multi
        grads = [p.grad for p in ps]
        if any(g is None for g in grads):
            raise RuntimeError("CPUAdam: a parameter lost its .grad between step() and rollback()")
        fn(ps, [g.contiguous() for g in grads if g is not None],
           [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps],
           step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
           eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
           adamw_mode=bool(group["adamw_mode"]), bias_correction=bool(group["bias_correction"]),
           threads=self.threads)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped: list[tuple[int, int, list[torch.Tensor]]] = []
        for gi, group in enumerate(self.param_groups):
            for (count, _dtype), ps in self._batches(group).items():
                self._call(group, count + 1, ps, rollback=False)
                for p in ps:
                    self.state[p]["step"] += 1.0
                stepped.append((gi, count + 1, ps))
        self._last_stepped = stepped
        return loss

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo the last step() with the grads still in .grad (values and step counts)."""
        if not self._last_stepped:
            raise RuntimeError("CPUAdam.rollback(): no step to undo (rollback undoes only the "
                               "most recent step, once)")
        if any(p.grad is None for _, _, ps in self._last_stepped for p in ps):
            raise RuntimeError("CPUAdam.rollback() needs the gradients of the step it undoes; "
                               "a .grad was cleared (call it before zero_grad)")
        for gi, step, ps in reversed(self._last_stepped):
            self._call(self.param_groups[gi], step, ps, rollback=True)
            for p in ps:
                self.state[p]["step"] -= 1.0
        self._last_stepped = []
