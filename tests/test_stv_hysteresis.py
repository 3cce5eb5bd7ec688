"""Adaptive STV's hysteresis at a clip rate between its two thresholds.

``AdaptiveSTV`` (runtime/stv.py) stops speculating when the share of clipped iterations in
the window exceeds ``threshold`` and resumes only when it falls to ``threshold / 2`` or
below. Between the two it keeps whatever it was doing: that band is what stops it from
flapping, and only a rate inside it tells the two thresholds apart.
"""

from __future__ import annotations

from superoffload.runtime.stv import AdaptiveSTV


def feed(stv: AdaptiveSTV, outcomes: list[int]) -> list[bool]:
    """``enabled`` after each observed iteration (1 = clipped)."""
    out = []
    for clipped in outcomes:
        stv.observe(bool(clipped))
        out.append(stv.enabled)
    return out


def test_between_the_thresholds_speculation_stays_as_it_was() -> None:
    # window 4, threshold 0.5: off above 2 of 4 clipped, back on at 1 of 4 or fewer
    stv = AdaptiveSTV(mode="adaptive", window=4, threshold=0.5)
    # 1 then 2 of 4 clipped is not above 0.5; 3 of 4 is: off
    assert feed(stv, [0, 0, 0, 0, 1, 1, 1]) == [True] * 6 + [False]
    # 3, 3, then 2 of 4 clipped twice: 0.5 is above threshold/2, so it stays off
    assert feed(stv, [0, 1, 0, 1]) == [False] * 4
    assert stv.clip_rate == 0.5
    # 2 of 4 once more, then 1 of 4 = threshold/2: back on
    assert feed(stv, [0, 0]) == [False, True]
    assert stv.clip_rate == 0.25
    # 2 of 4 again (not above the threshold) keeps it on
    assert feed(stv, [1, 0, 1, 0]) == [True] * 4
    assert stv.clip_rate == 0.5
