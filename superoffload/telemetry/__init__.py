"""Telemetry: timeline spans from every lane and the metrics derived from them (the static
HTML report that draws them is superoffload/widgets/dashboard/report.py)."""

from superoffload.telemetry.events import LANES, Span
from superoffload.telemetry.recorder import Recorder

__all__ = ["LANES", "Recorder", "Span"]
