"""The schedule rule book: what an engine really runs for a config (DESIGN.md §6, "one rule book").

One pure function, ``resolve_schedule(config, facts)``, decides every rule that turns the
requested ``OffloadConfig`` into the schedule that runs; the engine (single-process and over
FSDP2) and the planner's simulator both call it, so a prediction always describes the schedule
that runs and telemetry can record the effective values:

* weight-flow offloads every bucket (ratio 1) and casts weights on the host: the host's
  low-precision copy is what streams in (paper §4.5); with data parallel too (FSDP2's block
  units keep their shards on the host, where the CPU step publishes);
* buckets hold whole parameters, in gradient-ready order, as ``plan.buckets.plan_buckets``
  cuts them (paper §4.2), and ``ratio`` rounds to whole buckets;
* casting "auto" (paper §4.4): on a CPU-only machine the "link" is a memory copy, so moving
  fewer bytes wins (host both ways); on a GPU the cost model picks per direction for the
  given hardware profile, and without a profile the Superchip default (gradients cast on
  the device, weights on the host: the kernel writes the bf16 copy in its pass);
* an fp32 model casts nothing; fp16 gradients are widened on the device (the CPU kernel
  reads fp32 or bf16);
* CPU optimizer threads: ``optimizer_threads`` below, the one thread rule;
* where offloaded gradients accumulate over ``grad_accum_steps`` > 1 (``grad_accum_on``):
  as configured; "auto" as decided by ``plan.grad_accum.choose_grad_accum`` (passed in as
  ``grad_accum``, like the weight policy); without a decision "device" (on a CPU-only device
  that is the decision: one memory pool, nothing to save), said in ``notes``; with one
  micro-step the place does not matter ("device");
* the engine's implementation choices that change the timeline (``EngineVariant``: the step
  order of offloaded buckets, the GPU tail step, the D2H stats launch, small-bucket merging):
  ``ENGINE`` is what the engine implements, and ``engine_for(config)`` is that variant with
  the step order ``OffloadConfig.step_order`` selects ("deadline" or "fifo"). The engine
  (runtime/engine.py) and the planner (plan/techniques.py) both resolve with it, so they
  agree for either setting. ``ENGINE_H200_MEASURED`` is the engine FACTS.md's H200 table was
  measured with (plan/facts.py);
* data parallel (``ScheduleFacts.blocks`` given): the FSDP2 units and the buckets each holds
  (``plan.fsdp_units.plan_units``, the rule ``FsdpOffloadEngine`` shards a model with: blocks
  grouped up to one bucket weight-stationary, one host-resident unit per block under
  weight-flow, the root for the rest). The buckets stay ``plan_buckets``' whole parameters in
  gradient-ready order (``EngineVariant.buckets_per_unit``: cut within the units instead);
  a bucket is complete when the last unit holding one of its parameters has reduce-scattered
  (docs/planner.md, "Data parallel").

No torch, no threads, no devices (docs/conventions.md, "Pure planning core").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from superoffload.config import OffloadConfig, StepOrder, choices_of
from superoffload.plan.buckets import BucketPlan, ParamSpec, plan_buckets
from superoffload.plan.fsdp_units import UnitPlan, plan_units, unit_buckets
from superoffload.plan.hardware import HardwareProfile
from superoffload.threads import optimizer_threads, runtime_threads

__all__ = ["ENGINE", "ENGINE_H200_MEASURED", "EngineVariant", "Schedule", "ScheduleFacts",
           "TailStep", "engine_for", "resolve_casting", "resolve_grad_accum", "resolve_schedule",
           "specs_of"]

DTYPES = ("float32", "bfloat16", "float16")
DEVICE_TYPES = ("cpu", "cuda")
TailStep = Literal["unfused", "fused"]
TAIL_STEPS: tuple[TailStep, ...] = get_args(TailStep)


@dataclass(frozen=True, slots=True)
class EngineVariant:
    """How the engine implements the schedule, where that changes the timeline."""

    step_order: StepOrder = "fifo"
    """Order the CPU steps (and H2D sends) offloaded buckets, as ``OffloadConfig.step_order``:
    "fifo" in gradient-ready order (the bucket the next forward needs first is stepped last),
    or "deadline", earliest deadline first (of the buckets ready, the one the next forward
    needs first is stepped and sent first; DESIGN.md §6)."""
    tail_step: TailStep = "unfused"
    """GPU tail step: "unfused" (``kernels.device_adam_multi``: ~13 foreach passes, per-tensor
    casts, ~118 B/param and ~20 launches per bucket) or "fused" (one pass
    reading bf16 gradients and writing the bf16 copy: 28 B/param, one launch per bucket)."""
    d2h_stats_first: bool = True
    """The D2H lane launches the bucket's ~9 norm/non-finite kernels before its copy and keeps
    one bucket in flight with a host round trip each; False: copy first,
    stats after, several buckets in flight."""
    merge_small_buckets: bool = False
    """Buckets less than half full ride with the next parameter instead of closing
    (``plan_buckets(merge_small=...)``: fewer tiny buckets, each with fixed costs)."""
    buckets_per_unit: bool = False
    """Data parallel over FSDP2 with its units known (``ScheduleFacts.units`` or
    ``.blocks``): buckets follow the units (``plan.fsdp_units.unit_buckets``: none crosses a
    unit, ids in FSDP2's reduce order, the root's last). False: ``plan_buckets`` over the
    whole model, what ``FsdpOffloadEngine`` runs (docs/planner.md, "Data parallel": the
    simulator's case for switching)."""

    def __post_init__(self) -> None:
        if self.step_order not in get_args(StepOrder):
            raise ValueError(f"EngineVariant.step_order={self.step_order!r}: use one of "
                             f"{get_args(StepOrder)}")
        if self.tail_step not in TAIL_STEPS:
            raise ValueError(f"EngineVariant.tail_step={self.tail_step!r}: use one of "
                             f"{TAIL_STEPS}")


ENGINE_H200_MEASURED = EngineVariant()
"""The engine at 167091f / ef04687, the one FACTS.md's H200 table was measured with: FIFO
stepping, unfused tail step, stats launched before each copy, no small-bucket merging."""
ENGINE = EngineVariant(step_order="deadline", tail_step="fused", d2h_stats_first=False,
                       merge_small_buckets=True)
"""What the engine implements now (the planner's default; landed at 21db21a): earliest
deadline first, copy-first D2H with several buckets in flight, small buckets merged, fused tail
step (kernels/device_adam.py). Its step order is the default ``OffloadConfig.step_order``
("deadline"); ``engine_for`` applies another."""

def engine_for(config: OffloadConfig, base: EngineVariant = ENGINE) -> EngineVariant:
    """The variant the engine runs for ``config``: ``base`` (the engine's implementation) with
    the step order ``config.step_order`` selects (runtime/launch.py and runtime/stv.py step
    "deadline" earliest deadline first, "fifo" in gradient-ready order). The engine and the
    planner both call it."""
    order = config.step_order
    if order not in get_args(StepOrder):
        raise ValueError(f"OffloadConfig.step_order={order!r}: use one of "
                         f"{get_args(StepOrder)}")
    return base if base.step_order == order else replace(base, step_order=order)


@dataclass(frozen=True, slots=True)
class ScheduleFacts:
    """What the rules need to know about the model and the machine."""

    params: tuple[ParamSpec, ...]
    """The model's parameters in registration order (as ``plan_buckets`` takes them)."""
    model_dtype: str = "bfloat16"
    """Dtype of the trainable parameters: "float32", "bfloat16" or "float16"."""
    device_type: str = "cuda"
    """Where forward/backward run: "cpu" or "cuda"."""
    dp: int = 1
    """Ranks the offloaded state is sharded over (FSDP2 data parallel; under HSDP one
    replica's); 1 for one process."""
    usable_cores: int = 1
    """Cores the host gives this job (affinity mask, or a profile's cores)."""
    local_ranks: int = 1
    """Ranks sharing this host's cores."""
    profile: HardwareProfile | None = None
    """Hardware for casting="auto" on a GPU (the cost model); None: the Superchip default."""
    engine: EngineVariant = ENGINE
    """The engine's implementation variant (the planner may ask for another: Techniques)."""
    blocks: tuple[int, ...] | None = None
    """Per parameter of ``params``: its block (0-based: the longest ``nn.ModuleList``), or -1
    outside the blocks. Given: the schedule includes the FSDP2 units (``Schedule.units``)."""
    units: tuple[tuple[int, ...], ...] | None = None
    """The FSDP2 units of a sharded model, as they are: each one's parameter indices, forward
    order, the root first (the buckets follow them under ``engine.buckets_per_unit``;
    otherwise the units ``blocks`` gives are used)."""

    def __post_init__(self) -> None:
        if self.model_dtype not in DTYPES:
            raise ValueError(f"ScheduleFacts.model_dtype={self.model_dtype!r}: use one of {DTYPES}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"ScheduleFacts.device_type={self.device_type!r}: use one of "
                             f"{DEVICE_TYPES}")
        for name in ("dp", "usable_cores", "local_ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ScheduleFacts.{name}={value!r}: use a whole number >= 1")


@dataclass(frozen=True, slots=True)
class Schedule:
    """The schedule that runs (every rule applied, every "auto" decided)."""

    weights: str
    """"stationary" or "flow"."""
    requested_ratio: float
    """``OffloadConfig.ratio`` as asked."""
    ratio: float
    """The ratio the buckets were planned with (1.0 under weight-flow)."""
    bucket_plan: BucketPlan
    grad_cast: str
    """"host" (gradients cross in the model dtype, the CPU kernel casts) or "device"."""
    param_cast: str
    """"host" (the kernel writes the low-precision copy that crosses) or "device"."""
    threads: int
    """CPU optimizer threads of this rank."""
    dp: int
    notes: tuple[str, ...] = ()
    """Why a requested value changed, in plain language."""
    engine: EngineVariant = ENGINE
    """Step order, tail step and D2H launch order the schedule runs with."""
    grad_accum_on: str = "device"
    """Where offloaded gradients accumulate over micro-steps: "device" or "host" (decided)."""
    units: UnitPlan | None = None
    """The FSDP2 units and the buckets each holds (``ScheduleFacts.blocks`` given), else None."""

    @property
    def offloaded_fraction(self) -> float:
        """Share of the trainable elements whose state and step are on the host."""
        return self.bucket_plan.offloaded_fraction

    @property
    def host_numel(self) -> int:
        return sum(b.numel for b in self.bucket_plan.host_buckets)

    @property
    def device_numel(self) -> int:
        return sum(b.numel for b in self.bucket_plan.device_buckets)

    def bucket_table(self) -> list[tuple[int, tuple[int, ...], int, bool]]:
        """(id, parameter indices, numel, on_device) per bucket: what tests compare."""
        return [(b.id, b.param_indices, b.numel, b.on_device) for b in self.bucket_plan.buckets]


def resolve_casting(grad_cast: str, param_cast: str, *, model_dtype: str, device_type: str,
                    weights: str, profile: HardwareProfile | None = None,
                    threads: int = 1, bucket_params: float = 16 * 2**20,
                    moments: str = "fp32") -> tuple[str, str, tuple[str, ...]]:
    """(grad side, param side, notes) for one model dtype; see the module docstring."""
    notes: list[str] = []
    if model_dtype == "float32":
        # nothing to cast: fp32 crosses both ways
        return "device", "device", ()
    g, p = grad_cast, param_cast
    if "auto" in (g, p):
        if device_type == "cpu":
            # one memory pool: a "device" cast is a host pass too, so cast where the kernel
            # fuses it
            g_auto, p_auto = "host", "host"
        elif profile is not None:
            # the cost model (pure)
            from superoffload.plan import cost

            g_auto, p_auto, why = cost.choose_casting(profile, "ours", threads, bucket_params,
                                                      moments)
            notes.append(f"casting auto on {profile.name}: {why}")
        else:
            # no profile to ask: the paper's Superchip choice (§4.4)
            g_auto, p_auto = "device", "host"
        # only the "auto" sides take the decision; a side the user set stays
        if g == "auto":
            g = g_auto
        if p == "auto":
            p = p_auto
    if g == "host" and model_dtype == "float16":
        # the CPU kernel reads fp32 or bf16 gradients: fp16 is widened first
        g = "device"
        notes.append("fp16 gradients are widened to fp32 on the device (the CPU kernel reads "
                     "fp32 or bf16)")
    if weights == "flow" and p != "host":
        # the blocks stream from the host's low-precision copy, which the host cast writes
        p = "host"
        notes.append("weight-flow: weights are cast on the host (the host's low-precision copy "
                     "streams in)")
    return g, p, tuple(notes)


def resolve_grad_accum(config: OffloadConfig, device_type: str,
                       decided: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(where offloaded gradients accumulate, notes): the module docstring's rule."""
    place = config.grad_accum_on
    if place != "auto":
        return place, ()
    if config.grad_accum_steps == 1:
        # nothing accumulates
        return "device", ()
    if decided is not None:
        if decided not in choices_of("grad_accum_on", decided=True):
            raise ValueError(f"resolve_schedule: grad_accum={decided!r}; pass 'device' or 'host'")
        return decided, ()
    if device_type == "cpu":
        # one memory pool: the rule's answer (plan.grad_accum)
        return "device", ()
    return "device", ("grad_accum_on='auto' not decided (plan.grad_accum.choose_grad_accum "
                      "decides it): accumulating on the device",)


def resolve_schedule(config: OffloadConfig, facts: ScheduleFacts, *,
                     weights: str | None = None, grad_accum: str | None = None) -> Schedule:
    """The schedule ``config`` runs on ``facts``. ``weights``: the decided policy when
    ``config.weights`` is "auto" (the engine decides it at the first batch, the planner by
    ``plan.choose_weights``); otherwise ``config.weights``. ``grad_accum``: the decided place
    when ``config.grad_accum_on`` is "auto" (``plan.grad_accum.choose_grad_accum``)."""
    # the caller's decision of "auto" wins; otherwise the config's own policy
    policy = config.weights if weights is None else weights
    if policy not in choices_of("weights", decided=True):
        raise ValueError(f"resolve_schedule: weights={policy!r}; decide 'auto' first "
                         "(plan.choose_weights) and pass 'stationary' or 'flow'")
    notes: list[str] = []
    ratio = float(config.ratio)
    if policy == "flow" and ratio != 1.0:
        notes.append(f"weight-flow: every bucket is offloaded (ratio {ratio:g} -> 1); the "
                     "host copy each CPU step writes is what streams in (§4.5)")
        ratio = 1.0
    threads = optimizer_threads(facts.usable_cores, config.cpu_cores_frac,
                                local_ranks=facts.local_ranks,
                                reserved=runtime_threads(facts.device_type),
                                explicit=config.cpu_threads)
    units = None
    if facts.blocks is not None:
        # FSDP2: the units the engine wraps with fully_shard (plan/fsdp_units.py)
        units = plan_units(facts.params, facts.blocks, bucket_bytes=config.bucket_bytes,
                           weights=policy)
    # the units as the engine built them when given, else as planned here
    members: Sequence[Sequence[int]] | None = facts.units
    if members is None and units is not None:
        members = [u.param_indices for u in units.units]
    # buckets never straddle a unit: each unit's reduce-scatter completes its own buckets
    if facts.engine.buckets_per_unit and members is not None and facts.dp > 1:
        plan = unit_buckets(facts.params, members, bucket_bytes=config.bucket_bytes,
                            ratio=ratio, merge_small=facts.engine.merge_small_buckets)
    else:
        plan = plan_buckets(facts.params, bucket_bytes=config.bucket_bytes, ratio=ratio,
                            merge_small=facts.engine.merge_small_buckets)
    g, p, cast_notes = resolve_casting(
        config.grad_cast, config.param_cast, model_dtype=facts.model_dtype,
        device_type=facts.device_type, weights=policy, profile=facts.profile, threads=threads,
        # a bucket's parameters, as fp32 sizes them
        bucket_params=config.bucket_bytes / 4, moments=config.optimizer_state_dtype)
    notes += cast_notes
    accum, accum_notes = resolve_grad_accum(config, facts.device_type, grad_accum)
    notes += accum_notes
    if units is not None:
        units = units.with_buckets(plan)
    return Schedule(weights=policy, requested_ratio=float(config.ratio), ratio=ratio,
                    bucket_plan=plan, grad_cast=g, param_cast=p, threads=threads, dp=facts.dp,
                    notes=tuple(notes), engine=facts.engine, grad_accum_on=accum, units=units)


def specs_of(numels: Sequence[int], names: Sequence[str] | None = None) -> tuple[ParamSpec, ...]:
    """ParamSpecs of trainable parameters with ``numels`` in registration order."""
    names = list(names) if names is not None else [""] * len(numels)
    return tuple(ParamSpec(i, int(n), True, names[i]) for i, n in enumerate(numels))
