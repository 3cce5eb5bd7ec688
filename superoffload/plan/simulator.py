"""Discrete-event simulation of training iterations on the engine's lanes (DESIGN.md §3, §5).

Lanes (telemetry.events.LANES): device_compute, d2h, cpu_optimizer, h2d, device_optimizer,
storage (the storage tier's reads and write-backs, plan/sim_storage.py).
A piece of work starts when its lane is free and its inputs are ready, `end = max(lane_free,
ready) + duration`. The schedule is the one the rule book resolves (plan.schedule via
plan.techniques.resolve): the engine's bucket table of whole parameters, the effective ratio,
casting and threads. Per iteration (plan/sim_core.py):
  forward, layer by layer: a layer waits for the previous iteration's H2D of every host bucket
    that holds one of its parameters (or, with weight-flow, its fetch), and for the GPU tail
    step (paper §4.2: the first layers are tail buckets, so the forward starts at once);
  backward, layer by layer in reverse: gradients stream out at a uniform rate over a layer's
    backward; a bucket is complete when the stream passes its first-registered parameter;
  validation (global norm, inf/nan) after backward on the device (§4.3);
  offloaded buckets: [device cast] -> D2H -> CPU step -> H2D -> [device cast]; with STV the CPU
    step starts when the D2H lands, without it after validation (§4.3); the CPU lane steps them
    in the engine's order (EngineVariant.step_order: FIFO in gradient-ready order, or earliest
    deadline first) and pays `cpu_call_s` per bucket; its pass shares the host memory bus with
    both DMA directions (plan/cost.py, "host lane"); an iteration that clips rolls the
    speculated buckets back and replays them;
  tail buckets: one device step after validation, fused (28 B/param) or
    ``ENGINE_H200_MEASURED``'s unfused foreach step (118 B/param, 20 launches per bucket)
    (EngineVariant.tail_step).
"zero-offload" is DeepSpeed ZeRO-2 + offload_optimizer, modelled from its code
(plan/deepspeed.py). The bucket lanes are vectorised scans (EDF: a heap), so a 100-layer
model simulates in milliseconds; spans are materialised only when `SimResult.timeline` is read.
Data parallel (ModelShape.dp > 1; plan/parallel.py, plan/fsdp_units.py, plan/sim_fsdp.py):
what ``FsdpOffloadEngine`` runs, every quantity one rank's. FSDP2 all-gathers each unit
before its forward (a weight-flow block unit again before its backward) and reduce-scatters
it after its backward (HSDP: then all-reduces the shard across replicas); a bucket launches
when the last unit holding one of its parameters has reduced; D2H, CPU step, H2D and the
tail's device step work on this rank's shards (1/dp) on its share of the host; validation
adds one all-reduce. On gloo (a CPU device) the collectives block the training thread; on
NCCL they overlap compute (``SimResult.collective_backend`` says which). The "gpu" schedule
with data parallel is plain PyTorch's DDP: every gradient all-reduced before the step.
Steady state: 4 iterations are simulated; the period is the distance between the last two
backward ends. Clipping costs `rollback_rate x` the extra time of a clipped iteration.
Shapes whose simulation would not fit in memory are refused first (plan/size_limit.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from superoffload.config import OffloadConfig
from superoffload.plan import cost, deepspeed, parallel, sim_core, sim_fsdp, sim_walk
from superoffload.plan.grad_accum import resolve_decided
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory import check_fits, memory, offloaded_params
from superoffload.plan.memory_types import Memory
from superoffload.plan.resolved import Resolved
from superoffload.plan.shapes import ModelShape
from superoffload.plan.techniques import Techniques
from superoffload.plan.weights import FLOW_MIN_EFFICIENCY, WeightChoice, fmt_gb
from superoffload.telemetry import events as ev

__all__ = ["N_ITER", "LaneStats", "SimResult", "simulate"]

N_ITER = 4


@dataclass(frozen=True, slots=True)
class LaneStats:
    busy_s: float
    idle_s: float

    @property
    def utilization(self) -> float:
        total = self.busy_s + self.idle_s
        return self.busy_s / total if total > 0 else 0.0


@dataclass
class SimResult:
    """What one simulation predicts. Times in seconds, memory in bytes."""

    iteration_s: float
    """Expected steady-state iteration time, clipping/rollback included."""
    steady_iteration_s: float
    """Steady-state iteration time without clipping."""
    rollback_penalty_s: float
    """Extra time of one iteration that clips and rolls back (paid rollback_rate of the time)."""
    tflops: float
    """Executed FLOP/s (recompute included, Megatron-style) / 1e12."""
    model_tflops: float
    """Useful FLOP/s (6 N tokens + attention, no recompute) / 1e12."""
    lanes: dict[str, LaneStats]
    """Busy and idle time per lane over one steady-state iteration."""
    memory: dict[str, float]
    """Bytes on the device and on the host."""
    memory_detail: Memory
    problems: list[str]
    """Why the run would not fit in memory (empty when it fits)."""
    plan: Resolved
    shape: ModelShape
    profile: str
    window: tuple[float, float]
    """The steady-state iteration's [start, end) on the timeline."""
    collective_s: float = 0.0
    """Per-rank seconds of the collectives of one iteration (0 at dp=1): FSDP2's all-gathers,
    reduce-scatters and HSDP all-reduces, and the validation all-reduce."""
    collective_backend: str = ""
    """With data parallel: "gloo" (collectives block the training thread: a CPU device) or
    "nccl" (they overlap compute on their own streams); "" at dp=1."""
    accumulation_s: float = 0.0
    """Seconds of the grad_accum_steps - 1 micro-steps of one optimizer step that only
    accumulate (0 without accumulation): their forward and backward, and accumulating on the
    host the gradients' D2H and host add (plan/sim_core.accumulation_micro_step_s)."""
    _chunks: list[tuple[str, str, Any, Any, int, Any, Any]] = field(default_factory=list,
                                                                    repr=False)
    _timeline: list[ev.Span] | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def optimizer_step_s(self) -> float:
        """Expected seconds of one optimizer step: ``iteration_s`` (the micro-step that
        steps) plus the micro-steps that only accumulate."""
        return self.iteration_s + self.accumulation_s

    @property
    def timeline(self) -> list[ev.Span]:
        """Every simulated span (all iterations), the engine's telemetry type, sorted by start."""
        if self._timeline is None:
            spans: list[ev.Span] = []
            for lane, kind, starts, ends, it, buckets, nbytes in self._chunks:
                n = len(starts)
                # a chunk without buckets (compute, waits) marks its spans with bucket -1
                b = np.asarray(buckets).tolist() if buckets is not None else [-1] * n
                if isinstance(nbytes, (list, np.ndarray)):
                    nb = np.asarray(nbytes).tolist()
                else:
                    # one byte count for every span of the chunk
                    nb = [int(nbytes)] * n
                spans.extend(
                    ev.Span(lane, kind, s, e, it, bk, x)
                    for s, e, bk, x in zip(np.asarray(starts, float).tolist(),
                                           np.asarray(ends, float).tolist(), b, nb)
                )
            spans.sort(key=lambda s: (s.start_s, s.lane))
            self._timeline = spans
        return self._timeline

    @property
    def n_spans(self) -> int:
        return sum(len(c[2]) for c in self._chunks)

    def summary(self) -> dict[str, Any]:
        """JSON-safe numbers (for --json and widgets)."""
        return {
            "profile": self.profile,
            "system": self.plan.system,
            "params": self.shape.params,
            "iteration_s": self.iteration_s,
            "steady_iteration_s": self.steady_iteration_s,
            "rollback_penalty_s": self.rollback_penalty_s,
            "tflops": self.tflops,
            "model_tflops": self.model_tflops,
            "lanes": {k: {"busy_s": v.busy_s, "idle_s": v.idle_s, "utilization": v.utilization}
                      for k, v in self.lanes.items()},
            "memory": dict(self.memory),
            "fits": self.fits,
            "problems": list(self.problems),
            "plan": self.plan.as_dict(),
            "dp": self.shape.dp,
            "ranks_per_host": self.shape.ranks_per_host,
            "collective_s": self.collective_s,
            "collective_backend": self.collective_backend,
            "dp_replicate": self.shape.dp_replicate,
            "accumulation_s": self.accumulation_s,
            "optimizer_step_s": self.optimizer_step_s,
            "device_kept_bytes": self.memory_detail.device_kept,
        }


def simulate(shape: ModelShape, prof: HardwareProfile, system: str = "superoffload",
             config: OffloadConfig | None = None,
             techniques: Techniques | None = None) -> SimResult:
    """Predict the steady-state iteration of `shape` on `prof` running `system` (one of
    ``plan.SYSTEMS``; see the module docstring)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"simulate: shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(prof, HardwareProfile):
        raise TypeError(f"simulate: prof must be a HardwareProfile, got {type(prof).__name__}")
    # this rank's share of the host
    prof = parallel.rank_profile(prof, shape.ranks_per_host)
    auto = None
    if system == "superoffload" and config is not None and config.weights == "auto" and (
            techniques is None or techniques.adaptive_weights):
        # the engine's rule (plan/weights.py)
        auto = choose_weights(shape, prof, config)
    plan = resolve_decided(shape, prof, system, config, techniques, auto=auto)
    lay = None
    if plan.system != "zero-offload":
        # DeepSpeed's schedule has its own timeline (plan/deepspeed.py): no bucket layout
        lay = sim_walk.layout(shape, plan)
    ends, chunks = _run(shape, prof, plan, N_ITER, None, lay)
    # the last iteration is the steady state: the pipeline has filled by then
    period = float(ends[-1] - ends[-2])
    penalty = 0.0
    if plan.speculate and plan.rollback_rate > 0 and offloaded_params(shape, plan) > 0:
        # one clipped iteration (index N_ITER-2); its cost shows in the next backward end
        ends_c, _ = _run(shape, prof, plan, N_ITER, N_ITER - 2, lay)
        penalty = max(0.0, float(ends_c[-1] - ends_c[-3]) - 2 * period)
    # the expected iteration: a rollback costs its penalty at the rate clipping happens
    expected = period + plan.rollback_rate * penalty
    window = (float(ends[-2]), float(ends[-1]))
    lanes = _lane_stats(chunks, window)
    mem = memory(shape, prof, plan)
    accumulation = 0.0
    if plan.system != "zero-offload" and plan.grad_accum_steps > 1:
        # every micro-step but the last only accumulates; the last is the simulated iteration
        accumulation = (plan.grad_accum_steps - 1) * sim_core.accumulation_micro_step_s(
            shape, prof, plan, lay)
    # one rank runs no collectives: no backend to name
    backend = parallel.collective_backend(prof) if shape.dp * shape.dp_replicate > 1 else ""
    return SimResult(
        iteration_s=expected,
        steady_iteration_s=period,
        rollback_penalty_s=penalty,
        tflops=shape.executed_flops / expected / 1e12,
        model_tflops=shape.model_flops / expected / 1e12,
        lanes=lanes,
        memory=mem.as_dict(),
        memory_detail=mem,
        problems=check_fits(mem, prof),
        plan=plan,
        shape=shape,
        profile=prof.name,
        window=window,
        collective_s=_collective_s(shape, prof, plan, lay),
        collective_backend=backend,
        accumulation_s=accumulation,
        _chunks=chunks,
    )


def _collective_s(shape: ModelShape, prof: HardwareProfile, plan: Resolved,
                  lay: sim_walk.Layout | None) -> float:
    """Per-rank collective seconds of one iteration: the busy time the lanes carry for them."""
    if shape.dp * shape.dp_replicate == 1:
        return 0.0
    if plan.system == "zero-offload" or lay is None:
        return deepspeed.zero2_collective_s(shape, prof, plan)
    if plan.units is not None:  # FSDP2 (plan/sim_fsdp.py)
        return sim_fsdp.fsdp_layout(shape, prof, plan, len(lay.numel)).iteration_collective_s
    return float(sum(sim_core.ddp_collectives(shape, prof, plan, lay)))


def _lane_stats(chunks: list, window: tuple[float, float]) -> dict[str, LaneStats]:
    w0, w1 = window
    busy = dict.fromkeys(ev.LANES, 0.0)
    for lane, kind, starts, ends, *_ in chunks:
        if kind == ev.KIND_WAIT or len(starts) == 0:
            continue
        s = np.clip(np.asarray(starts, float), w0, w1)
        e = np.clip(np.asarray(ends, float), w0, w1)
        busy[lane] += float(np.sum(e - s))
    return {k: LaneStats(v, max(0.0, (w1 - w0) - v)) for k, v in busy.items()}


def _run(shape: ModelShape, prof: HardwareProfile, plan: Resolved, n_iter: int,
         clipped_iter: int | None, lay: sim_walk.Layout | None = None
         ) -> tuple[list[float], list]:
    """The iterations of `plan`'s schedule: DeepSpeed's for "zero-offload", ours otherwise."""
    if plan.system == "zero-offload":
        return deepspeed.zero2_run(shape, prof, plan, n_iter)
    return sim_core.run_timeline(shape, prof, plan, n_iter, clipped_iter, lay)


def choose_weights(shape: ModelShape, prof: HardwareProfile, config: OffloadConfig | None = None,
                   *, device_memory_bytes: float | None = None) -> WeightChoice:
    """Pick the weight policy for ``shape`` on ``prof`` (see the module docstring)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"choose_weights: shape must be a ModelShape, got {type(shape).__name__}")
    if device_memory_bytes is not None:
        if device_memory_bytes <= 0:
            raise ValueError(
                f"device_memory_bytes={device_memory_bytes}: use a positive byte count")
        prof = prof.replace(device_memory_bytes=float(device_memory_bytes))
    base = (config or OffloadConfig()).replace(weights="stationary", extra={})
    stat: SimResult = simulate(shape, prof, "superoffload", base)
    # the rule book runs weight-flow with every bucket on the host, weights cast on the host
    flow: SimResult = simulate(shape, prof, "superoffload", base.replace(weights="flow"))
    eff = cost.weight_flow_efficiency(shape, prof)
    act = shape.activation_bytes()
    parts = stat.memory_detail.device_parts
    resident = parts.get("weights", 0.0) + parts.get("grads", 0.0)
    numbers = (f"predicted {stat.iteration_s * 1e3:.3g} ms (stationary) vs "
               f"{flow.iteration_s * 1e3:.3g} ms (flow); device memory "
               f"{fmt_gb(stat.memory['device'])} vs {fmt_gb(flow.memory['device'])} of "
               f"{fmt_gb(prof.device_memory_bytes)}; activations {fmt_gb(act)}; weight-flow "
               f"efficiency {eff:.3f}")
    if stat.fits and not flow.fits:
        policy, why = "stationary", "weight-flow does not fit: " + "; ".join(flow.problems)
    elif flow.fits and not stat.fits:
        policy, why = "flow", "weight-stationary does not fit: " + "; ".join(stat.problems)
    elif not flow.fits:
        policy, why = "flow", ("neither policy fits; weight-flow needs the least device memory: "
                               + "; ".join(flow.problems))
    elif eff >= FLOW_MIN_EFFICIENCY and act > resident:
        policy, why = "flow", (f"both fit; the fetch hides behind compute (efficiency {eff:.3f} "
                               f">= {FLOW_MIN_EFFICIENCY}) and activations ({fmt_gb(act)}) "
                               f"outweigh the resident weights + gradients ({fmt_gb(resident)})")
    else:
        # name the first condition that failed: the efficiency, else the activations
        if eff < FLOW_MIN_EFFICIENCY:
            cause = f"efficiency {eff:.3f} < {FLOW_MIN_EFFICIENCY}"
        else:
            cause = (f"activations ({fmt_gb(act)}) do not outweigh the resident weights + "
                     f"gradients ({fmt_gb(resident)})")
        policy, why = "stationary", f"both fit and weight-flow would gain nothing: {cause}"
    return WeightChoice(
        policy=policy, reason=f"weights={policy}: {why}; {numbers}", efficiency=eff,
        stationary_s=stat.iteration_s, flow_s=flow.iteration_s,
        stationary_device_bytes=stat.memory["device"], flow_device_bytes=flow.memory["device"],
        activation_bytes=act, device_memory_bytes=prof.device_memory_bytes,
    )
