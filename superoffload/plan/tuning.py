"""Auto-tuner: search OffloadConfig settings with the simulator and explain the choice.
Past 400 lines: the search, its explanation and the numerics decision read one another.

Coordinate descent over the knobs the paper tunes by hand (§4.2 bucket size and ratio, §4.3 STV
mode, §4.4 casting side, §4.5 weight policy, the CPU core split): start from the paper's
defaults, improve one knob at a time by simulated expected iteration time among the settings
that fit memory, until nothing changes. Every candidate is a `simulate()` call (milliseconds).

bf16 Adam moments (``optimizer_state_dtype="bf16"``, stochastic rounding; docs/kernel.md)
change the maths, so they are not a knob: only with ``Constraints(allow_bf16_moments=True)``
does the tuner search again with them, proposing them only when that search's best is
``BF16_MIN_GAIN`` faster than with fp32 moments (or only they fit), saying so; without the
flag the explanation mentions them when they would pay. ``Constraints(storage=True)``: the
storage tier holds what host memory cannot (plan/tier_budget.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from superoffload.config import MIN_BUCKET_BYTES, MiB, OffloadConfig, choices_of
from superoffload.plan.cost import PARAM_CAST_PREFERENCE
from superoffload.plan.feasible import Feasibility, search
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.schedule import EngineVariant
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulator import SimResult, simulate
from superoffload.plan.techniques import PAPER_CLIP_RATE, Techniques
from superoffload.plan.tier_budget import tier_config

BUCKET_CHOICES = tuple(m * MiB for m in (8, 16, 32, 64, 128, 256, 512))
TIE = 0.002
"""Relative difference in predicted time below which two settings count as equally fast."""
RATIO_CHOICES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
BF16_MIN_GAIN = 0.02
"""bf16 moments change the numerics: proposed only when the best setting with them is at
least this much faster (relative) than the best with fp32 moments."""


class InfeasibleError(ValueError):
    """No setting fits: the message says what is needed and what the profile has."""


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Limits and fixed choices for `tune`. Memory caps tighten the profile's figures."""

    device_memory_bytes: float | None = None
    host_memory_bytes: float | None = None
    """Host memory the job's GPU may use (a cap on its share of the host)."""
    cpu_cores: int | None = None
    """Cores the job may use (default: its GPU's share of the profile's)."""
    rollback_rate: float = PAPER_CLIP_RATE
    """Expected share of iterations that clip or overflow (paper: 93 of ~79,000 for BLOOM)."""
    max_grad_norm: float | None = None
    fixed: dict[str, Any] = field(default_factory=dict)
    """OffloadConfig fields to keep as given, e.g. {"ratio": 0.9, "weights": "stationary"}."""
    bucket_choices: tuple[int, ...] = BUCKET_CHOICES
    ratio_choices: tuple[float, ...] = RATIO_CHOICES
    engine: EngineVariant | None = None
    """The engine variant to tune for; None: the one the engine runs for each candidate
    config (``plan.schedule.engine_for``; fix ``step_order`` to tune for FIFO stepping)."""
    storage: bool = False
    """Keep what host memory cannot hold on the profile's storage tier (plan/tier_budget.py)."""
    allow_bf16_moments: bool = False
    """Let the tuner propose ``optimizer_state_dtype="bf16"`` (bf16 Adam moments with
    stochastic rounding: 20 instead of 28 B/param through the CPU step, 4 B/param less host
    memory, and different numerics, docs/kernel.md). Off by default because it changes the
    maths; ``fixed={"optimizer_state_dtype": ...}`` overrides it either way."""

    def apply(self, prof: HardwareProfile) -> HardwareProfile:
        """``prof`` within the caps; host caps are on one GPU's share (1/gpus_per_host)."""
        share, changes = prof.gpus_per_host, {}
        if self.device_memory_bytes is not None:
            changes["device_memory_bytes"] = min(prof.device_memory_bytes, self.device_memory_bytes)
        if self.host_memory_bytes is not None:
            changes["host_memory_bytes"] = min(prof.host_memory_bytes,
                                               self.host_memory_bytes * share)
        if self.cpu_cores is not None:
            if self.cpu_cores < 1:
                raise ValueError(f"Constraints.cpu_cores={self.cpu_cores}: use a whole number >= 1")
            changes["cpu_cores"] = min(prof.cpu_cores, self.cpu_cores * share)
        return prof.replace(**changes) if changes else prof


def _threads_frac(prof: HardwareProfile) -> list[float]:
    """Core-split candidates: leave one core to the engine's hook/transfer threads, or not."""
    n = prof.cpu_cores
    fracs = {1.0, 0.9, 0.75, 0.5}
    if n > 1:
        fracs.add((n - 1) / n)
    return sorted(fracs, reverse=True)


def tune(model_or_shape: Any, prof: HardwareProfile, constraints: Constraints | None = None, *,
         seq: int | None = None, micro_batch: int = 1
         ) -> tuple[OffloadConfig, str, SimResult]:
    """Best OffloadConfig for `model_or_shape` (ModelShape, or nn.Module with `seq`) on `prof`.
    Returns (config, explanation, prediction); raises InfeasibleError naming what does not fit."""
    shape = _as_shape(model_or_shape, seq, micro_batch)
    cons = constraints or Constraints()
    eff = cons.apply(prof)
    tech = Techniques(rollback_rate=cons.rollback_rate, engine=cons.engine)
    base = OffloadConfig(max_grad_norm=cons.max_grad_norm).replace(**cons.fixed)
    if cons.storage:  # what host memory cannot hold goes to the tier
        if not eff.has_storage:
            raise InfeasibleError(f"profile {eff.name} has no storage tier (--storage)")
        base = base.replace(**{k: v for k, v in tier_config(shape, eff).items()
                               if k not in cons.fixed})
    cache: dict[tuple, SimResult] = {}

    def run(cfg: OffloadConfig) -> SimResult:
        # repr: values may be unhashable; "extra" holds notes that change no prediction
        key = tuple(sorted((k, repr(v)) for k, v in cfg.to_dict().items() if k != "extra"))
        if key not in cache:
            cache[key] = simulate(shape, eff, "superoffload", cfg, tech)
        return cache[key]

    weigh = cons.allow_bf16_moments and "optimizer_state_dtype" not in cons.fixed
    if weigh:
        cfg, best, tried, moments = _weigh_moments(shape, eff, cons, base, run)
    else:
        try:
            cfg, best, tried = _search(shape, eff, cons, base, run)
        except InfeasibleError as exc:
            raise InfeasibleError(str(exc) + _bf16_hint(shape, eff, base, cons)) from None
        moments = _moments_note(eff, cfg, best, cons, run)
    zero = simulate(shape, eff, "zero-offload", None, tech)
    explanation = _explain(shape, eff, cfg, best, zero, tried, cons)
    if moments:
        explanation += "\n" + moments
    numerics: list[str] = []
    if cfg.optimizer_state_dtype != "fp32" and "optimizer_state_dtype" not in cons.fixed:
        # the tuner changed the maths on its own: the config records it for its reader
        numerics = [f"optimizer_state_dtype={cfg.optimizer_state_dtype!r}"]
    cfg = cfg.replace(extra={**cfg.extra, "planner": {
        "profile": prof.name,
        "predicted_iteration_s": float(best.iteration_s),
        "predicted_tflops": float(best.tflops),
        "predicted_memory_bytes": {k: float(v) for k, v in best.memory.items()},
        "zero_offload_iteration_s": float(zero.iteration_s) if zero.fits else None,
        "numerics_changes": numerics,
        "explanation": explanation,
    }})
    return cfg, explanation, best


def _search(shape: ModelShape, eff: HardwareProfile, cons: Constraints, base: OffloadConfig,
            run: Callable[[OffloadConfig], SimResult]
            ) -> tuple[OffloadConfig, SimResult, dict[str, list[tuple[Any, SimResult]]]]:
    """The coordinate descent from `base` (module docstring): (config, its prediction, what
    each knob's alternatives gave). InfeasibleError when even the frugal setting does not."""
    def score(r: SimResult) -> float:
        return r.iteration_s if r.fits else math.inf

    # a setting that fits memory first (plan/feasible.py): if the search finds none, none is
    feas = feasible(shape, eff, base, cons)
    if feas.config is None:
        raise InfeasibleError(
            f"{format_count(shape.params)} parameters cannot be trained on {eff.name} at any "
            f"setting the constraints leave open: " + "; ".join(feas.problems))
    # the ratios that fit may lie between two grid points: try the window's ends too
    window = sorted(set(feas.ratio_window or ()) - set(cons.ratio_choices), reverse=True)

    knobs: dict[str, list[Any]] = {
        "bucket_bytes": _bucket_choices(shape, cons),
        "ratio": list(cons.ratio_choices) + window,
        "weights": list(choices_of("weights", decided=True)),
        "grad_cast": list(choices_of("grad_cast", decided=True)),
        "param_cast": list(PARAM_CAST_PREFERENCE),  # a search order, not the declaration's
        "speculation": list(choices_of("speculation")),
        "cpu_cores_frac": _threads_frac(eff),
        "prefetch_depth": [1, 2, 3],
    }
    knobs = {k: v for k, v in knobs.items() if k not in cons.fixed}
    start = {"weights": "stationary", "grad_cast": "auto", "param_cast": "auto"}
    cfg = base.replace(**{k: v for k, v in start.items() if k not in cons.fixed})
    if not run(cfg).fits:
        cfg = feas.config
    found = _descend(cfg, knobs, run, score)
    # a second start where the least is offloaded that fits (the window's low end, frugal
    # casts): one knob at a time cannot reach it from a start that fits with another casting
    low = None
    if feas.ratio_window:
        low = feas.config.replace(ratio=feas.ratio_window[0])
    if low is not None and "ratio" not in cons.fixed and low != cfg and run(low).fits:
        other = _descend(low, knobs, run, score)
        if score(other[1]) < score(found[1]) * (1 - TIE):
            found = other
    return found


def _descend(cfg: OffloadConfig, knobs: dict[str, list[Any]],
             run: Callable[[OffloadConfig], SimResult], score: Callable[[SimResult], float]
             ) -> tuple[OffloadConfig, SimResult, dict[str, list[tuple[Any, SimResult]]]]:
    """Coordinate descent from ``cfg`` over ``knobs`` (module docstring)."""
    best = run(cfg)
    tried: dict[str, list[tuple[Any, SimResult]]] = {}
    # a few rounds reach a fixed point in practice; the bound keeps a cycle from looping
    for _round in range(4):
        changed = False
        for name, choices in knobs.items():
            if name == "prefetch_depth" and cfg.weights != "flow":
                continue
            results = [(v, run(cfg.replace(**{name: v}))) for v in choices]
            tried[name] = results
            fastest = min(score(r) for _, r in results)
            if math.isinf(fastest):
                continue
            # settings within TIE of the fastest are equal: take the preferred one
            near = [(v, r) for v, r in results if score(r) <= fastest * (1 + TIE)]
            value, res = min(near, key=lambda vr: (_prefer(name, vr[0]), score(vr[1])))
            # a preferred value may move within TIE, so ties fall to the paper's defaults
            if value != getattr(cfg, name) and (score(res) < score(best) * (1 + TIE)):
                cfg, best, changed = cfg.replace(**{name: value}), res, True
        if not changed:
            break
    if not best.fits:  # pragma: no cover - the frugal start fits by the check above
        raise InfeasibleError("; ".join(best.problems))
    return cfg, best, tried


def feasible(shape: ModelShape, eff: HardwareProfile, base: OffloadConfig,
             cons: Constraints, dtype: str | None = None) -> Feasibility:
    """The memory search (plan/feasible.py) over what `cons` leaves open (moments: `dtype`)."""
    fixed = set(cons.fixed) | {"optimizer_state_dtype"}
    base = base if dtype is None else base.replace(optimizer_state_dtype=dtype)
    return search(shape, eff, base, fixed=fixed, bucket_bytes=min(cons.bucket_choices),
                  techniques=Techniques(rollback_rate=cons.rollback_rate, engine=cons.engine))


# ----------------------------------------------------------------- bf16 moments (numerics)
_BF16_WHAT = ("the host's Adam moments in bf16 with stochastic rounding: 8 B/param fewer "
              "through the CPU step (28 -> 20 for the fp32 step) and 4 B/param less host "
              "memory; accuracy (docs/kernel.md): median relative error ~0.4% in m and ~1.5% "
              "in v against fp32 moments, rollback exact to a few bf16 roundings")
_ALLOW = "Constraints(allow_bf16_moments=True), plan/tuning --allow-bf16-moments"


def _weigh_moments(shape: ModelShape, eff: HardwareProfile, cons: Constraints,
                   base: OffloadConfig, run: Callable[[OffloadConfig], SimResult]
                   ) -> tuple[OffloadConfig, SimResult, dict[str, list[tuple[Any, SimResult]]],
                              str]:
    """The search with fp32 moments and again with bf16 moments; bf16 only when its best is
    BF16_MIN_GAIN faster, or only it fits. Returns the search's result and the line that
    explains the choice."""
    found: dict[str, tuple[OffloadConfig, SimResult, dict[str, list[tuple[Any, SimResult]]]]] = {}
    errors: dict[str, InfeasibleError] = {}
    # fp32 first: bf16 must beat it
    for dtype in choices_of("optimizer_state_dtype"):
        try:
            found[dtype] = _search(shape, eff, cons, base.replace(optimizer_state_dtype=dtype),
                                   run)
        except InfeasibleError as exc:
            errors[dtype] = exc
    if "fp32" not in found:
        if "bf16" not in found:
            # the more frugal of the two: its problems are the ones to fix
            raise errors["bf16"]
        return (*found["bf16"], f"- optimizer_state_dtype = 'bf16': CHANGES THE NUMERICS "
                f"(allowed: {_ALLOW}): {_BF16_WHAT}. Chosen because fp32 moments do not fit: "
                f"{errors['fp32']}.")
    f_cfg, f_best, _ = found["fp32"]
    if "bf16" not in found:  # pragma: no cover - bf16 moments need less memory than fp32
        return (*found["fp32"], f"- optimizer_state_dtype = 'fp32': bf16 moments were "
                f"allowed but do not fit: {errors['bf16']}.")
    b_best = found["bf16"][1]
    gain = 1.0 - b_best.iteration_s / f_best.iteration_s
    if gain >= BF16_MIN_GAIN:
        return (*found["bf16"], f"- optimizer_state_dtype = 'bf16': CHANGES THE NUMERICS "
                f"(allowed: {_ALLOW}): {_BF16_WHAT}. Predicted {b_best.iteration_s * 1e3:.1f} "
                f"ms against {f_best.iteration_s * 1e3:.1f} ms with fp32 moments at their own "
                f"best setting (ratio {f_cfg.ratio:g}, "
                f"{_fmt('bucket_bytes', f_cfg.bucket_bytes)}): "
                f"{gain:.1%} faster. Fix optimizer_state_dtype='fp32' to keep fp32 maths.")
    return (*found["fp32"], f"- optimizer_state_dtype = 'fp32': bf16 moments were allowed and "
            f"weighed: their best setting predicts {b_best.iteration_s * 1e3:.1f} ms "
            f"({b_best.iteration_s / f_best.iteration_s - 1:+.1%}), less than the "
            f"{BF16_MIN_GAIN:.0%} a change of numerics must gain.")


def _moments_note(eff: HardwareProfile, cfg: OffloadConfig, best: SimResult, cons: Constraints,
                  run: Callable[[OffloadConfig], SimResult]) -> str:
    """Without the flag: a line when bf16 moments would pay at the chosen setting (the core
    split re-chosen: their pass needs more compute), else ''."""
    if "optimizer_state_dtype" in cons.fixed or cfg.optimizer_state_dtype != "fp32":
        return ""
    if "cpu_cores_frac" in cons.fixed:
        fracs = [cfg.cpu_cores_frac]
    else:
        # bf16 moments' pass needs more compute: the core split is chosen again for them
        fracs = _threads_frac(eff)
    alts = [run(cfg.replace(optimizer_state_dtype="bf16", cpu_cores_frac=f)) for f in fracs]
    alt = min((r for r in alts if r.fits), key=lambda r: r.iteration_s, default=None)
    if alt is None or 1.0 - alt.iteration_s / best.iteration_s < BF16_MIN_GAIN:
        return ""
    return (f"- optimizer_state_dtype = 'fp32': bf16 moments would take "
            f"{alt.iteration_s * 1e3:.1f} ms at this setting "
            f"({alt.iteration_s / best.iteration_s - 1:+.1%}); they change the numerics, so "
            f"the tuner proposes them only when allowed ({_ALLOW}).")


def _bf16_hint(shape: ModelShape, eff: HardwareProfile, base: OffloadConfig,
               cons: Constraints) -> str:
    """Appended to an InfeasibleError when bf16 moments (not allowed) would make it fit."""
    if "optimizer_state_dtype" in cons.fixed or base.optimizer_state_dtype != "fp32":
        return ""
    if not feasible(shape, eff, base, cons, "bf16").fits:
        return ""
    return (f". bf16 moments would fit (4 B/param less host memory); they change the "
            f"numerics, so allow them explicitly: {_ALLOW}")


def _prefer(name: str, value: Any) -> float:
    """Tie-break between equally fast settings: the paper's defaults, less device memory."""
    if name == "ratio":
        # more offloaded = less device memory
        return -float(value)
    if name == "bucket_bytes":
        # the paper's ~64 MB (§4.2), by distance in octaves
        return abs(math.log2(value / (64 * MiB)))
    if name == "speculation":
        return {"on": 0, "adaptive": 1, "off": 2}[value]
    if name == "weights":
        return 0 if value == "stationary" else 1
    if name == "cpu_cores_frac":
        # as fast with fewer cores: leave the rest to the data pipeline
        return float(value)
    return 0.0


def _as_shape(obj: Any, seq: int | None, micro_batch: int) -> ModelShape:
    if isinstance(obj, ModelShape):
        return obj
    if seq is None:
        raise TypeError("tune: pass a ModelShape, or an nn.Module together with seq=<tokens>")
    return ModelShape.from_module(obj, seq=seq, micro_batch=micro_batch)


def _gb(x: float) -> str:
    """Bytes for people: "1.3 GB", "14.2 MB", "820 KB" (a tiny model is not "0.0 GB")."""
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if x >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.0f} B"


def _delta(delta: float) -> str:
    """A relative change for people: "+3.2%", or "same" within 0.05% (not "-0.0%")."""
    return "same" if abs(delta) < 5e-4 else f"{delta:+.1%}"


def _explain(shape: ModelShape, prof: HardwareProfile, cfg: OffloadConfig, best: SimResult,
             zero: SimResult, tried: dict[str, list[tuple[Any, SimResult]]],
             cons: Constraints) -> str:
    lines = [
        f"Model {format_count(shape.params)} params ({shape.layers} layers x {shape.hidden}), "
        f"seq {shape.seq} x batch {shape.micro_batch} on {prof.name}.",
        f"Predicted: {best.iteration_s * 1e3:.3g} ms/iteration, {best.tflops:.3g} TFLOPS "
        f"(device compute busy {best.lanes['device_compute'].utilization:.0%}, CPU optimizer busy "
        f"{best.lanes['cpu_optimizer'].utilization:.0%}); device {_gb(best.memory['device'])}, "
        f"host {_gb(best.memory['host'])}.",
    ]
    if zero.fits:
        lines.append(f"ZeRO-Offload would take {zero.iteration_s * 1e3:.1f} ms: "
                     f"{zero.iteration_s / best.iteration_s:.2f}x slower.")
    else:
        lines.append("ZeRO-Offload would not fit: " + "; ".join(zero.problems) + ".")
    why = {
        "ratio": "share of gradient bytes stepped on the CPU; the rest stays on the device so the "
                 "next forward need not wait for the CPU (paper §4.2)",
        "bucket_bytes": "bucket size: small buckets pay per-transfer latency, large ones start the "
                        "CPU late and leave a longer tail (§4.2)",
        "weights": "weight policy (§4.5)",
        "grad_cast": "where gradients are cast (§4.4)",
        "param_cast": "where updated weights are cast (§4.4)",
        "speculation": f"STV mode at an expected clipping rate of {cons.rollback_rate:.4f} (§4.3)",
        "cpu_cores_frac": "share of host cores for the CPU optimizer (settings within "
                          f"{TIE:.1%} of the fastest count as equal; fewer cores win the tie, "
                          "leaving the rest to the data pipeline)",
        "prefetch_depth": "weight-flow blocks fetched ahead",
    }
    for name, results in tried.items():
        chosen = getattr(cfg, name)
        parts = []
        for value, res in results:
            if value == chosen:
                continue
            if not res.fits:
                parts.append(f"{_fmt(name, value)}: does not fit ({res.problems[0]})")
            else:
                parts.append(f"{_fmt(name, value)}: "
                             f"{_delta(res.iteration_s / best.iteration_s - 1)}")
        shown = _fmt(name, chosen)
        # four alternatives are enough to see the trend; the rest are elided
        more = ", ..." if len(parts) > 4 else ""
        lines.append(f"- {name} = {shown}: {why[name]}. Alternatives: "
                     + ", ".join(parts[:4]) + more)
    for key, value in sorted(cons.fixed.items()):
        lines.append(f"- {key} = {value!r}: fixed by the constraints.")
    lines.extend(f"- cost model: {r}" for r in best.plan.reasons)
    return "\n".join(lines)


def _bucket_choices(shape: ModelShape, cons: Constraints) -> list[int]:
    """The constraint's sizes, plus — for a model whose gradients fit in fewer than a couple
    of the smallest buckets — powers of two down to a sixty-fourth of its gradient bytes, so
    a small model is tuned with several buckets too (a tiny model in one 8 MiB bucket cannot
    overlap anything)."""
    choices = set(cons.bucket_choices)
    # the defaults, not the caller's own list
    if cons.bucket_choices == BUCKET_CHOICES:
        # fp32 gradient bytes: what the bucket size is measured in
        grad_bytes = 4 * shape.params
        size = 1 << max(MIN_BUCKET_BYTES.bit_length() - 1, (grad_bytes // 64).bit_length())
        while size < min(BUCKET_CHOICES) and size <= 2 * grad_bytes:
            choices.add(size)
            size *= 2
    return sorted(choices)


def format_count(n: float) -> str:
    """120576 -> "121K", 1.3e9 -> "1.3B" (3 significant digits): a count for people."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def _fmt(name: str, value: Any) -> str:
    if name == "bucket_bytes":
        return f"{value // MiB} MiB" if value >= MiB else f"{value // 1024} KiB"
    if isinstance(value, float):
        return f"{value:.3g}"
    return repr(value) if isinstance(value, str) else str(value)
