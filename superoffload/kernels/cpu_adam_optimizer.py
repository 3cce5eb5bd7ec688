"""`CPUAdam`: a torch.optim.Optimizer over the CPU Adam kernel, with rollback.

NOTE: it subclasses torch.optim.Optimizer (as torchao's CPUOffloadOptimizer does;
docs/conventions.md, "PyTorch's optimizer contract") so LR schedulers, zero_grad, param groups
and state_dict/load_state_dict (through torch.save) work as with torch.optim.AdamW; the
per-parameter state uses AdamW's keys (`step` as a float tensor, `exp_avg`, `exp_avg_sq`), so
the two load each other's state.

Parameters may be fp32, bf16 or fp16 (a drop-in where people use DeepSpeed's
CPUAdam or torch AdamW on a bf16 model). A bf16/fp16 parameter gets an fp32 master in
`state[p]["master_param"]`; the kernel steps the master and writes the rounded parameter in
the same pass (its fused low-precision copy, DESIGN.md §4), so updates smaller than half a
bf16 ulp of the weight are kept, not rounded away as when a bf16 tensor is stepped directly.
`moment_dtype=torch.bfloat16` (DeepSpeed's `fp32_optimizer_states=False`) stores the moments
in bf16 with stochastic rounding (20 instead of 28 B/param; accuracy in docs/kernel.md).

step() makes ONE prepared kernel call per param group (per distinct step count, grad dtype
and low-precision dtype inside the group), built once and reused until the group's
tensors change (kernels/optimizer_batches.py). Every group's hyper-parameters are read and
checked before any group is stepped, so a bad value (or a refused torch.optim flag,
kernels/hyper.py) written into a group mid-run raises with nothing applied.
rollback() undoes the last step exactly (to a few ulps, DESIGN.md §4) using the gradients
still in .grad and the hyper-parameters that step used (a scheduler's lr change in between
does not enter the inverse).

FSDP2 (docs/distributed.md, "FSDP2"): ``DTensor`` parameters are stepped on their
local shards (uneven and empty ones included) and the state is DTensors in the layout
``torch.distributed.checkpoint`` saves and reshards. A DTensor parameter must live on the
CPU: on a GPU that means ``fully_shard(..., offload_policy=CPUOffloadPolicy())``. Without it
the shards live on the device and CPUAdam refuses them (naming the policy) instead of
stepping a host copy: a hidden copy would hold a second fp32 shard plus moments on the host
and add a blocking D2H of every gradient and H2D of every shard to each step, which FSDP2's
policy already overlaps with its own collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from itertools import chain
from typing import Any

import torch

from superoffload.kernels.checks import MOMENT_DTYPES, check_threads
from superoffload.kernels.hyper import AdamHyper, normalise_group
from superoffload.kernels.optimizer_batches import (
    LOW_PRECISION,
    MASTER_KEY,
    Batch,
    GroupCache,
    current_batches,
    is_dtensor,
    local_shard,
    state_like,
)

PARAM_DTYPES = (torch.float32, *LOW_PRECISION)
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _sr_seed(step: int, group: int, batch: int) -> int:
    """A distinct stochastic-rounding stream per (step, group, batch), reproducible."""
    return (step * 0x9E3779B97F4A7C15 + group * 0xBF58476D1CE4E5B9
            + batch * 0x94D049BB133111EB) % 2**64


def _moment_dtype(moment_dtype: torch.dtype | None, fp32_optimizer_states: bool | None
                  ) -> torch.dtype:
    # DeepSpeedCPUAdam's name for the same switch
    if fp32_optimizer_states is not None:
        implied = torch.float32 if fp32_optimizer_states else torch.bfloat16
        if moment_dtype is not None and moment_dtype != implied:
            raise ValueError(f"fp32_optimizer_states={fp32_optimizer_states} contradicts "
                             f"moment_dtype={moment_dtype}; pass one of them")
        return implied
    moment_dtype = torch.float32 if moment_dtype is None else moment_dtype
    if moment_dtype not in MOMENT_DTYPES:
        raise TypeError(f"moment_dtype must be torch.float32 or torch.bfloat16, got {moment_dtype}")
    return moment_dtype


def _device_shard_refusal(where: str, device: torch.device) -> str:
    """Why a DTensor shard off the CPU is refused, and the fixes (module docstring)."""
    if device.type == "meta":
        return (f"{where} is a DTensor on the meta device (not materialized): build CPUAdam "
                "after model.to_empty(device=...) and weight initialization")
    return (f"{where} is a DTensor shard on {device}, but CPUAdam steps CPU memory: shard with "
            "fully_shard(module, offload_policy=CPUOffloadPolicy()) so FSDP2 keeps parameters, "
            "gradients and optimizer state on the CPU (docs/distributed.md, \"FSDP2\"), or "
            "step on the device with torch.optim.AdamW(fused=True)")


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32, bf16 or fp16 CPU parameters, backed by superoffload.kernels.

    ``maximize``, ``foreach``, ``fused``, ``capturable`` and ``differentiable`` are
    torch.optim.AdamW's flags: ``maximize`` is honoured, ``foreach``/``fused`` accepted (our
    kernel runs either way), ``amsgrad``/``capturable``/``differentiable`` refused unless
    False (kernels/hyper.py), here and in every param group, also when set mid-run."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, threads: int | None = None,
                 bias_correction: bool = True, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool = False, differentiable: bool = False,
                 moment_dtype: torch.dtype | None = None,
                 fp32_optimizer_states: bool | None = None) -> None:
        self.threads = None if threads is None else check_threads(threads)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "adamw_mode": adamw_mode, "bias_correction": bias_correction,
                    "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
                    "fused": fused, "capturable": capturable, "differentiable": differentiable,
                    "moment_dtype": _moment_dtype(moment_dtype, fp32_optimizer_states)}
        # refuse bad defaults before any group
        self._hyper(defaults, "CPUAdam")
        self._cache: dict[int, GroupCache] = {}
        # (group, batch index, batch, step number taken, hyper-parameters used) of each kernel
        # call of the last step(): rollback() inverts each with its own hyper-parameters
        self._last_stepped: list[tuple[int, int, Batch, int, AdamHyper]] = []
        super().__init__(params, defaults)

    @staticmethod
    def _hyper(group: dict[str, Any], where: str) -> AdamHyper:
        lr = group["lr"]
        # torch.optim accepts a tensor lr
        if isinstance(lr, torch.Tensor):
            group = {**group, "lr": float(lr)}
        return AdamHyper.from_group(group, where)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        where = f"CPUAdam.param_groups[{len(self.param_groups)}]"
        # torch's add_param_group refuses anything else
        if isinstance(param_group, dict):
            # torch's decoupled_weight_decay is our adamw_mode
            normalise_group(param_group)
            # before the group joins
            self._hyper({**self.defaults, **param_group}, where)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"CPUAdam.param_groups[{len(self.param_groups) - 1}]"
        self._hyper(group, where)
        group["moment_dtype"] = _moment_dtype(group["moment_dtype"], None)
        for k, p in enumerate(group["params"]):
            sharded = is_dtensor(p)
            # a device DTensor shard has its own fix (FSDP2's CPU offload policy)
            if p.device.type != "cpu" and sharded:
                raise ValueError(_device_shard_refusal(f"{where}['params'][{k}]", p.device))
            if p.device.type != "cpu":
                raise ValueError(
                    f"CPUAdam updates CPU parameters only, got one on {p.device}; use "
                    "torch.optim.AdamW on the device or superoffload's engine")
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"CPUAdam needs torch.float32, bfloat16 or float16 parameters "
                                f"(bf16/fp16 ones get an fp32 master), got {p.dtype}")
            if sharded and not local_shard(p).is_contiguous():
                raise ValueError(f"{where}['params'][{k}]: CPUAdam steps a DTensor's local "
                                 "shard in place and needs it contiguous (FSDP2's dim-0 shards "
                                 "are); shard on dim 0 (fully_shard's default placement)")
            if not sharded and not p.is_contiguous():
                raise ValueError("CPUAdam needs contiguous parameters; pass p.data = "
                                 "p.data.contiguous() first")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict() lands here (its groups were checked first): groups saved by
        # torch.optim.AdamW lack our keys; their decoupled_weight_decay is our adamw_mode
        super().__setstate__(state)
        for group in self.param_groups:
            normalise_group(group)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        # not pickled by Optimizer.__getstate__
        self.__dict__.setdefault("threads", None)
        self.__dict__["_cache"] = {}
        self.__dict__["_last_stepped"] = []

    def _call(self, gi: int, bi: int, batch: Batch, step: int, grads: list[torch.Tensor],
              hyper: AdamHyper, rollback: bool) -> None:
        run = batch.prepared.rollback if rollback else batch.prepared.step
        run(hyper, step=step, grads=batch.grads(grads), threads=self.threads,
            sr_seed=_sr_seed(step, gi, bi))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every group's hyper-parameters first: a bad one raises before anything is stepped
        hypers = [self._hyper(g, f"CPUAdam.param_groups[{gi}]")
                  for gi, g in enumerate(self.param_groups)]
        stepped: list[tuple[int, int, Batch, int, AdamHyper]] = []
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            grads = [p.grad for p in params]
            batches = current_batches(self._cache.get(gi), params, grads, self.state,
                                      group["moment_dtype"], partial(self._cache.__setitem__, gi))
            for bi, batch in enumerate(batches):
                count = batch.count()
                # current_batches rebuilt the batch otherwise
                assert count is not None
                self._call(gi, bi, batch, count + 1, grads, hypers[gi], rollback=False)
                batch.steps.add_(1.0)
                stepped.append((gi, bi, batch, count + 1, hypers[gi]))
        self._last_stepped = stepped
        return loss

    @torch.no_grad()
    def rollback(self) -> None:
        """Undo the last step() with the grads still in .grad (values and step counts), with
        the hyper-parameters that step used, whatever the groups say now."""
        if not self._last_stepped:
            raise RuntimeError("CPUAdam.rollback(): no step to undo (rollback undoes only the "
                               "most recent step, once)")
        if any(p.grad is None for _, _, b, _, _ in self._last_stepped for p in b.params):
            raise RuntimeError("CPUAdam.rollback() needs the gradients of the step it undoes; "
                               "a .grad was cleared (call it before zero_grad)")
        for gi, bi, batch, step, hyper in reversed(self._last_stepped):
            grads = [p.grad for p in self.param_groups[gi]["params"]]
            self._call(gi, bi, batch, step, grads, hyper, rollback=True)
            batch.steps.sub_(1.0)
        self._last_stepped = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's load, but moments keep this optimizer's ``moment_dtype`` and masters
        stay fp32 (torch casts every floating state tensor to its parameter's dtype, which
        would round an fp32 master of a bf16 parameter to bf16). A torch AdamW state of a
        bf16 model (no master) loads too: the master starts as the parameter, widened."""
        # refused before anything loads
        for gi, g in enumerate(state_dict["param_groups"]):
            self._hyper({**self.defaults, **normalise_group(
                {key: v for key, v in g.items() if key != "params"})},
                f"load_state_dict: param_groups[{gi}]")
        saved = state_dict["state"]
        held = {pid: {k: st[k] for k in (*MOMENT_KEYS, MASTER_KEY) if k in st}
                for pid, st in saved.items()}
        stripped = {**state_dict, "state": {
            pid: {k: v for k, v in st.items() if k not in held[pid]} for pid, st in saved.items()}}
        super().load_state_dict(stripped)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable([(p, g["moment_dtype"]) for p in g["params"]]
                                     for g in self.param_groups)
        for pid, (p, moment_dtype) in zip(saved_ids, params):
            if pid not in held:
                continue
            st = self.state[p]
            for k in MOMENT_KEYS:
                if k in held[pid]:
                    st[k] = state_like(held[pid][k], p, moment_dtype)
            if p.dtype in LOW_PRECISION:
                master = held[pid].get(MASTER_KEY, p.detach())
                st[MASTER_KEY] = state_like(master, p, torch.float32)
        self._cache = {}
        self._last_stepped = []
