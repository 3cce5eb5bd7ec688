"""The static HTML report: one self-contained page (plotly embedded) that draws the dashboard's
own figure, in its palette and words, summary and charts first, settings last; tables only
without plotly."""

from __future__ import annotations

import base64
import builtins
import json
import re
from pathlib import Path

import numpy as np
import pytest

from superoffload.telemetry import Recorder, Span
from superoffload.widgets.dashboard import layout as L
from superoffload.widgets.dashboard.report import PLOTLY_JS, write_html_report
from superoffload.widgets.dashboard.traces import SPECS


def _recorder() -> Recorder:
    rec = Recorder()
    for it in range(4):
        t = it * 1.0
        rec.record(Span("device_compute", "forward", t, t + 0.3, it))
        rec.record(Span("device_compute", "backward", t + 0.3, t + 0.7, it))
        rec.record(Span("d2h", "d2h", t + 0.4, t + 0.5, it, bucket=0, nbytes=4_000_000))
        rec.record(Span("cpu_optimizer", "cpu_step", t + 0.5, t + 0.8, it, bucket=0))
        rec.record(Span("h2d", "h2d", t + 0.8, t + 0.9, it, bucket=0, nbytes=2_000_000))
        rec.scalar("loss", it, 5.0 - it)
        rec.scalar("speculating", it, float(it % 2))
    rec.record(Span("cpu_optimizer", "rollback", 3.8, 3.85, 3, bucket=0))
    rec.note(3, "adaptive STV: speculation off")
    return rec


def _values(array: list | dict) -> np.ndarray:
    """A plotly JSON array: a list, or numpy's base64 typed-array form ({"dtype", "bdata"})."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=np.dtype(array["dtype"]))
    return np.asarray(array, dtype=float)


def _figures(text: str) -> list[tuple[list[dict], dict]]:
    """(data, layout) of every Plotly.newPlot call in the page."""
    calls = re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{"responsive"',
                       text, flags=re.S)
    return [(json.loads(d), json.loads(lay)) for d, lay in calls]


def test_the_report_is_one_offline_file_in_the_dashboards_words_and_colours(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    out = write_html_report(_recorder(), tmp_path / "run" / "report.html", title="unit <test>",
                            extra={"model": "tiny"}, scalars={"lr": [(0, 1e-3), (1, 2e-3)]})
    text = out.read_text()
    assert not (out.parent / PLOTLY_JS).exists(), "nothing beside it: plotly.js is inside"
    page = text.split("</script>", 1)[1]  # all but the embedded plotly.js
    assert (out.stat().st_size > 1_000_000 and "<script src=" not in page
            and "cdn" not in page.lower())
    assert "unit &lt;test&gt;" in text  # the title is escaped
    assert "adaptive STV: speculation off" in text
    # summary and charts first, the settings table last; full width
    assert page.index("<div class='so-report-summary'>") < page.index("Plotly.newPlot") \
        < page.index("<h2>Settings</h2>")
    assert "max-width" not in page
    assert "iteration time" in text and "D2H while moving" in text, "the vocabulary's words"
    figures = _figures(text)
    (dash_data, dash_layout) = figures[0]
    # the dashboard's own traces, in its colours: D2H red, H2D blue, as on screen
    assert [t["name"] for t in dash_data] == [s.name for s in SPECS]
    colours = {t["name"]: t.get("line", {}).get("color")
               for t in dash_data if t.get("type") == "scatter"}
    assert colours["D2H"] == L.METRIC_COLORS["d2h"] and colours["H2D"] == L.METRIC_COLORS["h2d"]
    loss = next(t for t in dash_data
                if t["name"] == "loss" and t.get("mode") == "lines" and "fill" not in t)
    assert list(_values(loss["y"])) == [5.0, 4.0, 3.0, 2.0], "the loss of every iteration"
    assert dash_layout["yaxis2"]["title"]["text"] == "ms"
    # the other recorded series get vocabulary titles and a y axis title, never a raw key
    titles = [lay["title"]["text"] for _, lay in figures[1:]]
    assert any(t.startswith("learning rate") for t in titles)
    assert any(t.startswith("speculating") for t in titles) and "iteration_s" not in titles
    for _, lay in figures[1:]:
        assert lay["yaxis"]["title"]["text"], lay["title"]["text"]
    bw = next(data for data, lay in figures if lay["title"]["text"].startswith("link traffic"))
    assert [t["line"]["color"] for t in bw] == [L.METRIC_COLORS["d2h"], L.METRIC_COLORS["h2d"]]
    assert PLOTLY_JS == "plotly.min.js"


def test_report_can_share_plotly_js_beside_it(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    a = write_html_report(_recorder().spans(), tmp_path / "a.html", title="a", inline_js=False)
    b = write_html_report(_recorder().spans(), tmp_path / "b.html", title="b", inline_js=False)
    assert (tmp_path / PLOTLY_JS).stat().st_size > 1_000_000
    assert f"src='{PLOTLY_JS}'" in a.read_text() and b.stat().st_size < 1_000_000
    assert len(list(tmp_path.glob("*.js"))) == 1


def test_report_without_plotly_writes_tables(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_plotly(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "plotly" or name.startswith("plotly."):
            raise ImportError("no plotly here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_plotly)
    out = write_html_report(_recorder(), tmp_path / "plain.html", title="plain",
                            scalars={"val_loss": [(3, 2.5)]})
    text = out.read_text()
    assert "plotly is not installed" in text
    assert "<h2>loss</h2>" in text and "<h2>val_loss</h2>" in text
    assert text.count("<tr>") >= 4 + 4 + 1  # iterations, loss rows, val_loss row
    assert not (tmp_path / PLOTLY_JS).exists()


def test_report_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Recorder or a sequence of Span"):
        write_html_report([1, 2], tmp_path / "x.html", title="x")  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeline_iterations"):
        write_html_report([], tmp_path / "x.html", title="x", timeline_iterations=0)


def test_empty_timeline_still_writes(tmp_path: Path) -> None:
    out = write_html_report(Recorder(), tmp_path / "empty.html", title="empty")
    assert "No iterations were recorded" in out.read_text()
