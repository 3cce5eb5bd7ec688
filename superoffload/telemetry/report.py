"""The static HTML report of a run moved to `superoffload.widgets.report`: it draws
the dashboard's own figure, so it lives beside it. This name keeps old imports working:

    from superoffload.telemetry.report import write_html_report   # = widgets.report's
"""

from __future__ import annotations

from typing import Any


def write_html_report(*args: Any, **kwargs: Any) -> Any:
    """`superoffload.widgets.report.write_html_report` (see there)."""
    from superoffload.widgets.report import write_html_report as write

    return write(*args, **kwargs)


PLOTLY_JS = "plotly.min.js"
"""The file name of plotly.js written beside a report with `inline_js=False`."""
