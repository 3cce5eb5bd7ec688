"""Telemetry: timeline spans from every lane, derived metrics, static HTML report."""

from superoffload.telemetry.events import LANES, Span
from superoffload.telemetry.recorder import Recorder

__all__ = ["LANES", "Recorder", "Span"]
