"""The planner: hardware profiles, model shapes, cost model, simulator, tuner (DESIGN.md §5).

Pure code: no threads, no devices, no torch state (torch only to describe a module and, in
`measure_local` and `probe.probe_model`, to time microbenchmarks).

    from superoffload import plan
    prof = plan.profiles.get("gh200")
    shape = plan.ModelShape(layers=40, hidden=5120, heads=40, vocab=50257, seq=4096, micro_batch=4)
    res = plan.simulate(shape, prof, system="superoffload")
    cfg, why, prediction = plan.tune(shape, prof)

The schedule simulated is the one the engine runs: ``plan.schedule.resolve_schedule`` (the one
rule book) over the model's parameter list (``ModelShape.param_layout``), with the engine's
implementation variant for the config (``plan.schedule.engine_for(config)``: ``ENGINE`` with
the config's ``step_order``, as the engine resolves it; ``Techniques(engine=...)`` for another).
``plan.facts`` holds FACTS.md's measured H200 table and the calibration that reproduces it.
"""

from __future__ import annotations

from superoffload.plan import (
    ablation,
    compute,
    cost,
    facts,
    feasible,
    largest,
    parallel,
    probe,
    profiles,
    schedule,
)
from superoffload.plan.calibrate import (
    Measurements,
    calibrate,
    calibration_state,
    fit_compute,
    measurements_from_spans,
)
from superoffload.plan.capacity import fit_problems, gpt_by_layers, max_model_size
from superoffload.plan.device_grads import DeviceGrads, device_grads
from superoffload.plan.grad_accum import GradAccumChoice, choose_grad_accum
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.measure import measure_local
from superoffload.plan.memory import memory
from superoffload.plan.memory_types import Memory
from superoffload.plan.schedule import ENGINE, ENGINE_H200_MEASURED, EngineVariant, engine_for
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulator import LaneStats, SimResult, choose_weights, simulate
from superoffload.plan.size_limit import SimulationTooLarge
from superoffload.plan.techniques import SYSTEMS, ZERO_OFFLOAD, System, Techniques
from superoffload.plan.tuning import Constraints, InfeasibleError, tune
from superoffload.plan.weights import WeightChoice

__all__ = [
    "ENGINE",
    "ENGINE_H200_MEASURED",
    "EngineVariant",
    "engine_for",
    "DeviceGrads",
    "GradAccumChoice",
    "choose_grad_accum",
    "device_grads",
    "largest",
    "SimulationTooLarge",
    "facts",
    "fit_compute",
    "schedule",
    "SYSTEMS",
    "System",
    "ZERO_OFFLOAD",
    "ablation",
    "Constraints",
    "HardwareProfile",
    "InfeasibleError",
    "LaneStats",
    "Measurements",
    "Memory",
    "ModelShape",
    "SimResult",
    "Techniques",
    "WeightChoice",
    "calibrate",
    "calibration_state",
    "compute",
    "feasible",
    "probe",
    "choose_weights",
    "cost",
    "fit_problems",
    "gpt_by_layers",
    "max_model_size",
    "measure_local",
    "measurements_from_spans",
    "memory",
    "parallel",
    "profiles",
    "simulate",
    "tune",
]
