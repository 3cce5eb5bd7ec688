"""What `train` shows and writes besides checkpoints: the HTML report, the sampled text and
the human summary (the JSON line and result.json are assembled in `train.py`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.metrics import Summary
from superoffload.telemetry.storage_io import StorageIO

SUMMARY_METRICS = ("iteration_ms", "d2h_gbps_busy", "h2d_gbps_busy", "d2h_gbps_wall",
                   "h2d_gbps_wall", "cpu_step_hidden_pct", "device_idle_pct",
                   "exposed_optimizer_ms")
"""What the summary line shows, in this order (names from telemetry.vocabulary)."""


def progress_postfix(info: Any) -> str:
    """The progress bar's text after a step (`train_loop.StepInfo`): the loss, tokens/s since
    the first step, and the CPU step hidden pooled over the recent iterations it names
    ("it. 280-299"), the same figure the dashboard's status line shows for its window."""
    hidden = vocab.METRICS["cpu_step_hidden_pct"].show(100 * info.overlap)
    window = getattr(info, "window", None)
    if window is not None and window.iterations:
        span = f"{window.first}"
        if window.iterations > 1:
            span += f"-{window.last}"
        hidden += f" (it. {span})"
    return (f"loss {info.loss:.3f} | {vocab.METRICS['tokens_per_s'].show(info.tokens_per_s)}"
            f" | {hidden}")


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message with newlines folded."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def write_report(out: Path, spans: list[Any], recorder: Any, result: Any, info: dict[str, Any],
                 stats: dict[str, Any], label: str, device: torch.device) -> Path:
    """<out>/report.html: the run's settings, per-iteration medians, timeline and scalars."""
    from superoffload.widgets.dashboard.report import write_html_report

    extra = {**info, "first_loss": result.first_loss, "final_loss": result.final_loss,
             "val_loss": result.val_loss, "tokens_per_s": round(result.tokens_per_s), **stats}
    scalars: dict[str, list[tuple[int, float]]] = {}
    for sc in recorder.scalars():
        scalars.setdefault(sc.name, []).append((sc.iteration, sc.value))
    scalars["lr"] = list(enumerate(result.lrs))
    return Path(write_html_report(spans, out / "report.html",
                                  title=f"superoffload train: {label} on {device}", extra=extra,
                                  scalars=scalars, notes=[f"iteration {n.iteration}: {n.text}"
                                                          for n in recorder.notes()]))


def sample_text(model: torch.nn.Module, device: torch.device, *, temperature: float,
                top_k: int, seed: int, prompt: str = "def ", new_bytes: int = 120) -> str:
    """A look at what the model learned: `new_bytes` sampled after `prompt` at `temperature`
    among the `top_k` likeliest bytes (0: all), from a generator seeded with `seed`, so the
    same run prints the same text. Greedy decoding of a small model loops ("the the the"):
    temperature 0 still selects it."""
    from superoffload.data import decode, encode

    idx = encode(prompt).long().to(device)[None, :]
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, new_bytes, temperature=temperature,  # type: ignore[operator]
                         top_k=top_k or None, generator=gen)
    return decode(out[0].cpu())


def print_summary(r: dict[str, Any], args: argparse.Namespace) -> None:
    s = r.get("summary") or {}
    held_out = ""
    # no held-out loss when --eval-batches 0 or a stop signal ended the run
    if r.get("val_loss") is not None:
        held_out = f", held-out {r['val_loss']:.3f}"
    print(f"loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} (mean of the last steps)"
          + held_out)
    resumed = f", resumed at step {r['start_step']}" if r.get("start_step") else ""
    rate = vocab.METRICS["tokens_per_s"].show(r["tokens_per_s"])
    print(f"{rate} over {r['steps'] - r['start_step']} steps ({r['elapsed_s']:.1f} s{resumed})")
    # the dashboard's words, units and pooling (telemetry.vocabulary, telemetry.window)
    if s:
        summary = Summary(**s)
        print(f"per iteration, {summary.window_label()} pooled: "
              + vocab.describe_values(vocab.summary_values(summary), SUMMARY_METRICS))
    # the storage tier's rates, bytes and exposed time
    if r.get("storage"):
        print(StorageIO(**r["storage"]).line())
    st = r["engine_stats"]
    print(f"engine: {st['clipped_steps']} clipped steps, {st['rollbacks']} bucket rollbacks, "
          f"{st['replays']} replays, {st['skipped_steps']} skipped")
    if r.get("sample"):
        how = "greedy"
        # temperature 0 means argmax decoding (models/gpt.py's generate)
        if args.sample_temperature:
            how = f"temperature {args.sample_temperature:g}, top-k {args.sample_top_k or 'all'}"
        print(f"sample ({how}): " + repr(r["sample"]))
    # the planner calibrated on this run
    if r.get("planner"):
        print(r["planner"]["line"])
    for key in ("report", "trace"):
        if r.get(key):
            print(f"{key}: {os.path.abspath(r[key])}")
