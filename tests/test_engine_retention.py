"""What an iteration leaves behind once it closed: under rollback="auto" a speculative step's
result (a ``Rescue``: exact copies of the elements its inverse cannot restore, whole
parameters in the first steps, runtime/auto_rollback.py) lives only while its iteration is
open -- memory the planner charges for one iteration (plan.storage.keeps_copies), not more."""

from __future__ import annotations

import gc

import pytest
from _engine_ref import HYPER, cpu_config, groups_for
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.plan.storage import keeps_copies
from superoffload.runtime.auto_rollback import Rescue

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_no_rescue_outlives_its_iteration() -> None:
    data = batches(4)
    model = make_model()
    with so.initialize(model, groups_for(model, False, HYPER),
                       cpu_config(ratio=1.0, rollback="auto")) as engine:
        kept = 0
        for batch in data:
            engine.backward(model(*batch))
            engine.synchronize()
            gc.collect()
            kept = max(kept, sum(isinstance(o, Rescue) for o in gc.get_objects()))
            engine.step()
            engine.zero_grad()
            engine.synchronize()
            gc.collect()
            assert not any(isinstance(o, Rescue) for o in gc.get_objects())
        assert kept > 0 and engine.stats.guarded_elements > 0  # the first steps did keep some


@pytest.mark.parametrize(("rollback", "speculation", "keeps"), [
    ("snapshot", "on", True), ("auto", "adaptive", True), ("inverse", "on", False),
    ("auto", "off", False), ("snapshot", "off", False)])
def test_the_budget_holds_pre_step_copies_where_speculation_keeps_them(
        rollback: str, speculation: str, keeps: bool) -> None:
    assert keeps_copies(rollback, speculation) is keeps
