"""What the planner needs from a notebook: a model shape and a hardware profile, resolved once.

The default profile is THIS machine's, measured by `plan.measure_local(quick=True)` (a few
seconds the first time, then read from its cache file): a preset for another machine
(`"cpu-laptop"`, `"gh200"`) predicts another machine, and a prediction that is off by 10x
teaches nothing. Every view says which profile it uses (`ProfileChoice.note`) and whether it
is calibrated to a run of the engine (`ProfileChoice.calibrated`): the tuner
calibrates this machine's profile by itself after the first iterations of the engine it is
attached to (runtime/calibrator.py) and switches to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

# one formatter (plan/tuning.py)
from superoffload.plan.tuning import format_count


@dataclass(frozen=True, slots=True)
class ProfileChoice:
    profile: Any
    """A `plan.HardwareProfile`."""
    note: str
    """Where it comes from, for the views ("measured on this machine ...", "preset")."""

    @property
    def name(self) -> str:
        return str(getattr(self.profile, "name", "?"))

    @property
    def of_this_machine(self) -> bool:
        """Whether the profile describes the machine at hand (measured here, or probed from a
        measured one: "local-..."): only such a profile may be fitted to a run here."""
        return self.note.startswith("measured") or self.name.startswith("local-")

    @property
    def calibrated(self) -> bool:
        """Whether the profile's compute rate was fitted to a measured run of the engine
        (``plan.calibrate.calibration_state``): the flag a view shows beside a prediction."""
        return self.calibration_state().calibrated

    def calibration_state(self) -> Any:
        """``plan.calibrate.CalibrationState``: the flag and its one-line text."""
        from superoffload.plan.calibrate import calibration_state

        return calibration_state(self.profile)


@functools.lru_cache(maxsize=1)
def local_profile() -> Any:
    """This machine's profile (`plan.measure_local(quick=True)`, cached on disk and here)."""
    from superoffload import plan

    return plan.measure_local(quick=True, progress=False)


def resolve_profile(profile: Any = None) -> ProfileChoice:
    """None: this machine's measured profile; a name: that preset; a HardwareProfile: itself."""
    from superoffload import plan

    if profile is None:
        return ProfileChoice(local_profile(), "measured on this machine by "
                                              "plan.measure_local(quick=True), cached")
    if isinstance(profile, str):
        return ProfileChoice(plan.profiles.get(profile), "preset")
    if isinstance(profile, plan.HardwareProfile):
        return ProfileChoice(profile, "given")
    raise TypeError(f"profile={profile!r}: pass None (this machine, measured), a preset name "
                    f"({', '.join(plan.profiles.names())}) or a plan.HardwareProfile")


def rank_share(profile: Any, shape: Any) -> Any:
    """What one rank of `shape` has of `profile`'s host (`plan.parallel.rank_profile`): the
    capacities a prediction's per-rank memory is measured against. Anything that is not a
    `plan.HardwareProfile` (a test's stand-in) is returned as it is."""
    from superoffload.plan.hardware import HardwareProfile
    from superoffload.plan.parallel import rank_profile

    if not isinstance(profile, HardwareProfile):
        return profile
    # plan.simulate sizes memory per rank, splitting the host by its ranks or its GPUs
    # (plan.parallel.host_share): the node's whole host memory would overstate the room
    return rank_profile(profile, int(getattr(shape, "ranks_per_host", 1)))


def to_shape(shape_or_model: Any, *, seq: int | None = None, micro_batch: int = 1) -> Any:
    """A `plan.ModelShape` from a shape or an `nn.Module` (then `seq` is needed, or read from
    the model's config)."""
    from superoffload.plan.shapes import ModelShape

    if isinstance(shape_or_model, ModelShape):
        return shape_or_model
    if hasattr(shape_or_model, "parameters"):
        if seq is None:
            cfg = getattr(shape_or_model, "cfg", None) or getattr(shape_or_model, "config", None)
            seq = getattr(cfg, "seq_len", None) or getattr(cfg, "block_size", None)
        if not isinstance(seq, int):
            raise ValueError("pass seq=<tokens per sequence> with an nn.Module (the planner "
                             "needs the sequence length to count FLOPs and activations)")
        return ModelShape.from_module(shape_or_model, seq=seq, micro_batch=micro_batch)
    raise TypeError(f"{type(shape_or_model).__name__}: pass a plan.ModelShape or an nn.Module")


def describe_choice(shape: Any, choice: ProfileChoice) -> str:
    """"121K params, seq 64 x batch 8 · profile local-vm (measured on this machine ...)"."""
    params = getattr(shape, "params", None)
    size = f"{format_count(float(params))} params" if isinstance(params, (int, float)) else "model"
    return (f"{size}, seq {shape.seq} x batch {shape.micro_batch} · profile {choice.name} "
            f"({choice.note})")
