"""The engine keeps torch's optimizer contract (docs/failure_semantics.md, "What you
may do with the engine").

Whatever a training loop may do with a ``torch.optim`` optimizer, the engine either does the
same or raises at once naming the supported way; never half one way and half the other, never
a result that depends on when a copy lane ran. This module beside ``EngineState`` holds the
checks both transports share:

* gradients: a bucket's gradients are taken when it launches (post-accumulate-grad hook); an
  edit after that (``clip_grad_norm_``, ``p.grad.mul_``, a new ``p.grad``) would be seen by
  some buckets and not others. The gradient's identity and version counter (autograd's
  count of in-place writes, ``Tensor._version``) are recorded at launch and compared at
  ``step()``: an edit raises ``GradientEdited`` (the iteration is rolled back first);
* weights: a write to a parameter outside the engine (``load_state_dict``, ``p.mul_()`` under
  ``no_grad``) bumps its version counter (the engine's own copies write ``p.data``, which
  does not). At the next iteration the optimizer continues from the written weights with its
  moments, as torch's does: the masters adopt them. A write made while the engine was still
  publishing that parameter's new weights (after ``step()``, before the forward that waits for
  them or ``synchronize()``) races the copy lane: it raises ``WeightsWrittenInFlight``;
* one live engine per parameter (a second ``initialize`` closes the first, whose later calls
  raise ``EngineClosed`` naming why);
* no checkpoint of a half-settled iteration (between ``backward()`` and ``step()``);
* data-parallel ranks agree: a fingerprint (parameters, resolved configuration, param groups)
  compared at construction, and a 32-bit hash of the hyper-parameters in force carried by the
  validation all-reduce of every step (runtime/transport.py ``reduce_stats``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import threading
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch

from superoffload.kernels import AdamHyper
from superoffload.runtime.engine_state import EngineState
from superoffload.runtime.errors import EngineError


class ContractError(EngineError):
    """A training-loop pattern the engine cannot honour exactly (the message says the way)."""


class GradientEdited(ContractError):
    """A gradient was changed after the engine had taken it."""


class WeightsWrittenInFlight(ContractError):
    """A parameter was written while its new weights were still being published."""


class MidIterationState(ContractError):
    """A checkpoint / state dict asked for between backward() and step()."""


class RanksDisagree(ContractError):
    """Data-parallel ranks run different models, settings or hyper-parameters."""


_owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}
"""id(parameter) -> (the parameter, the live engine owning it): one engine per parameter."""
_owners_lock = threading.Lock()


def claim_params(params: Sequence[torch.Tensor], engine: Any, names: Sequence[str]) -> None:
    """Register ``engine`` as the owner of ``params``. A live engine already holding one is
    superseded: its iteration in progress is rolled back, it is closed (the model keeps its
    latest weights) and any later call on it raises ``EngineClosed`` naming the new engine --
    a notebook cell re-run builds the new engine while the old one is still in a variable, and
    two live engines would step the same weights from two sets of moments."""
    with _owners_lock:
        holder = _live_owner(params, engine)
        if holder is not None:
            # dropped without close(): an engine is a reference cycle, and its lanes hold it
            # until their last copy ends; let them finish, then collect it before judging
            with contextlib.suppress(Exception):
                holder[1].synchronize()
            holder = None
            gc.collect()
            holder = _live_owner(params, engine)
        ref = weakref.ref(engine)
        for p in params:
            _owners[id(p)] = (weakref.ref(p), ref)
    if holder is not None:
        k, old = holder
        old.supersede(f"a new engine was initialized on the same model (parameter "
                      f"{names[k]!r}); use the new engine")
        warnings.warn(
            f"so.initialize: the model already had a live offload engine (at iteration "
            f"{old.iteration}); it was closed and any call on it now raises EngineClosed. "
            "Call engine.close() (or use `with so.initialize(...) as engine:`) before building "
            "another engine on the same model", stacklevel=3)


def _live_owner(params: Sequence[torch.Tensor], engine: Any) -> tuple[int, Any] | None:
    for k, p in enumerate(params):
        entry = _owners.get(id(p))
        if entry is None:
            continue
        param, owner = entry[0](), entry[1]()
        if param is p and owner is not None and owner is not engine and owner.alive:
            return k, owner
    return None


def owner(param: torch.Tensor) -> Any | None:
    """The live engine that owns ``param`` (None when none does): how a framework
    integration finds the engine behind ``engine.optimizer``."""
    with _owners_lock:
        entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    engine = entry[1]()
    # a collected engine, or a closed or failed one, no longer owns the parameter
    if engine is None or not engine.alive:
        return None
    return engine


def release_params(params: Sequence[torch.Tensor], engine: Any) -> None:
    with _owners_lock:
        for p in params:
            entry = _owners.get(id(p))
            if entry is not None and entry[1]() in (engine, None):
                del _owners[id(p)]


class Contract:
    """Per-engine records behind the checks above (one per engine, owned by its state)."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self._grads: dict[int, tuple[int, int, bool]] = {}
        """Parameter index -> (id of the gradient taken at launch, its version then, whether
        the engine freed it once moved)."""
        # launches may run on autograd's device threads
        self._lock = threading.Lock()
        self.tainted: str | None = None
        """Why the model's weights are a mix the engine could not undo (a racing write to a
        parameter that is its own master); training refuses until weights are loaded."""
        self.baseline: list[tuple[int, int]] = [(0, 0)] * len(state.params)
        """Per parameter: (version counter, data pointer) after the engine last wrote or
        adopted it."""
        self.rebase(state.trainable)

    # ------------------------------------------------------------------ gradients
    def took(self, indices: Iterable[int], *, freeing: bool = False) -> None:
        """The engine takes these parameters' gradients now (a bucket launches); ``freeing``:
        it lets go of their device copies once moved (``p.grad`` becomes None, as under
        DeepSpeed ZeRO-2), so any ``p.grad`` seen later is an edit."""
        params = self.state.params
        with self._lock:
            for i in indices:
                g = params[i].grad
                if g is not None:
                    self._grads[i] = (id(g), g._version, freeing)

    def forget_grads(self) -> None:
        with self._lock:
            self._grads.clear()

    def edited(self) -> list[str]:
        """Names of the parameters whose gradient changed since it was taken: another tensor
        or an in-place write, set to None, or (a gradient the engine freed) set again."""
        params, names, out = self.state.params, self.state.names, []
        with self._lock:
            for i, (gid, version, freed) in self._grads.items():
                g = params[i].grad
                if freed:
                    if g is not None:
                        out.append(names[i])
                elif g is None or id(g) != gid or g._version != version:
                    out.append(names[i])
        return out

    @staticmethod
    def edit_error(names: Sequence[str]) -> GradientEdited:
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return GradientEdited(
            f"the gradient of {len(names)} parameter(s) ({shown}) changed after the engine had "
            "taken it (between backward() and step(): torch.nn.utils.clip_grad_norm_, p.grad "
            "edits, a new p.grad; an offloaded parameter's gradient has left the device and "
            "p.grad is None). Buckets leave for the CPU while backward runs, so such an "
            "edit would reach some of them and not others. The iteration was rolled back. "
            "Supported ways: engine.clip_grad_norm_(max_norm) (returns the total norm, clips "
            "every bucket), OffloadConfig.max_grad_norm, or engine.register_grad_transform(fn) "
            "to change each gradient before it leaves; read one with engine.full_grad(p) "
            "and the norm with engine.grad_norm() (docs/failure_semantics.md)")

    # ------------------------------------------------------------------ weights
    def rebase(self, indices: Iterable[int]) -> None:
        """These parameters now hold what the engine knows (it wrote or adopted them)."""
        params = self.state.params
        for i in indices:
            p = params[i]
            self.baseline[i] = (p._version, p.data_ptr())

    def written(self, indices: Iterable[int], streamed: frozenset[int] = frozenset()
                ) -> list[int]:
        """Of ``indices``, the parameters written outside the engine since the baseline. A
        replaced storage (``p.data = ...``, ``model.to()``) raises: the engine's buffers point
        at the old one. Weight-flow owns a streamed parameter's storage: only its version."""
        params, out = self.state.params, []
        for i in indices:
            p = params[i]
            version, ptr = self.baseline[i]
            if i not in streamed and p.data_ptr() != ptr and p.numel():
                raise ContractError(
                    f"parameter {self.state.names[i]!r} now lives in another storage "
                    "(p.data = ..., model.to(...), model.half()...): the engine's buckets hold "
                    "the old one. Change dtype or device before so.initialize, or close() this "
                    "engine and build a new one")
            if p._version != version:
                out.append(i)
        return out

    def in_flight_error(self, racing: Sequence[int], lost: Sequence[int]
                        ) -> WeightsWrittenInFlight:
        """``racing``: written while their new weights were in flight; ``lost``: written
        parameters that are their own master (fp32 GPU tail), whose write cannot be undone."""
        names = [self.state.names[i] for i in racing]
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        way = ("Write weights after engine.synchronize(), or with model.load_state_dict(...) / "
               "engine.load_checkpoint(...), which wait for the copies first "
               "(docs/failure_semantics.md)")
        if not lost:
            return WeightsWrittenInFlight(
                f"parameter(s) {shown} were written while the engine was still publishing their "
                "new weights from step() (the copy lane and the write raced): every write since "
                f"step() was discarded and the weights from step() restored. {way}")
        kept = ", ".join(repr(self.state.names[i]) for i in lost[:3])
        self.tainted = (
            f"the model's weights are a mix: a write raced the publish of {shown}, whose "
            f"weights from step() were restored, while {kept} (their own masters, GPU tail) "
            "keep the write. Load consistent weights (model.load_state_dict(...), "
            "engine.load_checkpoint(...)) or, to train on from the weights the model holds now, "
            "call engine.adopt_model_weights()")
        return WeightsWrittenInFlight(f"{self.tainted}. {way}")

    def check_tainted(self) -> None:
        if self.tainted is not None:
            raise WeightsWrittenInFlight(self.tainted)

    # ------------------------------------------------------------------ mid-iteration
    @staticmethod
    def refuse_mid_iteration(what: str) -> MidIterationState:
        return MidIterationState(
            f"{what} was called between backward() and step(): the offloaded buckets have "
            "already been stepped speculatively with this batch and the others not, so no "
            "consistent state exists yet. Call it after step() (or call zero_grad() first to "
            "discard the iteration)")


# ---------------------------------------------------------------------------- ranks
_RANK_LOCAL = frozenset({"device", "cpu_threads", "cpu_cores_frac", "telemetry",
                         "telemetry_max_events", "watchdog_s", "pin_memory", "extra"})
"""OffloadConfig fields that may differ between ranks (placement, threads, observability)."""


def fingerprint(state: EngineState, config: Any, hypers: Sequence[AdamHyper]
                ) -> dict[str, Any]:
    """What every data-parallel rank must agree on, field by field (plain, comparable data)."""
    fp: dict[str, Any] = {"parameters": [
        (name, tuple(shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad),
         state.group_of.get(i))
        for i, (name, p, shape) in enumerate(zip(state.names, state.params, state.shapes))]}
    for f in fields(config):
        if f.name not in _RANK_LOCAL:
            fp[f"config.{f.name}"] = repr(getattr(config, f.name))
    fp["param_groups"] = [hyper_tuple(h) for h in hypers]
    return fp


def hyper_tuple(h: AdamHyper) -> tuple[tuple[str, Any], ...]:
    """Every field of a param group's ``AdamHyper`` as (name, value) pairs: read from the
    dataclass, so a hyper-parameter added there is compared and hashed without a list here."""
    return tuple((f.name, getattr(h, f.name)) for f in fields(h))


def first_difference(prints: Sequence[Mapping[str, Any]], ranks: Sequence[int]) -> str | None:
    """A sentence naming the first field whose value differs and the ranks holding each value."""
    keys = list(prints[0])
    for fp in prints[1:]:
        keys += [k for k in fp if k not in keys]
    for key in keys:
        values = [fp.get(key) for fp in prints]
        if all(v == values[0] for v in values):
            continue
        # name the first parameter that differs
        if key == "parameters":
            for k in range(max(len(v or []) for v in values)):
                items = [v[k] if v is not None and k < len(v) else None for v in values]
                if any(x != items[0] for x in items):
                    return _split(f"parameter #{k}", items, ranks)
        return _split(key, values, ranks)
    return None


def _split(what: str, values: Sequence[Any], ranks: Sequence[int]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(repr(v), []).append(r)
    parts = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
    return f"{what} differs between ranks ({parts})"


def hyper_hash(hypers: Sequence[AdamHyper], max_grad_norm: float | None) -> tuple[int, int]:
    """Two 16-bit hashes of the hyper-parameters in force: summed with their squares over the
    ranks by the validation all-reduce, N * sum(h^2) == sum(h)^2 holds exactly (fp64, N <
    1448 ranks) iff every rank holds the same value."""
    text = repr(([hyper_tuple(h) for h in hypers], max_grad_norm)).encode()
    digest = hashlib.blake2b(text, digest_size=4).digest()
    return int.from_bytes(digest[:2], "little"), int.from_bytes(digest[2:], "little")


def hashes_agree(sums: Sequence[float], world: int) -> bool:
    """``sums`` = (sum h1, sum h1^2, sum h2, sum h2^2) over ``world`` ranks."""
    s1, q1, s2, q2 = sums
    return world * q1 == s1 * s1 and world * q2 == s2 * s2

