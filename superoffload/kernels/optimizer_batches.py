"""CPUAdam's kernel calls, built once per param group and reused while nothing changes.

A param group's parameters that have a gradient are split into BATCHES, one kernel call each
(one OpenMP region, DESIGN.md §4): same step count, same gradient dtype, same low-precision
dtype. Each batch holds a ``PreparedAdam`` (kernels/prepared.py) over the fp32 masters (the
parameters themselves when they are fp32), the moments and the low-precision parameters
(written by the kernel's fused copy), so ``step()`` validates only the new gradients
(per-call validation was ~10% of a 180-tensor step).

The step counts keep torch.optim.AdamW's layout (``state[p]["step"]``, a float32 scalar
tensor per parameter) but each is a VIEW into one float32 vector per batch, so one
``add_`` advances a whole batch (a per-parameter ``+= 1`` costs ~3 us x 180 tensors).

A batch is rebuilt when its key changes (other parameters with gradients, other grad
dtypes), when a state entry it captured is replaced (``load_state_dict``, a user assigning
``state[p][...]``), or when a prepared tensor moved (``p.data = ...``): every step checks
identities, which costs ~0.2 us per tensor.

FSDP2 (``torch.distributed.fsdp.fully_shard``) hands the optimizer ``DTensor``
parameters and gradients: the kernel steps each rank's LOCAL shard (``DTensor.to_local()``,
a contiguous view into FSDP2's padded shard buffer; it may be empty on a rank when a dim-0
shard has fewer rows than ranks). The state keeps AdamW's layout as DTensors of the
parameter's mesh and placements, which is what ``torch.distributed.checkpoint`` saves and
reshards (``get_optimizer_state_dict``); the step count stays a plain scalar tensor, as
torch.optim.AdamW keeps it. A batch that holds a DTensor is "sharded": its pointer check and
its gradients go through the local shards (``local_shard``, ``shard_grads``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from operator import is_
from typing import Any

import torch

from superoffload import kernels
from superoffload.kernels.prepared import PreparedAdam

LOW_PRECISION = (torch.bfloat16, torch.float16)
_data_ptr = torch.Tensor.data_ptr
MASTER_KEY = "master_param"
"""State key of the fp32 master of a bf16/fp16 parameter (TransformerEngine's FusedAdam
uses the same name)."""


def dtensor_type() -> type | None:
    """torch's ``DTensor`` class, or None while ``torch.distributed.tensor`` was never imported
    (then no tensor can be one): the common, unsharded path pays no import and no isinstance."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: object) -> bool:
    dt = dtensor_type()
    return dt is not None and isinstance(t, dt)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (FSDP2: its shard, possibly empty), else ``t``.
    ``to_local()`` without autograd returns the DTensor's own local tensor (or, for a
    Parameter, a view of it): the kernel writes the memory FSDP2 all-gathers from."""
    if not is_dtensor(t):
        return t
    # a step (no_grad already): entering it again costs 2 us
    if not torch.is_grad_enabled():
        return t.to_local()  # type: ignore[attr-defined,no-any-return]
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined,no-any-return]


def _layout(t: torch.Tensor, whose: str) -> str:
    if is_dtensor(t):
        return f"a DTensor with {whose}placements {t.placements}"  # type: ignore[attr-defined]
    return "a plain tensor"


def shard_grads(params: list[torch.Tensor] | tuple[torch.Tensor, ...],
                grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local shards of a sharded batch's gradients, each checked against its parameter:
    a DTensor parameter needs a DTensor gradient of the same placements (FSDP2 writes them
    so), otherwise the local shapes could match while the elements do not."""
    out = []
    for i, (p, g) in enumerate(zip(params, grads)):
        p_dt, g_dt = is_dtensor(p), is_dtensor(g)
        if p_dt != g_dt or (p_dt and g.placements != p.placements):  # type: ignore[attr-defined]
            what, want = _layout(g, ""), _layout(p, "the parameter's ")
            raise ValueError(f"CPUAdam: the gradient of parameter {i} of a batch is {what}, "
                             f"but it must be {want}: let FSDP2 (fully_shard) produce the "
                             "gradients, or assign p.grad in the parameter's layout")
        out.append(g.to_local() if g_dt else g)  # type: ignore[attr-defined]
    return out


def kernel_grads(grads: list[torch.Tensor], widen: bool) -> list[torch.Tensor]:
    """Gradients as the kernel reads them: fp32 or bf16, contiguous (fp16 is widened: the
    kernel has no fp16 gradient path, and the exact widening costs one extra pass)."""
    if widen:
        return [g.float() for g in grads]
    out = []
    for g in grads:
        # a sparse grad passes through: the kernel's check refuses it with its message
        if not g.is_contiguous() and g.layout is torch.strided:
            g = g.contiguous()
        out.append(g)
    return out


@dataclass(slots=True)
class Batch:
    """The parameters of one kernel call and what was captured when it was built."""

    index: tuple[int, ...] | None
    """Positions in the group's ``params`` list; None: all of them, in order."""
    params: tuple[torch.Tensor, ...]
    prepared: PreparedAdam
    steps: torch.Tensor
    """float32 vector; ``state[params[i]]["step"]`` is ``steps[i]``."""
    dicts: tuple[dict[str, Any], ...]
    """``state[params[i]]`` when the batch was built."""
    captured: tuple[tuple[dict[str, Any], ...], tuple[str, ...], tuple[torch.Tensor, ...]]
    """(state dicts, keys, tensors): ``dicts[i][keys[i]] is tensors[i]`` must still hold."""
    param_ptrs: list[int]
    widen: bool
    """fp16 gradients: widened to fp32 per step."""
    sharded: bool = False
    """Holds a DTensor parameter: pointers and gradients are read from the local shards."""

    def _ptrs(self) -> list[int]:
        if self.sharded:
            return [local_shard(p).data_ptr() for p in self.params]
        return list(map(_data_ptr, self.params))

    def intact(self, state: Any) -> bool:
        """True while the optimizer state still holds what this batch captured and no
        parameter was re-pointed (``p.data = ...``): checked before any batch of the group
        is stepped, so a stale batch is rebuilt instead of half-stepping the group."""
        # map/operator.is_ keep the loops in C: this runs on every step (~0.1 us/entry)
        return (all(map(is_, map(state.get, self.params), self.dicts))
                and all(map(is_, map(dict.get, self.captured[0], self.captured[1]),
                            self.captured[2]))
                and self._ptrs() == self.param_ptrs)

    def count(self) -> int | None:
        """The batch's step count, or None when the step views disagree (edited by hand)."""
        lo, hi = torch.aminmax(self.steps)
        # one kernel call takes one t (the bias corrections): disagreeing views force a rebuild
        if float(lo) != float(hi):
            return None
        return int(lo)

    def grads(self, group_grads: list[torch.Tensor]) -> list[torch.Tensor]:
        gs = group_grads
        if self.index is not None:
            gs = [group_grads[i] for i in self.index]
        if self.sharded:
            gs = shard_grads(self.params, gs)
        return kernel_grads(gs, self.widen)


def init_state(state: dict[str, Any], p: torch.Tensor, moment_dtype: torch.dtype) -> None:
    """AdamW's state keys (``step``, ``exp_avg``, ``exp_avg_sq``), the moments in
    ``moment_dtype``, plus an fp32 master for a bf16/fp16 parameter. For a DTensor parameter
    ``zeros_like`` / ``float()`` give DTensors of its mesh and placements with contiguous local
    shards (torch.optim.AdamW's ``zeros_like(p)`` does the same), ``step`` a plain tensor."""
    if state:
        return
    state["step"] = torch.tensor(0.0)
    # contiguous whatever p's strides: the kernel walks the moments as flat arrays
    dense = torch.contiguous_format
    state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=dense)
    state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=dense)
    if p.dtype in LOW_PRECISION:
        state[MASTER_KEY] = p.detach().float().contiguous()


def _build_batch(index: list[int], ps: list[torch.Tensor], state: Any, count: int,
                 grad_dtype: torch.dtype, lp_dtype: torch.dtype | None, all_params: int) -> Batch:
    sts = [state[p] for p in ps]
    steps = torch.full((len(ps),), float(count), dtype=torch.float32)
    captured: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for st, view in zip(sts, steps.unbind()):
        st["step"] = view
        captured += [(st, "step", view), (st, "exp_avg", st["exp_avg"]),
                     (st, "exp_avg_sq", st["exp_avg_sq"])]
        if lp_dtype is not None:
            captured.append((st, MASTER_KEY, st[MASTER_KEY]))
    sharded = any(map(is_dtensor, ps))
    # the kernel steps local shards (DTensor parameters and states) or the tensors themselves
    local = ps
    if sharded:
        local = [local_shard(p) for p in ps]
    # a bf16/fp16 parameter: the kernel steps its fp32 master, then rounds into the parameter
    # as params_lp in the same pass (docs/kernel.md, "Reduced precision")
    masters, params_lp = list(local), None
    if lp_dtype is not None:
        masters, params_lp = [local_shard(st[MASTER_KEY]) for st in sts], local
    prepared = kernels.prepare_adam(
        masters, None, [local_shard(st["exp_avg"]) for st in sts],
        [local_shard(st["exp_avg_sq"]) for st in sts], params_lp=params_lp)
    # the whole group in order: grads() then passes the group's list through, no gather
    kept: tuple[int, ...] | None = tuple(index)
    if len(index) == all_params and index == list(range(all_params)):
        kept = None
    return Batch(kept, tuple(ps), prepared, steps, tuple(sts),
                 (tuple(c[0] for c in captured), tuple(c[1] for c in captured),
                  tuple(c[2] for c in captured)),
                 [p.data_ptr() for p in local], grad_dtype == torch.float16, sharded)


def build_batches(params: list[torch.Tensor], state: Any,
                  moment_dtype: torch.dtype) -> list[Batch]:
    """Batches of a group's parameters that have a gradient, state created as needed: one
    per (step count, gradient dtype, low-precision dtype)."""
    keyed: dict[tuple[int, torch.dtype, torch.dtype | None], list[int]] = {}
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        st = state[p]
        init_state(st, p, moment_dtype)
        lp = p.dtype if p.dtype in LOW_PRECISION else None
        keyed.setdefault((int(st["step"]), p.grad.dtype, lp), []).append(i)
    return [_build_batch(idx, [params[i] for i in idx], state, count, gdt, lp, len(params))
            for (count, gdt, lp), idx in sorted(keyed.items(), key=lambda kv: kv[0][0])]


@dataclass(slots=True)
class GroupCache:
    """The batches of one param group and what they were built for."""

    params: tuple[torch.Tensor, ...]
    grad_key: tuple[torch.dtype | None, ...]
    batches: list[Batch]

    def valid(self, params: list[torch.Tensor], grad_key: tuple[torch.dtype | None, ...],
              state: Any) -> bool:
        return (self.grad_key == grad_key and self.params == tuple(params)
                and all(b.intact(state) and b.count() is not None for b in self.batches))


def current_batches(cache: GroupCache | None, params: list[torch.Tensor],
                    grads: list[torch.Tensor | None], state: Any, moment_dtype: torch.dtype,
                    keep: Callable[[GroupCache], None]) -> list[Batch]:
    """The group's batches, rebuilt (and handed to ``keep``) when anything changed."""
    grad_key = tuple(None if g is None else g.dtype for g in grads)
    if cache is not None and cache.valid(params, grad_key, state):
        return cache.batches
    fresh = GroupCache(tuple(params), grad_key, build_batches(params, state, moment_dtype))
    keep(fresh)
    return fresh.batches


def state_like(src: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A loaded state tensor (moment or master) in ``dtype`` and ``p``'s layout, a copy owned
    by the optimizer. For a DTensor parameter: a DTensor of its mesh and placements; ``src``
    may be one in the same layout (what ``set_optimizer_state_dict`` passes after DCP loaded
    it, already resharded), one in another layout (gathered, collective: every rank loads the
    same state dict), or a full plain tensor (a single-process ``state_dict()``; each rank
    keeps its piece without communication, ``distribute_tensor(src_data_rank=None)``)."""
    if not is_dtensor(p):
        return src.to(device="cpu", dtype=dtype, copy=True).reshape(p.shape).contiguous()
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    if isinstance(src, DTensor) and (src.device_mesh != mesh or src.placements != placements):
        src = src.full_tensor()
    if not isinstance(src, DTensor):
        src = distribute_tensor(src.reshape(p.shape), mesh, placements, src_data_rank=None)
    local = src.to_local().to(device="cpu", dtype=dtype, copy=True).contiguous()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                              stride=p.stride())
