"""Runs kept on disk, to compare them with one another and with a live one.

    save_run(engine.telemetry, "runs/ratio-0.5")   # spans, scalars, notes (.jsonl), run.json
    run = load_run("runs/ratio-0.5")               # or a `superoffload train` output folder
    list_runs("runs")                              # the folders under runs/ that hold a run

A saved run is a folder: `spans.jsonl` (one `Span.to_dict()` per line, `ranks.save_spans`),
`scalars.jsonl` (name, iteration, value, time_s), `notes.jsonl` (iteration, text, time_s) and
`run.json` (name, format, what the caller adds). `load_run` also reads the folder
`superoffload train` writes: its `result.json` holds one record of metrics per iteration
(`metrics.to_records`), enough to compare iteration time, link rates and overlap (no loss
per iteration: the command keeps the first and final loss only).

A `SavedRun` holds per-iteration metrics (of the lowest rank), the scalars and the notes:
what the dashboard overlays (`widgets/dashboard/compare.py`). `segment()` cuts a run at a change of
settings, so the iterations before and after an Apply compare as two runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from superoffload.telemetry.events import Span
from superoffload.telemetry.metrics import IterationMetrics, iteration_metrics
from superoffload.telemetry.ranks import by_rank, load_spans, save_spans
from superoffload.telemetry.recorder import Recorder

RUN_FOLDER_FORMAT = "superoffload-run-1"
"""`run.json`'s "format": what `load_run` reads."""
RESULT_FILE = "result.json"
"""What `superoffload train` writes in its output folder."""


@dataclass(frozen=True, slots=True)
class SavedRun:
    """A run to compare: its per-iteration metrics, scalars and notes."""

    name: str
    metrics: list[IterationMetrics]
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Engine scalars by name: [(iteration, value), ...] ("loss", "ratio", ...)."""
    notes: list[tuple[int, str]] = field(default_factory=list)
    path: Path | None = None
    """The folder it was read from (None: built in memory)."""

    @property
    def first_iteration(self) -> int:
        return self.metrics[0].iteration if self.metrics else 0

    def segment(self, first: int, last: int, name: str) -> SavedRun:
        """The iterations `first`..`last` (inclusive) as a run of their own."""
        keep = [m for m in self.metrics if first <= m.iteration <= last]
        scalars = {k: [(i, v) for i, v in vs if first <= i <= last]
                   for k, vs in self.scalars.items()}
        return SavedRun(name, keep, scalars, [(i, t) for i, t in self.notes if first <= i <= last])


def run_from_spans(spans: Sequence[Span], name: str, *,
                   scalars: dict[str, list[tuple[int, float]]] | None = None,
                   notes: Iterable[tuple[int, str]] = ()) -> SavedRun:
    """A `SavedRun` of spans (the lowest rank's, as the dashboard plots)."""
    groups = by_rank(spans)
    mine = groups[min(groups)] if groups else []
    return SavedRun(name, iteration_metrics(mine), dict(scalars or {}), list(notes))


def run_from_recorder(recorder: Recorder, name: str) -> SavedRun:
    """What `recorder` holds now, as a run."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for sc in recorder.scalars():
        scalars.setdefault(sc.name, []).append((sc.iteration, sc.value))
    return run_from_spans(recorder.spans(), name, scalars=scalars,
                          notes=[(n.iteration, n.text) for n in recorder.notes()])


def save_run(source: Any, folder: str | Path, *, name: str | None = None,
             meta: dict[str, Any] | None = None) -> Path:
    """Write `source` (a Recorder, or an engine with `.telemetry`) to `folder` as a run;
    returns the folder. An existing run there is replaced; a folder holding other files is
    refused (nothing of someone else's is overwritten)."""
    recorder = source if isinstance(source, Recorder) else getattr(source, "telemetry", None)
    if not isinstance(recorder, Recorder):
        raise TypeError(f"save_run: pass a Recorder or an engine, not {type(source).__name__}")
    out = Path(folder)
    ours = {"spans.jsonl", "scalars.jsonl", "notes.jsonl", "run.json"}
    if out.exists():
        others = sorted(p.name for p in out.iterdir() if p.name not in ours)
        if others:
            raise ValueError(f"save_run: {out} holds other files ({', '.join(others[:3])}); "
                             "pick an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    save_spans(recorder.spans(), out / "spans.jsonl")
    _write_lines(out / "scalars.jsonl", ({"name": s.name, "iteration": s.iteration,
                                          "value": s.value, "time_s": s.time_s}
                                         for s in recorder.scalars()))
    _write_lines(out / "notes.jsonl", ({"iteration": n.iteration, "text": n.text,
                                        "time_s": n.time_s} for n in recorder.notes()))
    info = {"format": RUN_FOLDER_FORMAT, "name": name or out.name, **(meta or {})}
    (out / "run.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    return out


def _write_lines(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_run(folder: str | Path, *, name: str | None = None) -> SavedRun:
    """Read a run saved by `save_run`, or a `superoffload train` output folder."""
    path = Path(folder)
    if (path / "run.json").exists():
        info = json.loads((path / "run.json").read_text(encoding="utf-8"))
        if info.get("format") != RUN_FOLDER_FORMAT:
            raise ValueError(f"{path / 'run.json'}: format {info.get('format')!r}, "
                             f"expected {RUN_FOLDER_FORMAT!r}")
        scalars: dict[str, list[tuple[int, float]]] = {}
        for row in _read_lines(path / "scalars.jsonl"):
            point = (int(row["iteration"]), float(row["value"]))
            scalars.setdefault(str(row["name"]), []).append(point)
        notes = [(int(r["iteration"]), str(r["text"])) for r in _read_lines(path / "notes.jsonl")]
        label = name or str(info.get("name") or path.name)
        run = run_from_spans(load_spans(path / "spans.jsonl"), label, scalars=scalars,
                             notes=notes)
        return dataclasses.replace(run, path=path)
    if (path / RESULT_FILE).exists():
        data = json.loads((path / RESULT_FILE).read_text(encoding="utf-8"))
        known = {f.name for f in dataclasses.fields(IterationMetrics)}
        metrics = [_record(r, known) for r in data.get("iterations") or []]
        return SavedRun(name or path.name, metrics, {}, [], path)
    raise ValueError(f"{path}: no run.json (save_run) or {RESULT_FILE} (superoffload train) here")


def _record(row: dict[str, Any], known: set[str]) -> IterationMetrics:
    values = {k: v for k, v in row.items() if k in known}
    # a run written before cpu_hidden_s existed: the hidden seconds follow from the share
    if "cpu_hidden_s" not in values:
        share = float(values.get("cpu_overlap_frac", 0.0))
        values["cpu_hidden_s"] = share * float(values.get("cpu_step_s", 0.0))
    return IterationMetrics(**values)


def list_runs(root: str | Path = "runs") -> list[Path]:
    """Folders directly under `root` that hold a run (newest first); [] when `root` is absent."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()
             and ((p / "run.json").exists() or (p / RESULT_FILE).exists())]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
