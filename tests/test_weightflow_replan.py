"""Weight-flow under the settings that rebuild its buckets or keep snapshots: built from the
masters' shapes, as a released parameter (a block between uses) holds no elements. Checked
by value against weight-stationary with every bucket on the host (the same arithmetic in the
same order: exactly equal, tests/test_weightflow.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _engine_ref import cpu_config, max_diff, train_engine
from _tiny_models import batches, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS = 6
KW = {"n_blocks": 4}


def _replan(engine: Any, step: int) -> None:
    if engine is not None and step == 3:  # applied at the next iteration boundary
        engine.reconfigure(bucket_bytes=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replan_under_weight_flow_trains_as_stationary(dtype: torch.dtype) -> None:
    data = batches(STEPS)
    common = {"max_grad_norm": 0.5}
    stat, _ = train_engine(make_model(dtype=dtype, **KW), data,
                           cpu_config(ratio=1.0, param_cast="host", **common), steps=STEPS,
                           during=_replan)
    flow, stats = train_engine(make_model(dtype=dtype, **KW), data,
                               cpu_config(weights="flow", **common), steps=STEPS,
                               during=_replan)
    assert stats.reconfigurations == 1
    assert max_diff(stat, flow) == 0.0


def test_snapshot_rollback_under_weight_flow_trains_as_stationary() -> None:
    data = batches(STEPS)
    common = {"max_grad_norm": 0.3, "rollback": "snapshot"}
    stat, _ = train_engine(make_model(dtype=torch.bfloat16, **KW), data,
                           cpu_config(ratio=1.0, param_cast="host", **common), steps=STEPS)
    flow, stats = train_engine(make_model(dtype=torch.bfloat16, **KW), data,
                               cpu_config(weights="flow", **common), steps=STEPS)
    assert stats.replays > 0 and max_diff(stat, flow) == 0.0
