"""Reading a run from a live single-process engine (``superoffload.initialize``'s engine, or
the one inside ``SuperOffloadTrainer``, the Lightning strategy or Accelerate's plugin).

A trainable parameter is read from its fp32 master in the engine's buckets (runtime/engine_state.py
``BucketBuffers``: host buckets hold it on the host, GPU tail buckets on the device), one
at a time, copied to the CPU; never from the model's bf16 weight. Everything else comes from
the model's state dict. The engine is synchronized first and must be between iterations (as
for ``state_dict()``); a data-parallel engine's masters are sharded over its ranks: save a
checkpoint on every rank and export that.
"""

from __future__ import annotations

from typing import Any

import torch

from superoffload.export.companions import model_extras
from superoffload.export.source import Entry, Extras, alias_groups, plan_entries
from superoffload.runtime import tier_access


def engine_of(obj: Any) -> Any:
    """The engine inside ``obj``: an engine itself, or an object holding one as ``engine``
    (``SuperOffloadTrainer``, the Lightning strategy); None when there is none."""
    for candidate in (obj, getattr(obj, "engine", None)):
        if candidate is not None and hasattr(candidate, "state") and hasattr(candidate,
                                                                             "export_states"):
            return candidate
    return None


class LiveSource:
    """A live engine's masters and model (see the module docstring)."""

    stem = "model"
    single_file = False

    def __init__(self, engine: Any) -> None:
        world = int(getattr(engine, "world_size", 1))
        if world > 1:
            raise ValueError(
                f"export of a live data-parallel engine ({world} ranks): its fp32 masters are "
                "sharded over the ranks; call engine.save_checkpoint(path) on every rank, then "
                "export that folder (python -m superoffload export path out)")
        # a closed engine has let go of its buffers
        engine.raise_if_failed()
        if engine.launcher.current.micro_step >= engine.config.grad_accum_steps:
            # between backward() and step(): some buckets are stepped with this batch
            raise engine.contract.refuse_mid_iteration("export_hf()")
        engine.synchronize()
        self.engine, self.what = engine, "the live engine"
        self._tier_bucket: tuple[int, list[torch.Tensor]] | None = None
        """The storage tier's bucket read last and its masters (runtime/tier_access.py)."""
        st = engine.state
        self.where: dict[str, tuple[Any, int]] = {}
        """Trainable parameter name -> (its bucket's buffers, its position there)."""
        for buf in st.buffers:
            for k, i in enumerate(buf.bucket.param_indices):
                self.where[st.names[i]] = (buf, k)
        self.shapes = {st.names[i]: tuple(st.shapes[i]) for i in range(len(st.names))}
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        # the model's own parameters (a tied head is its embedding's object), not the copies
        # weight-flow's state-dict hook hands out (runtime/weight_writes.py); listing the keys
        # makes every streamed block resident once, as any model.state_dict() does
        self.model_state = {k: params.get(k, v)
                            for k, v in engine.model.state_dict(keep_vars=True).items()}
        self._extras, self.prefix = model_extras(engine.model)

    def _shape(self, key: str) -> tuple[int, ...]:
        # a weight-flow parameter between uses holds no elements: its shape is the engine's
        return self.shapes[key] if key in self.shapes else tuple(self.model_state[key].shape)

    def entries(self) -> list[Entry]:
        groups = alias_groups(self.model_state, lambda k: id(self.model_state[k]))
        return plan_entries(groups, self._shape, lambda k: self.model_state[k].dtype,
                            self.where, lambda name: name.removeprefix(self.prefix))

    def read_master(self, name: str) -> torch.Tensor:
        """One parameter's fp32 master, copied to the CPU from its bucket's buffers."""
        buf, k = self.where[name]
        tier = self.engine.tier
        # read back through a slot, once
        if tier is not None and tier.holds(buf.bucket.id):
            # per bucket: the export walks a bucket's parameters together
            b = buf.bucket.id
            if self._tier_bucket is None or self._tier_bucket[0] != b:
                with tier_access.loaded(tier, b, write=False) as held:
                    self._tier_bucket = (b, [m.detach().to(torch.float32, copy=True)
                                             for m in held.master])
            return self._tier_bucket[1][k]
        return buf.master[k].detach().to("cpu", torch.float32, copy=True)

    def read_other(self, name: str) -> torch.Tensor:
        # a buffer or a frozen weight: weight-flow streams only trainable parameters
        # (runtime/weightflow.py), so these are always resident
        return self.model_state[name].detach().to("cpu", copy=True)

    def extras(self) -> Extras:
        return self._extras

    def close(self) -> None:
        self.model_state = {}
