"""Will it fit, and at which setting? The memory search behind ``tune``, ``fit_problems`` and
``max_model_size``.

A setting fits when both memories hold what it keeps (plan/memory.py). The settings trade one
side for the other:

* ``ratio`` moves whole buckets (the rule book's table, plan/buckets.py) from the device to
  the host: an offloaded parameter's tail state (12 B) and resident gradient (2 B) leave the
  device and 16 B (+ the 2 B pinned bf16 copy, + a snapshot) arrive on the host. With both
  casts on the host (no fp32 staging on the device) host bytes never fall and device bytes
  never rise as the ratio grows (the gradients in flight, 3 x 2 B per element of the largest
  host bucket, grow by no more than the 14 B/param a bucket frees; with data parallel both
  are per rank, 1/dp, and FSDP2's unsharded weights and gradients do not depend on the
  ratio). So of the ratios whose host side fits --
  a prefix of the buckets, found by bisection on the bucket count -- the largest is the
  device's best chance: when the device does not fit there, no ratio fits. (With a device
  cast fixed by the caller the device side may rise by up to 8 B/param of staging per
  direction: then every smaller prefix is checked too.) The old search tried ratio 1 only:
  right when the device binds, wrong when the host does (Llama-3-8B at seq 4096 on
  h200-pcie-measured fits at ratio 0.3).
* weight-flow (ratio 1 by the rule book) keeps a few blocks of weights on the device: the most
  device-frugal setting and the most host-hungry one.
* bf16 moments (4 B/param less host memory) change the maths: tried only when the caller
  allows them (``dtypes``).
* the other knobs take their frugal values unless fixed: the smallest bucket (staging and
  reduce buffers scale with the largest bucket), both casts on the host, inverse rollback
  (no 12 B/param snapshot), one weight-flow block fetched ahead.

``tests/test_plan_feasible.py`` checks the verdicts against a dense grid of settings.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import accumulate

from superoffload.config import OffloadConfig
from superoffload.plan.grad_accum import resolve_decided
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory import check_fits, fit_sides, memory
from superoffload.plan.memory_types import Memory
from superoffload.plan.parallel import rank_profile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.techniques import Techniques, resolve

FRUGAL = {"rollback": "inverse", "grad_cast": "host", "param_cast": "host", "prefetch_depth": 1}
"""The memory-frugal value of each knob that only costs memory (module docstring)."""


@dataclass(frozen=True, slots=True)
class Feasibility:
    """The answer of ``search``."""

    config: OffloadConfig | None
    """A setting that fits (None: none does): stationary weights at the largest ratio whose
    host side fits, else weight-flow."""
    ratio_window: tuple[float, float] | None
    """(lowest, highest) ratio at which stationary weights fit both sides; None when no ratio
    does (or the ratio is fixed)."""
    problems: tuple[str, ...] = ()
    """Why nothing fits, per policy tried (empty when something fits)."""

    @property
    def fits(self) -> bool:
        return self.config is not None


def search(shape: ModelShape, prof: HardwareProfile, base: OffloadConfig, *,
           fixed: Collection[str] = (), bucket_bytes: int | None = None,
           dtypes: Sequence[str] = ("fp32",), techniques: Techniques | None = None
           ) -> Feasibility:
    """A setting of ``base`` that fits ``prof`` (per rank), searching the fields not in
    ``fixed``: the weight policy, the ratio, the moments' dtype among ``dtypes`` (in order),
    and the frugal values of ``FRUGAL`` and of ``bucket_bytes`` (the smallest allowed)."""
    rprof = rank_profile(prof, shape.ranks_per_host)
    frugal = {k: v for k, v in FRUGAL.items() if k not in fixed}
    if bucket_bytes is not None and "bucket_bytes" not in fixed:
        frugal["bucket_bytes"] = bucket_bytes
    if "optimizer_state_dtype" in fixed:
        dtypes = (base.optimizer_state_dtype,)
    problems: list[str] = []
    for dtype in dtypes:
        cfg = base.replace(**frugal, optimizer_state_dtype=dtype)
        tag = "" if len(dtypes) == 1 else f" ({dtype} moments)"
        if "weights" not in fixed or base.weights == "stationary":
            found = _stationary(shape, rprof, cfg.replace(weights="stationary"),
                                "ratio" in fixed, techniques)
            if found.fits:
                return found
            problems += [p + tag for p in found.problems]
        if "weights" not in fixed or base.weights == "flow":
            flow = cfg.replace(weights="flow")
            why = check_fits(_memory(shape, rprof, flow, techniques), rprof)
            if not why:
                return Feasibility(flow, None)
            problems.append(f"weight-flow{tag}: " + "; ".join(why))
    return Feasibility(None, None, tuple(problems))


def _memory(shape: ModelShape, prof: HardwareProfile, cfg: OffloadConfig,
            techniques: Techniques | None) -> Memory:
    return memory(shape, prof, resolve_decided(shape, prof, "superoffload", cfg, techniques))


def _stationary(shape: ModelShape, prof: HardwareProfile, cfg: OffloadConfig,
                ratio_fixed: bool, techniques: Techniques | None) -> Feasibility:
    """Stationary weights: the largest host-fitting prefix of buckets (bisection), then the
    device there (module docstring)."""
    if ratio_fixed:
        why = check_fits(_memory(shape, prof, cfg, techniques), prof)
        if why:
            return Feasibility(None, None, (f"stationary weights at ratio {cfg.ratio:g}: "
                                            + "; ".join(why),))
        return Feasibility(cfg, (cfg.ratio, cfg.ratio))
    whole = resolve(shape, prof, "superoffload", cfg.replace(ratio=1.0), techniques)
    cum = [0, *accumulate(b.numel for b in whole.bucket_plan.buckets)]
    total = cum[-1] or 1

    def ratio_of(k: int) -> float:
        return cum[k] / total  # exactly k buckets: plan_buckets offloads the closest prefix

    @cache  # the bisections and the checks around them revisit 0, n and the top prefix
    def sides(k: int) -> tuple[bool, bool]:
        return fit_sides(_memory(shape, prof, cfg.replace(ratio=ratio_of(k)), techniques), prof)

    n = len(cum) - 1
    if not sides(0)[1]:  # pragma: no cover - nothing offloaded puts nothing on the host
        return Feasibility(None, None, ("stationary weights: the host does not fit even at "
                                        "ratio 0",))
    # host fits at lo; find the largest such k (more offloaded = more host memory: monotone)
    lo, hi = 0, n
    if not sides(n)[1]:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if sides(mid)[1]:
                lo = mid
            else:
                hi = mid
        # hi is the first count that does not fit: the answer is the one below
        hi = lo
    top = hi
    if not sides(top)[0]:
        staging = whole.model_dtype != "float32" and "device" in (whole.grad_cast,
                                                                 whole.param_cast)
        below: list[int] = []
        if staging:
            # device-side casting's fp32 staging makes the device's need not monotone in the
            # host buckets: a lower count may fit where `top` does not, so search downward
            below = [k for k in range(top - 1, -1, -1) if sides(k)[0]]
        if not below:
            at_one = check_fits(_memory(shape, prof, cfg.replace(ratio=1.0), techniques), prof)
            at_top = check_fits(_memory(shape, prof, cfg.replace(ratio=ratio_of(top)),
                                        techniques), prof)
            if top == n:
                return Feasibility(None, None, ("stationary weights at ratio 1 (every bucket "
                                                "on the host): " + "; ".join(at_one),))
            return Feasibility(None, None, (
                f"stationary weights fit no ratio: at ratio 1 {'; '.join(at_one)}; at ratio "
                f"{ratio_of(top):.3g}, the most the host holds, {'; '.join(at_top)}",))
        top = below[0]
    # the device fits at `top`; find the smallest k where it does
    low, high = 0, top
    if not sides(0)[0]:
        while high - low > 1:
            mid = (low + high) // 2
            if sides(mid)[0]:
                high = mid
            else:
                low = mid
        # low is the last count that does not fit: the answer is the one above
        low = high
    return Feasibility(cfg.replace(ratio=ratio_of(top)), (ratio_of(low), ratio_of(top)))
