"""The static HTML report: written from a Recorder or a list of spans, with and without plotly."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import pytest

from superoffload.telemetry import Recorder, Span
from superoffload.telemetry.report import PLOTLY_JS, write_html_report


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
    rec.record(Span("cpu_optimizer", "rollback", 3.8, 3.85, 3, bucket=0))
    rec.note(3, "adaptive STV: speculation off")
    return rec


def _figure_data(text: str) -> list[list[dict]]:
    """The `data` arrays of every Plotly.newPlot call in the page."""
    calls = re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', text, flags=re.S)
    return [json.loads(c) for c in calls]


def test_report_with_plotly_holds_the_traces(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    out = write_html_report(_recorder(), tmp_path / "run" / "report.html", title="unit <test>",
                            extra={"model": "tiny"})
    text = out.read_text()
    assert out.parent.joinpath(PLOTLY_JS).stat().st_size > 1_000_000  # offline plotly.js beside
    assert f"src='{PLOTLY_JS}'" in text and "cdn" not in text.lower()
    assert "unit &lt;test&gt;" in text  # the title is escaped
    assert "adaptive STV: speculation off" in text
    figures = _figure_data(text)
    names = {trace.get("name") for data in figures for trace in data}
    assert {"forward", "backward", "d2h", "cpu_step", "h2d", "rollback"} <= names
    assert "rollback/replay" in names  # rollbacks marked on the timeline
    loss = next(t for data in figures for t in data if t.get("name") == "loss")
    assert loss["y"] == [5.0, 4.0, 3.0, 2.0]
    # timeline bars: a forward starts at 0 ms and lasts 300 ms in iteration 0
    fwd = next(t for data in figures for t in data if t.get("name") == "forward")
    assert fwd["base"][0] == pytest.approx(0.0) and fwd["x"][0] == pytest.approx(300.0)
    # a second report in the same folder reuses plotly.min.js
    again = write_html_report(_recorder().spans(), tmp_path / "run" / "b.html", title="b")
    assert again.exists() and len(list(out.parent.glob("*.js"))) == 1


def test_report_inline_js_is_self_contained(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    out = write_html_report(_recorder().spans(), tmp_path / "r.html", title="inline", inline_js=True)
    assert not (tmp_path / PLOTLY_JS).exists()
    assert out.stat().st_size > 1_000_000


def test_report_without_plotly_writes_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
