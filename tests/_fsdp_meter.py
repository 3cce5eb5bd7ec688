"""What one FSDP2 rank of ``FsdpOffloadEngine`` holds and issues, measured for the planner's
data-parallel tests (tests/test_plan_fsdp.py, launched by tests/_fsdp_dp_worker.py "plan").

* ``FsdpMeter``: ``runtime.device_meter.DeviceMeter`` (this rank's shards, their gradients,
  saved activations, the GPU tail's state) plus what FSDP2 holds besides: the unsharded
  weights of the units gathered now (the modules' registered parameters that are not
  DTensors, and the output of an all-gather FSDP2 prefetched and has not unpacked yet), their
  unsharded gradients (sampled as each accumulates), and the reduce-scatter input FSDP2 keeps
  until the next unit reduces (both seen in the engine's guarded collectives);
* ``count_collectives``: every all-gather and reduce-scatter FSDP2 issues, counted in the
  engine's guarded collectives (distributed/fsdp/comm.py), not timed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from superoffload.distributed.fsdp import comm
from superoffload.runtime.device_meter import DeviceMeter

COUNTS = {"all_gather": 0, "reduce_scatter": 0}
"""Collectives issued since the last reset (this process)."""
METERS: list[FsdpMeter] = []
"""The meter tracking now (at most one), told about each reduce-scatter input."""


def count_collectives() -> None:
    """Wrap the guarded all-gather and reduce-scatter once per process: count each call and
    show the reduce-scatter's input to the meter tracking now."""
    if getattr(comm.GuardedAllGather.__call__, "counted", False):
        return
    gather, scatter = comm.GuardedAllGather.__call__, comm.GuardedReduceScatter.__call__

    def counted_gather(self: Any, output_tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        COUNTS["all_gather"] += 1
        for meter in METERS:
            meter.hold(output_tensor, "weights")
        return gather(self, output_tensor, *a, **kw)

    def counted_scatter(self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                        *a: Any, **kw: Any) -> Any:
        COUNTS["reduce_scatter"] += 1
        for meter in METERS:
            meter.hold(input_tensor, "grads")
        return scatter(self, output_tensor, input_tensor, *a, **kw)

    counted_gather.counted = True  # type: ignore[attr-defined]
    comm.GuardedAllGather.__call__ = counted_gather  # type: ignore[method-assign]
    comm.GuardedReduceScatter.__call__ = counted_scatter  # type: ignore[method-assign]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local")


class FsdpMeter(DeviceMeter):
    """``DeviceMeter`` plus FSDP2's unsharded weights, gradients and reduce-scatter input."""

    def __init__(self, model: torch.nn.Module, engine: Any) -> None:
        super().__init__(model, engine=engine)
        self._held: dict[str, dict[int, Any]] = {"weights": {}, "grads": {}}
        self._hooked: set[int] = set()
        self._extra: list[Any] = []
        flow = engine.weights.flow  # weight-flow: the block units' shards live on the host
        self._host = [p for ps in (flow.params if flow is not None else []) for p in ps]

    def _unsharded(self) -> list[torch.Tensor]:
        """The gathered weights: registered parameters that are not DTensor shards."""
        return [p for p in self.model.parameters() if not _is_dtensor(p)]

    def weight_bytes(self) -> int:
        # a unit's parameters are views into its all-gather's output: one storage, once
        gathered = self._unsharded() + self._held_tensors("weights")
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in gathered}
        host = sum(p.to_local().numel() * p.element_size() for p in self._host)
        return super().weight_bytes() - host + sum(storages.values())

    def _pack(self, t: torch.Tensor) -> Any:
        # autograd saves a gathered weight (or a view of it, linear's transpose): a weight,
        # counted above, not an activation
        if t.untyped_storage().data_ptr() in {p.untyped_storage().data_ptr()
                                               for p in self._unsharded()}:
            return t
        return super()._pack(t)

    def grad_bytes(self) -> int:
        unsharded = sum(p.grad.numel() * p.grad.element_size() for p in self._unsharded()
                        if p.grad is not None)
        held = sum(t.untyped_storage().nbytes() for t in self._held_tensors("grads"))
        return super().grad_bytes() + unsharded + held

    def hold(self, t: torch.Tensor, part: str) -> None:
        """Count ``t`` under ``part`` while it lives: a reduce-scatter's input (FSDP2 keeps it
        until the next unit reduces), an all-gather's output (a prefetched unit's weights
        until FSDP2 unpacks them into the unit's parameters)."""
        held = self._held[part]
        held[id(t)] = weakref.ref(t)
        weakref.finalize(t, held.pop, id(t), None)
        self.sample()

    def _held_tensors(self, part: str) -> list[torch.Tensor]:
        # FSDP2 frees a buffer by resizing its storage to 0 (the tensor may live on): callers
        # count the storage each held tensor has now
        return [t for ref in list(self._held[part].values()) if (t := ref()) is not None]

    def _hook_unsharded(self, module: torch.nn.Module, args: Any) -> None:
        # after FSDP2's pre-forward hook (registered first): the unit's weights are gathered
        for p in self._unsharded():
            if id(p) not in self._hooked and p.requires_grad:
                self._hooked.add(id(p))
                self._extra.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, _param: torch.Tensor) -> None:
        self.sample()  # an unsharded gradient has grown

    @contextlib.contextmanager
    def track(self) -> Iterator[DeviceMeter]:
        from torch.distributed.fsdp import FSDPModule

        pre = [m.register_forward_pre_hook(self._hook_unsharded) for m in self.model.modules()
               if isinstance(m, FSDPModule)]
        METERS.append(self)
        try:
            with super().track():
                yield self
        finally:
            METERS.remove(self)
            for h in pre + self._extra:
                h.remove()
            self._extra, self._hooked = [], set()


def measure_run(run: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Train the tiny GPT (bf16, ``run["gpt"]`` overrides) with ``run["config"]`` for 2
    optimizer steps on this rank's batches; return the collectives the second step issued and
    the meter's peak over both (and its parts at the peak)."""
    from superoffload.config import OffloadConfig
    from superoffload.distributed.fsdp import FsdpOffloadEngine
    from superoffload.models.gpt import GPT, gpt_tiny

    count_collectives()
    torch.manual_seed(0)
    model = GPT(gpt_tiny(**run.get("gpt", {}))).to(torch.bfloat16)
    cfg = OffloadConfig(**run["config"])
    engine = FsdpOffloadEngine(model, {"lr": 1e-3}, cfg)
    meter = FsdpMeter(model, engine)
    g = torch.Generator().manual_seed(1 + rank)
    counts = {}
    with meter.track():
        for _ in range(2):
            COUNTS.update(all_gather=0, reduce_scatter=0)
            for _ in range(cfg.grad_accum_steps):
                x = torch.randint(0, 256, (run["micro_batch"], run["seq"]), generator=g)
                engine.backward(model(x, torch.roll(x, -1, 1)))
                engine.step()
            engine.zero_grad()
            counts = dict(COUNTS)
    engine.close()
    return {"counts": counts, "peak": meter.peak_bytes, "parts": meter.peak_parts,
            "peak_grad": meter.peak_grad_bytes}
