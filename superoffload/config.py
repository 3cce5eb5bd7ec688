"""Typed configuration of the offload engine, validated once.

`OffloadConfig` is the one place every knob of the engine is named, documented and checked.
DeepSpeed-style dicts are accepted at the edge (`superoffload.ds_config.from_deepspeed`) and
converted into this dataclass once; nothing downstream re-validates.

Paper references (SuperOffload, Lian et al., ASPLOS 2026, arXiv 2509.21271):
  bucket_bytes   -- §4.2 bucketization repartitioning (~64 MB saturates NVLink-C2C)
  ratio          -- §4.2 GPU tail buckets ("ratio" of buckets offloaded to the CPU)
  speculation    -- §4.3 speculation-then-validation (STV)
  grad_cast / param_cast -- §4.4 Superchip-aware casting
  weights        -- §4.5 adaptive weight offloading (stationary vs flow)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

MiB = 1 << 20

MIN_WATCHDOG_S = 0.1
"""Below this every bucket would time out: a watchdog is a bound on a stuck lane, not a
deadline for normal work."""

MIN_BUCKET_BYTES = 4096
"""The one lower bound of ``bucket_bytes`` (config, planner, command line): 1024 fp32
gradients. Smaller buckets only add per-bucket overhead (paper §4.2 uses 64 MiB)."""

Speculation = Literal["on", "off", "adaptive"]
RollbackMode = Literal["auto", "inverse", "snapshot"]
CastSide = Literal["device", "host", "auto"]
WeightPolicy = Literal["stationary", "flow", "auto"]
LossScale = Literal["dynamic", "none"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
StepOrder = Literal["deadline", "fifo"]
StateDtype = Literal["fp32", "bf16"]
GradAccumOn = Literal["auto", "device", "host"]
Direct = Literal["auto", "on", "off"]
WeightHomes = Literal["auto", "host", "storage"]
Live = Literal["live", "replan", "forward"]
"""How ``engine.reconfigure`` applies a field: "live" (next iteration boundary), "replan"
(the buckets are rebuilt first) or "forward" (where the next forward starts: weight policy)."""


Kind = Literal["int", "real", "bool", "str", "dict", "choice"]


@dataclass(frozen=True, slots=True)
class Bound:
    """What values a field takes, declared once on the field: ``OffloadConfig.validate`` and
    the surface test (tests/test_surface.py) read it. A "choice" field's members are its
    ``Literal`` (``choices_of``); the others' kind and range are here."""

    kind: Kind
    lo: float | None = None
    lo_open: bool = False
    """True: ``lo`` itself is outside (a value must exceed it)."""
    hi: float | None = None
    none_ok: bool = False
    """None is a valid value (e.g. ``cpu_threads=None``: derive it)."""
    test: Callable[[Any], bool] | None = None
    """A further condition (``device``'s "cuda:N" form)."""
    fix: str = ""
    """What to use instead, in the error message."""

    def admits(self, value: Any, choices: tuple[Any, ...] = ()) -> bool:
        if value is None:
            return self.none_ok
        kinds: dict[str, Callable[[Any], bool]] = {
            "int": _is_int, "real": _is_real, "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str), "dict": lambda v: isinstance(v, dict),
            "choice": lambda v: v in choices}
        if not kinds[self.kind](value):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return ((self.hi is None or value <= self.hi)
                and (self.test is None or bool(self.test(value))))


CHOICE = Bound("choice")
"""A field whose values are the members of its ``Literal`` type."""
WHOLE_GE_1 = Bound("int", lo=1, fix="use a whole number >= 1")
BOOL = Bound("bool", fix="use True or False")


def _field(default: Any = dataclasses.MISSING, *, bound: Bound, numerics: bool = False,
           live: Live | None = None, tuned: bool = False,
           factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its roles declared once (the lists below are derived from them).

    bound: the values it takes (``Bound``); ``validate`` is a loop over these.
    numerics: a checkpoint written under another value is refused (it changes the maths);
        every other field only places or schedules work and may differ on load.
    live: whether and how ``engine.reconfigure`` may change it while training.
    tuned: the tuner widget has a control for it.
    """
    meta = {"numerics": numerics, "live": live, "tuned": tuned, "bound": bound}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """An invalid configuration value. The message names the field and the fix."""


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Every setting of the offload engine. Construct, then call `validate()` (done by
    `superoffload.initialize`); `replace(**changes)` returns a validated copy."""

    device: str = _field("auto", bound=Bound(
        "str", test=lambda v: v in ("auto", "cpu", "cuda") or v.startswith("cuda:"),
        fix='use "auto", "cpu", "cuda" or "cuda:N"'))
    """Where forward/backward run: "auto" (CUDA when available, else CPU), "cpu", "cuda",
    "cuda:N"."""

    bucket_bytes: int = _field(64 * MiB, live="replan", tuned=True, bound=Bound(
        "int", lo=MIN_BUCKET_BYTES,
        fix=f"use a whole number of bytes >= {MIN_BUCKET_BYTES} (the paper uses 64 MiB)"))
    """Gradient bucket size in bytes of fp32 gradient (4 B/param). Paper §4.2: ~64 MB
    saturates C2C."""

    ratio: float = _field(0.9, live="replan", tuned=True, bound=Bound(
        "real", lo=0.0, hi=1.0,
        fix="use a fraction in [0, 1]: 1 offloads every bucket, 0 keeps all on the device"))
    """Fraction of the gradient work (by bytes) offloaded to the CPU. The remaining 1-ratio are the
    buckets produced last in backward (first layers), stepped on the device (paper §4.2)."""

    max_grad_norm: float | None = _field(None, numerics=True, live="live", bound=Bound(
        "real", lo=0.0, none_ok=True, fix="use a positive number, or None/0 to disable clipping"))
    """Global gradient-norm clipping threshold; None or 0 disables clipping."""

    speculation: Speculation = _field("on", live="live", tuned=True, bound=CHOICE)
    """STV mode (paper §4.3): "on" steps CPU buckets before validation and rolls back on clip or
    overflow; "off" steps after validation (ZeRO-Offload-like); "adaptive" stops speculating while
    clipping fires often and resumes when it calms down."""

    rollback: RollbackMode = _field("auto", live="live", bound=CHOICE)
    """How speculative steps are undone: "auto" (the algebraic inverse where its error bound is
    below 1e-6 of an update, exact copies of the few elements beyond it, and no speculation for a
    bucket certain to clip: matches AdamW + clipping to ~1e-7; runtime/auto_rollback.py),
    "inverse" (unguarded: a few ulps only while the rejected gradient does not dwarf the moments'
    history, docs/engine.md) or "snapshot" (bit-exact, keeps pre-step p, m, v: 12 B/param)."""

    adaptive_window: int = _field(20, live="live", bound=Bound(
        "int", lo=1, fix="use a whole number of iterations >= 1"))
    """Adaptive STV: number of recent iterations over which the clipping rate is measured."""

    adaptive_threshold: float = _field(0.25, live="live", bound=Bound(
        "real", lo=0.0, lo_open=True, hi=1.0, fix="use a fraction in (0, 1]"))
    """Adaptive STV: stop speculating when more than this fraction of the window clipped."""

    grad_cast: CastSide = _field("auto", live="replan", tuned=True, bound=CHOICE)
    """D2H direction for low-precision models: "device" casts bf16->fp32 on the device and moves
    fp32; "host" moves bf16 and casts inside the CPU kernel's pass; "auto" asks the cost model."""

    param_cast: CastSide = _field("auto", live="replan", tuned=True, bound=CHOICE)
    """H2D direction: "host" writes the bf16 copy in the CPU kernel's pass and moves bf16;
    "device" moves fp32 and casts on the device; "auto" asks the cost model."""

    loss_scale: LossScale = _field("dynamic", numerics=True, bound=CHOICE)
    """fp16 only: "dynamic" loss scaling (DeepSpeed semantics) or "none". Ignored for bf16/fp32."""

    initial_scale_power: int = _field(16, numerics=True, bound=Bound(
        "int", lo=0, hi=64, fix="use a whole number in [0, 64] (DeepSpeed's default is 16)"))
    """fp16 dynamic loss scaling: the first scale is 2**initial_scale_power."""

    loss_scale_window: int = _field(1000, numerics=True, bound=WHOLE_GE_1)
    """fp16: grow the scale by 2 after this many overflow-free iterations."""

    hysteresis: int = _field(2, numerics=True, bound=WHOLE_GE_1)
    """fp16: overflows tolerated before the scale is shrunk."""

    min_loss_scale: float = _field(1.0, numerics=True, bound=Bound(
        "real", lo=0.0, lo_open=True, fix="use a positive number"))
    """fp16: the scale never drops below this."""

    static_loss_scale: float = _field(1.0, numerics=True, bound=Bound(
        "real", lo=0.0, lo_open=True, fix="use a positive number (1.0 means no scaling)"))
    """fp16 with loss_scale="none": the fixed loss scale (DeepSpeed `fp16.loss_scale` > 0)."""

    grad_accum_steps: int = _field(1, numerics=True, bound=WHOLE_GE_1)
    """Micro-steps per optimizer step; buckets are offloaded on the last micro-step only."""

    grad_accum_on: GradAccumOn = _field("auto", bound=CHOICE)
    """Where the gradients of offloaded buckets accumulate over ``grad_accum_steps`` > 1:
    "device" (they stay on the device until the last micro-step: the offloaded buckets' full
    gradients are resident, one D2H per optimizer step), "host" (each micro-step's gradients
    leave with their bucket and are summed into the host's fp32 gradient buffer, as
    ZeRO-Offload does: one D2H per micro-step, only ``grad_buckets_in_flight`` buckets
    resident) or "auto" (the cost model picks: ``plan.grad_accum.choose_grad_accum``)."""

    grad_buckets_in_flight: int = _field(2, live="live", bound=Bound(
        "int", lo=1,
        fix="use a whole number of buckets >= 1 (2 overlaps one copy with the next bucket)"))
    """Offloaded buckets whose gradients may be on the device at once after their last
    gradient is final and before their D2H copy has landed (backward waits for the oldest
    copy beyond it). With the bucket backward is filling, the device holds at most
    ``grad_buckets_in_flight + 1`` offloaded buckets' gradients; the planner charges the same."""

    keep_device_grads: bool = _field(False, bound=BOOL)
    """Keep the device gradients of offloaded buckets after they left (``p.grad`` stays set
    until ``zero_grad()``, as in a plain torch loop; the planner then charges them). Default:
    freed once their D2H copy has landed, so ``p.grad`` is None after ``backward()`` (as under
    DeepSpeed ZeRO-2); read them with ``engine.grad_norm()`` and ``engine.full_grad(p)``."""

    cpu_threads: int | None = _field(None, live="live", tuned=True, bound=Bound(
        "int", lo=1, none_ok=True,
        fix="use a whole number >= 1, or None to derive it from cpu_cores_frac"))
    """Threads of the CPU optimizer; None derives them from `cpu_cores_frac`."""

    cpu_cores_frac: float = _field(0.9, live="live", bound=Bound(
        "real", lo=0.0, lo_open=True, hi=1.0,
        fix="use a fraction in (0, 1] (DeepSpeed's cpuadam_cores_perc)"))
    """Share of the host's cores given to the CPU optimizer (DeepSpeed `cpuadam_cores_perc`)."""

    pin_memory: bool = _field(True, bound=BOOL)
    """Use pinned (page-locked) host buffers for transfers (CUDA only; ignored on the CPU)."""

    storage_path: str | None = _field(None, bound=Bound(
        "str", none_ok=True, test=lambda v: v.strip() != "",
        fix="use the path of a folder on a local disk (NVMe), or None to keep the optimizer "
            "state in host memory"))
    """The storage tier (docs/storage.md; DeepSpeed's ``offload_optimizer.nvme_path``): a folder
    where the fp32 master and Adam moments of offloaded buckets live in files, streamed through
    ``storage_buffer_count`` pinned host buffers (read ahead in the order backward finishes
    buckets, stepped, written back). None keeps all optimizer state in host memory."""

    host_memory_budget_bytes: int | None = _field(None, bound=Bound(
        "int", lo=1, none_ok=True, fix="use a whole number of bytes, or None for no cap"))
    """A cap on the host memory the engine keeps (pinned buffer pool, gradient buffers in
    flight, resident optimizer state; plan/storage.py). With ``storage_path`` the buckets that
    fit stay resident (those backward finishes last) and the rest live in files; without it, a
    model whose state exceeds the budget is refused at ``initialize`` naming what it needs."""

    storage_buffer_count: int = _field(4, bound=Bound(
        "int", lo=1, hi=4096,
        fix="use a whole number of buckets in [1, 4096] (each buffer holds one bucket's master, "
            "moments and gradient)"))
    """Pinned host buffers of the storage tier, one bucket's working set each (DeepSpeed's
    ``buffer_count`` counts one state tensor per buffer: its value / 4 for Adam)."""

    storage_block_bytes: int = _field(1 * MiB, bound=Bound(
        "int", lo=4096, hi=1 << 30, test=lambda v: v % 4096 == 0,
        fix="use a multiple of 4096 bytes in [4096, 1 GiB] (DeepSpeed's aio.block_size; 1 MiB "
            "by default)"))
    """Size of one I/O request of the storage tier (DeepSpeed's ``aio.block_size``)."""

    storage_queue_depth: int = _field(32, bound=Bound(
        "int", lo=1, hi=4096, fix="use a whole number in [1, 4096] (DeepSpeed's aio.queue_depth)"))
    """I/O requests of the storage tier in flight at once (DeepSpeed's ``aio.queue_depth``)."""

    storage_threads: int = _field(1, bound=Bound(
        "int", lo=1, hi=64, fix="use a whole number in [1, 64] (DeepSpeed's aio.thread_count)"))
    """Threads submitting the storage tier's I/O in parallel (DeepSpeed's ``aio.thread_count``)."""

    storage_direct: Direct = _field("auto", bound=CHOICE)
    """O_DIRECT for the storage tier's files: "auto" (where the file system allows it, else
    buffered I/O, said once), "on" (required: an error where it is not allowed) or "off"."""

    optimizer_state_dtype: StateDtype = _field("fp32", numerics=True, bound=CHOICE)
    """Adam moments of the offloaded buckets on the host: "fp32" (28 B/param moved by the CPU
    step) or "bf16" with stochastic rounding (20 B/param, 4 B/param less host memory;
    DeepSpeed's ``fp32_optimizer_states=False``). It pays where the step is memory-bound and
    the kernel's bf16 pass keeps up (docs/planner.md: ``tune --allow-bf16-moments``). The fp32
    master stays fp32; GPU tail buckets keep fp32 moments. Accuracy: docs/kernel.md."""

    step_order: StepOrder = _field("deadline", live="live", bound=CHOICE)
    """Order of the CPU steps and H2D copies of the buckets ready at once: "deadline" (the
    bucket the next forward needs first goes first: earliest deadline first, DESIGN.md §6)
    or "fifo" (gradient-ready order, the order backward produced them)."""

    weights: WeightPolicy = _field("stationary", live="forward", tuned=True, bound=CHOICE)
    """Weight policy (paper §4.5): bf16 weights stay on the device ("stationary"), stream in per
    block from the host ("flow"), or the cost model chooses ("auto")."""

    prefetch_depth: int = _field(2, live="forward", bound=Bound(
        "int", lo=1, fix="use a whole number of blocks >= 1"))
    """Weight-flow: blocks fetched ahead of the one running."""

    weight_homes: WeightHomes = _field("auto", bound=CHOICE)
    """Weight-flow with a storage tier: where the tier's buckets keep the weights the blocks
    stream from, their *homes* (docs/storage.md, "Weights on the tier"; DeepSpeed's
    ``offload_param.device``): "host" (host memory, 2 B/param), "storage" (in the tier's files
    with the optimizer state, read ahead of forward and backward through ``prefetch_depth + 1``
    pinned staging buffers) or "auto" (storage only when ``host_memory_budget_bytes`` cannot
    hold them). An fp32 model's home is its master, in the files. "storage" needs
    ``storage_path``."""

    watchdog_s: float = _field(300.0, live="live", bound=Bound(
        "real", lo=MIN_WATCHDOG_S,
        fix=f"use a number of seconds >= {MIN_WATCHDOG_S} (a bucket's transfer and step take "
            "longer than that; the default is 300)"))
    """A bucket stuck in flight longer than this raises an error naming it instead of hanging."""

    telemetry: bool = _field(True, bound=BOOL)
    """Record timeline spans (cheap; bounded memory)."""

    telemetry_max_events: int = _field(200_000, bound=WHOLE_GE_1)
    """Ring-buffer capacity of the telemetry recorder."""

    seed: int = _field(0, numerics=True, bound=Bound("int", fix="use a whole number"))
    """Seed for stochastic rounding and anything else the engine randomises."""

    precision: Precision = _field("auto", bound=CHOICE)
    """The training precision the trainable parameters must have: "auto" takes the model's;
    "fp32" / "bf16" / "fp16" are checked when the engine is built (a DeepSpeed dict's
    ``bf16.enabled`` / ``fp16.enabled`` set it). Checkpoints carry the dtypes themselves."""

    extra: dict[str, Any] = _field(factory=dict, bound=Bound("dict", fix="use a dict"))
    """Free-form notes carried along (e.g. the tuner's explanation); never read by the engine."""

    def validate(self) -> OffloadConfig:
        """Check every field against its declared ``Bound`` (and a choice field against its
        ``Literal``); raise `ConfigError` naming the first invalid field and the fix."""
        for f in dataclasses.fields(self):
            value, bound = getattr(self, f.name), f.metadata["bound"]
            choices = CHOICES.get(f.name, ())
            if not bound.admits(value, choices):
                fix = bound.fix
                # a choice's members live in its Literal (CHOICES), not in a hand-written fix
                if bound.kind == "choice":
                    fix = "use one of " + ", ".join(repr(c) for c in choices)
                raise ConfigError(f"OffloadConfig.{f.name}={value!r} is invalid: {fix}")
        return self

    def replace(self, **changes: Any) -> OffloadConfig:
        """A validated copy with `changes` applied (unknown names raise ConfigError)."""
        names = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in names:
                raise ConfigError(f"OffloadConfig has no field {key!r}; known fields: "
                                  f"{', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON-safe) used in checkpoints and telemetry."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OffloadConfig:
        """Inverse of `to_dict`; unknown keys are errors that name the key."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown OffloadConfig key(s) {unknown}; known fields: "
                              f"{', '.join(sorted(names))}")
        return cls(**data).validate()

    @property
    def clipping(self) -> bool:
        """True when gradient clipping is configured."""
        return bool(self.max_grad_norm)


def _is_int(value: Any) -> bool:
    # bool is an int subclass: True is not a count of anything
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    # bool is an int subclass: True would pass as 1.0; NaN and inf pass every range test
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _with(predicate: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(OffloadConfig) if predicate(f.metadata))


NUMERICS_FIELDS: frozenset[str] = _with(lambda m: m.get("numerics", False))
"""Fields a checkpoint must agree on (derived from the field declarations)."""
RECONFIGURABLE: frozenset[str] = _with(lambda m: m.get("live") is not None)
"""Fields ``engine.reconfigure`` accepts while training."""
REPLAN_FIELDS: frozenset[str] = _with(lambda m: m.get("live") == "replan")
"""Fields whose change rebuilds the buckets."""
FORWARD_FIELDS: frozenset[str] = _with(lambda m: m.get("live") == "forward")
"""Fields applied where the next forward starts (the weight policy)."""
TUNED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(OffloadConfig) if f.metadata.get("tuned", False))
"""Fields the tuner widget has a control for, in declaration order."""

CHOICES: dict[str, tuple[Any, ...]] = {
    name: get_args(hint) for name, hint in get_type_hints(OffloadConfig).items()
    if get_origin(hint) is Literal}
"""Every choice field's members, in its ``Literal``'s order (the one declaration)."""


def choices_of(name: str, *, decided: bool = False) -> tuple[Any, ...]:
    """The members of choice field ``name`` (``decided``: without "auto", what "auto"
    resolves to): argparse ``choices=``, the tuner's options and the planner's candidates
    read them here instead of typing them again."""
    members = CHOICES[name]
    return tuple(m for m in members if m != "auto") if decided else members
