"""`superoffload train` calibrates the planner on its own first iterations (docs/planner.md,
"Accuracy").

After `AutoCalibrator`'s warm-up and measured iterations (runtime/calibrator.py) the run's
profile -- this machine's ``measure_local(quick=True)``, cached -- is fitted to the engine's
telemetry; the run folder keeps it as ``profile-calibrated.json`` (``plan --profile
<run>/profile-calibrated.json`` predicts with it) and the summary prints before / after /
measured. Single-process runs long enough to calibrate only (data parallel: each rank's
timeline includes its collectives; not fitted here).
"""

from __future__ import annotations

from typing import Any

CALIBRATED_PROFILE = "profile-calibrated.json"


def auto_calibrator(job: Any, engine: Any) -> Any:
    """An AutoCalibrator for this run's engine, or None (data parallel, too few steps)."""
    from superoffload.runtime import calibrator

    if job.dp is not None or job.s.steps < calibrator.DEFAULT_SKIP + calibrator.DEFAULT_AFTER + 1:
        return None
    from superoffload import plan

    shape = plan.ModelShape.from_module(job.model, seq=job.s.seq,
                                        micro_batch=job.info["batch_per_rank"],
                                        activation_checkpointing=job.s.checkpointing)
    profile = plan.measure_local(quick=True, progress=False)
    return calibrator.AutoCalibrator(engine, shape, profile, save_to=job.out / CALIBRATED_PROFILE)
