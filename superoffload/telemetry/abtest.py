"""Did a settings change make training faster? The statistics of an interleaved A/B
(docs/jupyter.md, "The offload tuner"). Pure: numbers in, a verdict out (runtime/ab_trial.py
collects the numbers).

Design: the old (A) and new (B) settings alternate in blocks of k iterations, A1 B1 A2 B2 ...
An Bn, ending on the new one. Each B block is compared with the A blocks on either side of it
(the mean of their medians; the last B with A_n alone), so a load that drifts linearly over
the trial cancels out of each pair -- the ABA design of Box, Hunter & Hunter, "Statistics for
Experimenters" (2nd ed., §3.3, randomization and blocking). Medians inside a block, because a
shared machine's noise is one-sided (a preemption only adds time).

Change per pair: r_i = median(B_i) / median(A around B_i) - 1. The estimate is the median of
the r_i; its confidence interval is the distribution-free one for a median from order
statistics: [r_(j), r_(n+1-j)] with the largest j such that P(Binomial(n, 1/2) < j) <= alpha/2,
whose coverage is 1 - 2 P(Binomial(n, 1/2) <= j - 1) (Conover, "Practical Nonparametric
Statistics", 3rd ed., §3.2, the sign test's interval). With 6 pairs and j = 1 that is 96.9%;
5 pairs give 93.8%. "Within noise": the interval contains 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CONFIDENCE = 0.90
"""The interval's target coverage (the achieved one is reported; it is at least this from 5
pairs on: 2 x 0.5^5 = 6.25% outside)."""
RESULT_PREFIX = "A/B measured:"
"""How a result line (``ABResult.line()``, also a telemetry note) starts."""


def latest_result(notes: Iterable[tuple[int, str]]) -> str | None:
    """The newest A/B result line among (iteration, text) notes (e.g. a recorder's), or None:
    what a dashboard shows for the last change instead of before/after medians."""
    found = [text for _, text in notes if text.startswith(RESULT_PREFIX)]
    return found[-1] if found else None


@dataclass(frozen=True, slots=True)
class ABResult:
    """A measured change and the planner's prediction beside it."""

    changes: Mapping[str, tuple[Any, Any]]
    """Field -> (old value, new value)."""
    change: float
    """Median relative change of the iteration time, new vs old (-0.1: 10% faster)."""
    ci: tuple[float, float]
    """Confidence interval of `change`."""
    confidence: float
    """Coverage of `ci` (from the number of pairs)."""
    pairs: int
    block: int
    """Iterations measured per block (after the settling iterations of each switch)."""
    old_ms: float
    new_ms: float
    """Medians over all measured iterations of each arm."""
    predicted_change: float | None = None
    """The planner's new / old - 1 for the same settings (None: no prediction)."""
    iterations: tuple[int, int] = (-1, -1)
    """First and last iteration of the trial."""
    pair_changes: tuple[float, ...] = field(default=(), repr=False)

    @property
    def within_noise(self) -> bool:
        """The interval contains no change."""
        return self.ci[0] <= 0.0 <= self.ci[1]

    @property
    def prediction_inside(self) -> bool | None:
        """Whether the planner's predicted change lies inside the measured interval."""
        if self.predicted_change is None:
            return None
        return self.ci[0] <= self.predicted_change <= self.ci[1]

    @property
    def verdict(self) -> str:
        if self.within_noise:
            return "within noise"
        return "faster" if self.change < 0 else "slower"

    def line(self) -> str:
        """One plain-text line: what changed, measured, the interval, the verdict, predicted."""
        what = ", ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, (a, b) in self.changes.items())
        text = (f"{RESULT_PREFIX} {what}: {self.old_ms:.2f} -> {self.new_ms:.2f} ms, change "
                f"{self.change:+.1%} [{self.ci[0]:+.1%}, {self.ci[1]:+.1%}] "
                f"({self.confidence:.0%} CI, {self.pairs} pairs of {self.block} iterations): "
                f"{self.verdict}")
        if self.predicted_change is not None:
            inside = "inside" if self.prediction_inside else "outside"
            text += f"; predicted {self.predicted_change:+.1%} ({inside} the interval)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"changes": {k: list(v) for k, v in self.changes.items()},
                "change": self.change, "ci": list(self.ci), "confidence": self.confidence,
                "pairs": self.pairs, "block": self.block, "old_ms": self.old_ms,
                "new_ms": self.new_ms, "predicted_change": self.predicted_change,
                "within_noise": self.within_noise, "verdict": self.verdict,
                "iterations": list(self.iterations)}


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2.0**n


def median_interval(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE
                    ) -> tuple[float, float, float]:
    """(low, high, coverage) of the order-statistic interval for the median of `values`
    (module docstring); the widest one, [min, max], when there are too few values."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval: no values")
    alpha = 1.0 - confidence
    j = 1
    while j + 1 <= n // 2 and binomial_cdf(j, n) <= alpha / 2:
        # P(B <= j) <= alpha/2 means the j+1-th order statistic still covers
        j += 1
    return xs[j - 1], xs[n - j], 1.0 - 2.0 * binomial_cdf(j - 1, n)


def pair_changes(a_blocks: Sequence[Sequence[float]], b_blocks: Sequence[Sequence[float]]
                 ) -> list[float]:
    """r_i = median(B_i) / mean(median(A_i), median(A_{i+1})) - 1 (module docstring)."""
    if not b_blocks or len(a_blocks) < len(b_blocks):
        raise ValueError(f"pair_changes: {len(a_blocks)} A blocks for {len(b_blocks)} B blocks; "
                         "each B block needs the A block before it")
    a_med = [statistics.median(a) for a in a_blocks]
    out = []
    for i, b in enumerate(b_blocks):
        around = a_med[i:i + 2]
        out.append(statistics.median(b) / statistics.fmean(around) - 1.0)
    return out


def analyse(a_blocks: Sequence[Sequence[float]], b_blocks: Sequence[Sequence[float]], *,
            changes: Mapping[str, tuple[Any, Any]], predicted_change: float | None = None,
            confidence: float = DEFAULT_CONFIDENCE, iterations: tuple[int, int] = (-1, -1)
            ) -> ABResult:
    """The ABResult of per-iteration seconds in alternating blocks (A first)."""
    if any(not blk for blk in (*a_blocks, *b_blocks)):
        raise ValueError("analyse: an empty block (every block needs measured iterations)")
    rs = pair_changes(a_blocks, b_blocks)
    lo, hi, coverage = median_interval(rs, confidence)
    a_all = [t for blk in a_blocks for t in blk]
    b_all = [t for blk in b_blocks for t in blk]
    return ABResult(changes=dict(changes), change=statistics.median(rs), ci=(lo, hi),
                    confidence=coverage, pairs=len(rs), block=len(b_blocks[0]),
                    old_ms=statistics.median(a_all) * 1e3, new_ms=statistics.median(b_all) * 1e3,
                    predicted_change=predicted_change, iterations=iterations,
                    pair_changes=tuple(rs))


MAX_PAIRS = 96
"""The most pairs one change is measured over, lengthened or not: past that, noise this
large for a change this small is not worth the training time, and the result says so."""


def combine(results: Sequence[ABResult]) -> ABResult:
    """Several trials of one change as one: all their pair changes pooled into one median
    and one interval (each trial's pairs are ABA-blocked on their own, so pooling keeps the
    design). The arms' milliseconds are the trials' medians' median."""
    if not results:
        raise ValueError("combine: no A/B results")
    first = results[0]
    if any(r.changes != first.changes for r in results):
        raise ValueError("combine: the trials measured different changes")
    rs = [r_ for res in results for r_ in res.pair_changes]
    lo, hi, coverage = median_interval(rs)
    return ABResult(changes=dict(first.changes), change=statistics.median(rs), ci=(lo, hi),
                    confidence=coverage, pairs=len(rs), block=first.block,
                    old_ms=statistics.median(r.old_ms for r in results),
                    new_ms=statistics.median(r.new_ms for r in results),
                    predicted_change=first.predicted_change,
                    iterations=(first.iterations[0], results[-1].iterations[1]),
                    pair_changes=tuple(rs))


def resolves(result: ABResult) -> bool:
    """Whether the interval tells the predicted change from no change: it excludes 0 or the
    prediction (without a prediction: it excludes 0)."""
    excludes_zero = not result.within_noise
    p = result.predicted_change
    if p is None:
        return excludes_zero
    return excludes_zero or not result.ci[0] <= p <= result.ci[1]


def pairs_needed(result: ABResult) -> int | None:
    """Pairs at which the interval should be narrower than the distance between the
    predicted change and 0 (its width shrinks as 1/sqrt(pairs)); None when nothing can
    resolve it: no prediction, a predicted change of 0, or an interval of width 0."""
    p = result.predicted_change
    width = result.ci[1] - result.ci[0]
    if p is None or p == 0 or not width > 0:
        return None
    return max(result.pairs + 1, math.ceil(result.pairs * (width / abs(p)) ** 2))


def lengthen(result: ABResult, max_pairs: int = MAX_PAIRS) -> tuple[int, str]:
    """(more pairs to run, why) for a result that does not resolve its predicted change:
    the estimate of `pairs_needed`, or 0 with the reason it cannot (over `max_pairs`)."""
    if resolves(result):
        return 0, "the interval already tells the predicted change from no change"
    need = pairs_needed(result)
    if need is None:
        return 0, "nothing to resolve: no predicted change to tell from no change"
    if need > max_pairs:
        return 0, (f"cannot resolve: at this noise ({result.ci[0]:+.1%} to {result.ci[1]:+.1%} "
                   f"over {result.pairs} pairs) telling {result.predicted_change:+.1%} from no "
                   f"change needs ~{need} pairs, over the {max_pairs} this measures at most")
    return need - result.pairs, (f"~{need - result.pairs} more pairs should narrow the interval "
                                 f"below the predicted {result.predicted_change:+.1%}")
