"""Inputs of the engine's automatic weight-policy choice (paper §4.5).

The choice itself is the planner's pure ``plan.choose_weights`` (re-exported here);
this module turns the engine's ``profile=`` argument into a HardwareProfile.
"""

from __future__ import annotations

from superoffload.plan.profiles import HardwareProfile
from superoffload.plan.simulate import choose_weights
from superoffload.plan.weights import FLOW_MIN_EFFICIENCY, WeightChoice

__all__ = ["FLOW_MIN_EFFICIENCY", "WeightChoice", "choose_weights", "default_profile",
           "resolve_profile"]


def default_profile(device_type: str) -> HardwareProfile:
    """The preset "auto" uses when no profile is given: the measured profile of this host if
    one is cached (``plan.measure_local``), else a preset for the device type."""
    from superoffload.plan import profiles

    if device_type == "cpu":
        from superoffload.plan.measure import cached_profile

        hit = cached_profile()  # never measures inside initialize()
        return hit if hit is not None else profiles.get("cpu-laptop")
    return profiles.get("h200-pcie")


def resolve_profile(profile: HardwareProfile | str | None, device_type: str) -> HardwareProfile:
    """A HardwareProfile from an instance, a preset name, "measure" or None (the default)."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is None:
        return default_profile(device_type)
    if profile == "measure":
        from superoffload.plan.measure import measure_local

        return measure_local(quick=True, progress=False)
    if isinstance(profile, str):
        from superoffload.plan import profiles

        return profiles.get(profile)
    raise TypeError(f"profile: pass a HardwareProfile, a preset name or 'measure', not {type(profile)}")
