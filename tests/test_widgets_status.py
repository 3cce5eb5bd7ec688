"""What the dashboard says: a warning that does not flicker, the link named by the hardware
profile with what overlap means over it, one plain sentence on a CPU-only machine, and the
calibration after the warm-up. Pure: numbers in, words out."""

from __future__ import annotations

import numpy as np
import pytest

from superoffload import plan
from superoffload.widgets.dashboard.expected import CLEAR_FACTOR, GAP_FACTOR, Expected, GapWatch
from superoffload.widgets.dashboard.link import CPU_ONLY_NOTE, link_of
from superoffload.widgets.dashboard.state import DashboardState, IterationPoint
from superoffload.widgets.dashboard.status import Workload, status_lines
from superoffload.widgets.shared import slots as snap
from superoffload.widgets.shared.calibration import MAX_WARMUP, MIN_WARMUP, warmed_up
from superoffload.widgets.shared.runstate import RunState

PRED = [Expected(0, 0.010, 1.0)]  # 10 ms predicted


def _feed(state: DashboardState, its: range, engine_ms: float) -> None:
    for it in its:
        state.add_point(IterationPoint(it, {"iteration_ms": engine_ms, "engine_ms": engine_ms}, 0))


def test_the_gap_warning_stays_while_the_run_hovers_around_the_threshold() -> None:
    watch, state = GapWatch(), DashboardState()
    shown = []
    _feed(state, range(0, 30), 10.0 * GAP_FACTOR * 1.2)  # clearly beyond: the warning comes
    for k in range(30, 90):  # then hovering around the threshold, one window above, one below
        ms = 10.0 * GAP_FACTOR * (1.1 if (k // 10) % 2 else 0.9)
        _feed(state, range(k, k + 1), ms)
        r = state.recent()
        shown.append(watch.update(r["iteration"], r["engine_ms"], PRED) is not None)
    assert all(shown), "shown throughout: neither window fell within the clear factor"
    # both windows back within the clear factor: it goes, and stays gone
    _feed(state, range(90, 110), 10.0 * CLEAR_FACTOR * 0.9)
    r = state.recent()
    assert watch.update(r["iteration"], r["engine_ms"], PRED) is None


def test_a_new_prediction_judges_the_gap_afresh() -> None:
    watch, state = GapWatch(), DashboardState()
    _feed(state, range(0, 40), 10.0 * GAP_FACTOR * 1.5)
    r = state.recent()
    assert watch.update(r["iteration"], r["engine_ms"], PRED) is not None
    calibrated = [*PRED, Expected(40, 0.030, 1.0, calibrated=True)]
    assert watch.update(r["iteration"], r["engine_ms"], calibrated) is None


def test_the_status_holds_its_warning_through_a_watch() -> None:
    state, watch = DashboardState(), GapWatch()
    _feed(state, range(0, 30), 50.0)
    lines = status_lines(state, Workload(), PRED, run_state=RunState.RUNNING, iteration=30,
                         gaps=watch)
    assert any(line.startswith("warning: engine time 5.0x") for line in lines)
    _feed(state, range(30, 40), 10.0 * GAP_FACTOR * 0.95)  # one window just inside: held
    lines = status_lines(state, Workload(), PRED, run_state=RunState.RUNNING, iteration=40,
                         gaps=watch)
    assert any(line.startswith("warning:") for line in lines)


@pytest.mark.parametrize(("name", "link", "cpu_only"), [
    ("gh200", "NVLink-C2C", False), ("gb200", "NVLink-C2C", False),
    ("h200-pcie", "PCIe", False), ("mi300a", "unified memory", False),
    ("cpu-laptop", "memory copy", True)])
def test_the_link_is_named_by_the_hardware_profile(name: str, link: str, cpu_only: bool) -> None:
    got = link_of(plan.profiles.get(name))
    assert got is not None and got.name == link and got.cpu_only is cpu_only
    assert "CPU step hidden" in got.meaning and "device idle" in got.meaning
    assert link_of(None) is None


def test_a_cpu_only_run_says_plainly_what_the_ratio_shows_and_the_link_in_the_details() -> None:
    state = DashboardState()
    _feed(state, range(0, 5), 30.0)
    cpu = Workload(link=link_of(plan.profiles.get("cpu-laptop")))
    lines = status_lines(state, cpu, (), run_state=RunState.RUNNING, iteration=5)
    assert CPU_ONLY_NOTE in lines and "link: memory copy:" in "\n".join(lines)
    html = snap.html_lines(lines, fold_after=3)
    assert CPU_ONLY_NOTE.split(":")[0] in html.split("<details")[0], "in view, not folded"
    gpu = Workload(link=link_of(plan.profiles.get("gh200")))
    lines = status_lines(state, gpu, (), run_state=RunState.RUNNING, iteration=5)
    assert CPU_ONLY_NOTE not in lines and any(x.startswith("link: NVLink-C2C") for x in lines)


def test_calibration_waits_for_the_warm_up() -> None:
    warm = [0.100 - 0.002 * k for k in range(30)]  # a warm-up: 100 ms falling to 42 ms
    steady = [0.041 + 0.001 * (k % 3) for k in range(20)]
    assert not warmed_up(warm), "still falling: not warm"
    assert not warmed_up(steady[:MIN_WARMUP - 1])
    assert warmed_up(warm + steady), "two windows alike"
    times = list(np.linspace(0.2, 0.02, MAX_WARMUP))
    assert warmed_up(times), "at most MAX_WARMUP iterations, whatever the times"
