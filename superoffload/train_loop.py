"""The training loop of the main job, as a function the CLI, the benchmarks and the notebooks
call: warm-up + cosine learning rate through a torch LR scheduler on the engine's optimizer,
byte-level batches from `superoffload.data`, live telemetry metrics, a held-out loss.

    engine = so.initialize(model, optimizer={...}, config=so.presets.tiny_cpu())
    result = train(engine, model, train_sampler, TrainSettings(steps=300), val_sampler=val)

The loop needs only the engine's public contract (`EngineLike`), so a plain-PyTorch stand-in
with the same four methods runs it too (the benchmark's baseline does exactly that).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from superoffload.telemetry.events import Span
from superoffload.telemetry.metrics import IterationMetrics, Summary, iteration_metrics, summarize
from superoffload.telemetry.recorder import Recorder
from superoffload.telemetry.window import RECENT_ITERATIONS, Window, window_of


class EngineLike(Protocol):
    """What the loop uses of `superoffload.runtime.engine.OffloadEngine`."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def telemetry(self) -> Recorder: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def synchronize(self) -> None: ...


LossReduce = Callable[[torch.Tensor], torch.Tensor]
"""A rank's loss -> the loss to record (train(loss_reduce=...))."""


class Batches(Protocol):
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(kw_only=True, slots=True)
class TrainSettings:
    """The loop's knobs (the engine's live in OffloadConfig)."""

    steps: int = 400
    """Optimizer steps."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up from lr/warmup_steps to lr."""
    min_lr_frac: float = 0.1
    """Cosine decay ends at lr * min_lr_frac (Loshchilov & Hutter 2017; nanoGPT uses 0.1)."""
    eval_batches: int = 8
    """Batches of held-out data for the final validation loss (0: skip)."""
    metrics_every: int = 10
    """Steps between refreshes of the live telemetry metrics handed to `on_step`."""
    final_window: int = 10
    """`final_loss` is the mean training loss over the last this-many steps."""

    def validate(self) -> TrainSettings:
        for name in ("steps", "metrics_every", "final_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TrainSettings.{name}={value!r} is invalid: use a whole number >= 1")
        for name in ("warmup_steps", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"TrainSettings.{name}={value!r} is invalid: use a whole number >= 0")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(
                f"TrainSettings.min_lr_frac={self.min_lr_frac!r} is invalid: use [0, 1]")
        return self


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_lr_frac: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): linear warm-up, then a
    cosine from 1 down to `min_lr_frac` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_frac + (1.0 - min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What `on_step` sees after each optimizer step."""

    step: int
    """Steps done so far (1-based)."""
    loss: float
    lr: float
    tokens_per_s: float
    """Tokens per second since the end of the first (warm-up) step."""
    link_gbps: float
    """Recent link traffic, both directions, bytes / iteration time (GB/s); 0 without telemetry."""
    overlap: float
    """Recent share of CPU optimizer time hidden behind device compute, pooled over `window`
    (nan when unknown)."""
    window: Window | None = None
    """The recent complete iterations the figures pool (`telemetry.window`), None without
    telemetry."""


@dataclass(kw_only=True, slots=True)
class Progress:
    """Where a run stands after `step` optimizer steps: what a checkpoint carries besides the
    engine, so a resumed run continues the same history (first_loss, final_loss, the lr
    curve) and `train()` returns what an uninterrupted run returns."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses), "lrs": list(self.lrs),
                "tokens": self.tokens}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        step = int(data["step"])
        losses, lrs = [float(v) for v in data["losses"]], [float(v) for v in data["lrs"]]
        if step < 0 or len(losses) != step or len(lrs) != step:
            raise ValueError(f"Progress: {len(losses)} losses and {len(lrs)} lrs for step "
                             f"{step}; the record is damaged")
        return cls(step=step, losses=losses, lrs=lrs, tokens=int(data["tokens"]))


@dataclass
class TrainLoopResult:
    """What a run did. `to_dict()` is the JSON the CLI prints."""

    steps: int
    first_loss: float
    final_loss: float
    """Mean training loss over the last `TrainSettings.final_window` steps."""
    val_loss: float | None
    tokens: int
    elapsed_s: float
    tokens_per_s: float
    """Tokens / second after the first step (the first step pays one-off set-up costs)."""
    losses: list[float] = field(repr=False)
    lrs: list[float] = field(default_factory=list, repr=False)
    """Learning rate (first param group) used at each step."""
    summary: Summary | None = None
    spans: list[Span] = field(default_factory=list, repr=False)
    """The training iterations' telemetry spans (evaluation forwards excluded)."""
    start_step: int = 0
    """Steps already done when this call began (a resumed run); `steps` counts them too."""
    stopped: bool = False
    """`should_stop` ended the run before `TrainSettings.steps`; no evaluation was run."""
    calibration: Any = None
    """The planner's calibration on this run (`plan.autocal.CalibrationReport`) when a
    `calibrator` was given and the run was long enough; else None."""

    def progress(self) -> Progress:
        """The history as a `Progress` (what a checkpoint of this point saves)."""
        return Progress(step=self.steps, losses=list(self.losses), lrs=list(self.lrs),
                        tokens=self.tokens)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("steps", "first_loss", "final_loss", "val_loss",
                                             "tokens", "elapsed_s", "tokens_per_s")}
        out["summary"] = self.summary.to_dict() if self.summary else None
        out["planner"] = self.calibration.to_dict() if self.calibration is not None else None
        return out


class _LiveMetrics:
    """Per-iteration metrics of the last few iterations, from the recorder's new spans only."""

    def __init__(self, recorder: Recorder | None, keep_iterations: int = 4) -> None:
        self.recorder = recorder
        self.keep = keep_iterations
        self.seq = recorder.last_seq if recorder is not None else -1
        self.spans: list[Span] = []

    def refresh(self) -> list[IterationMetrics]:
        if self.recorder is None:
            return []
        new, self.seq = self.recorder.spans_since(self.seq)
        self.spans.extend(new)
        if not self.spans:
            return []
        newest = max(s.iteration for s in self.spans)
        self.spans = [s for s in self.spans if s.iteration > newest - self.keep]
        # the newest iteration may still be in flight: report the complete ones
        return [m for m in iteration_metrics(self.spans) if m.iteration < newest]


def _recorder_of(engine: EngineLike) -> Recorder | None:
    rec = getattr(engine, "telemetry", None)
    return rec if isinstance(rec, Recorder) else None


def _logged(loss: torch.Tensor, loss_reduce: LossReduce | None) -> float:
    # under data parallel every rank logs the whole batch's loss (a collective: all call it)
    if loss_reduce is not None:
        loss = loss_reduce(loss)
    return float(loss)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Batches, n_batches: int,
             device: torch.device, loss_reduce: LossReduce | None = None,
             on_batch: Callable[[int, int], None] | None = None) -> float:
    """Mean loss over `n_batches` held-out batches (model in eval mode, no gradients);
    `on_batch(done, n_batches)` after each (a progress bar)."""
    was_training = model.training
    model.eval()
    try:
        losses = []
        for k in range(n_batches):
            x, y = batches.next_batch()
            loss = model(x.to(device), y.to(device))
            losses.append(_logged(loss, loss_reduce))
            if on_batch is not None:
                on_batch(k + 1, n_batches)
        return statistics.fmean(losses)
    finally:
        model.train(was_training)


def _device_of(model: torch.nn.Module) -> torch.device:
    params: Iterator[torch.Tensor] = model.parameters()
    first = next(params, None)
    return first.device if first is not None else torch.device("cpu")


def make_scheduler(optimizer: torch.optim.Optimizer,
                   settings: TrainSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The loop's learning-rate schedule (`lr_factor`) as a torch LR scheduler, so a
    checkpoint can save and restore it (`engine.save_checkpoint(lr_scheduler=...)`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, steps=settings.steps, warmup_steps=settings.warmup_steps,
                            min_lr_frac=settings.min_lr_frac),
    )


def train(
    engine: EngineLike,
    model: torch.nn.Module,
    batches: Batches,
    settings: TrainSettings,
    *,
    val_batches: Batches | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    loss_reduce: LossReduce | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    progress: Progress | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    calibrator: Any = None,
    steps_scope: contextlib.AbstractContextManager[Any] | None = None,
    on_eval_batch: Callable[[int, int], None] | None = None,
) -> TrainLoopResult:
    """Train until `settings.steps` optimizer steps are done; return losses, throughput and a
    telemetry summary. The learning rate follows `lr_factor` via `make_scheduler` on
    `engine.optimizer` (the engine keeps torch's optimizer contract) unless `scheduler` is
    given. `loss_reduce` maps a rank's (detached) loss to the one recorded, e.g. the mean over
    the ranks of a distributed run (every rank must then call it: it is a collective).

    Resuming: pass the `progress` saved with a checkpoint (and the scheduler and batches
    restored from it); the loop continues at `progress.step` and the result covers the whole
    run. `on_checkpoint(progress)` runs after every `checkpoint_every`-th step, then
    `should_stop()` after every step but the last: when it answers True the loop ends there
    with `stopped=True` and no evaluation. Under data parallel every rank calls both at the
    same steps (they may be collectives).

    `calibrator`: a `runtime.calibrator.AutoCalibrator` on `engine`; started here, it fits the
    planner to the first iterations by itself and its report is the result's
    `calibration`.

    `steps_scope` is entered while steps whose end `should_stop` is asked about run: from
    the first step to the start of the last one (the CLI defers SIGINT/SIGTERM to the next
    step boundary only there; elsewhere there is no boundary to wait for).
    `on_eval_batch(done, total)` follows the final evaluation."""
    settings.validate()
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every={checkpoint_every!r}: use a whole number >= 0")
    device = _device_of(model)
    if scheduler is None:
        scheduler = make_scheduler(engine.optimizer, settings)
    done = progress or Progress()
    if done.step > settings.steps:
        raise ValueError(f"progress.step={done.step} is past TrainSettings.steps="
                         f"{settings.steps}: nothing left to train")
    recorder = _recorder_of(engine)
    if calibrator is not None:
        calibrator.start()
    live = _LiveMetrics(recorder, keep_iterations=RECENT_ITERATIONS + 1)
    # the run's spans are those after the live view's start
    first_seq = live.seq
    model.train()
    losses: list[float] = list(done.losses)
    lrs: list[float] = list(done.lrs)
    tokens = done.tokens
    link_gbps, overlap = 0.0, math.nan
    pooled: Window | None = None
    start = time.perf_counter()
    warm_start, warm_tokens = start, tokens
    stopped = False
    # left before the last step, or on an error
    with contextlib.ExitStack() as scope:
        if steps_scope is not None:
            scope.enter_context(steps_scope)
        for step in range(done.step, settings.steps):
            if step + 1 == settings.steps:
                # the last step: should_stop is not asked after it
                scope.close()
            x, y = batches.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = model(x, y)
            engine.backward(loss)
            lrs.append(float(engine.optimizer.param_groups[0]["lr"]))
            engine.step()
            engine.zero_grad()
            scheduler.step()
            losses.append(_logged(loss.detach(), loss_reduce))
            tokens += x.numel()
            # the clock starts after this process's first step (fresh or resumed): that step
            # pays for allocation and warm-up, which a steady-state rate must not include
            if step == done.step:
                warm_start, warm_tokens = time.perf_counter(), tokens
            if (step + 1) % settings.metrics_every == 0 or step + 1 == settings.steps:
                recent = live.refresh()
                # pooled as every view pools (telemetry.window)
                if recent:
                    pooled = window_of(recent[-RECENT_ITERATIONS:])
                    both = pooled.values["d2h_gbps_wall"] + pooled.values["h2d_gbps_wall"]
                    link_gbps = both if math.isfinite(both) else 0.0
                    overlap = pooled.values["cpu_step_hidden_pct"] / 100.0
            if on_step is not None:
                now = time.perf_counter()
                # no rate for the warm-up step itself (the clock started after it)
                rate = 0.0
                if step > done.step:
                    rate = (tokens - warm_tokens) / (now - warm_start)
                lr = float(scheduler.get_last_lr()[0])
                on_step(StepInfo(step=step + 1, loss=losses[-1], lr=lr, tokens_per_s=rate,
                                 link_gbps=link_gbps, overlap=overlap, window=pooled))
            if on_checkpoint is not None and checkpoint_every \
                    and (step + 1) % checkpoint_every == 0:
                on_checkpoint(Progress(step=step + 1, losses=list(losses), lrs=list(lrs),
                                       tokens=tokens))
            if should_stop is not None and step + 1 < settings.steps and should_stop():
                stopped = True
                break
    engine.synchronize()
    end = time.perf_counter()
    if calibrator is not None:
        calibrator.stop()
    timed_tokens = tokens - warm_tokens
    run_tokens = tokens - done.tokens
    # a run of its warm-up step alone has no timed tokens: then its whole time counts
    tokens_per_s = run_tokens / max(end - start, 1e-9)
    if timed_tokens:
        tokens_per_s = timed_tokens / (end - warm_start)
    summary: Summary | None = None
    spans: list[Span] = []
    # before evaluation, whose forwards the engine also records
    if recorder is not None:
        spans, _ = recorder.spans_since(first_seq)
        if spans and iteration_metrics(spans):
            summary = summarize(spans, skip=1)
    val_loss = None
    if val_batches is not None and settings.eval_batches and not stopped:
        val_loss = evaluate(model, val_batches, settings.eval_batches, device, loss_reduce,
                            on_eval_batch)
    window = losses[-settings.final_window:]
    return TrainLoopResult(
        steps=len(losses),
        first_loss=losses[0] if losses else math.nan,
        final_loss=statistics.fmean(window) if window else math.nan,
        val_loss=val_loss,
        tokens=tokens,
        elapsed_s=end - start,
        tokens_per_s=tokens_per_s,
        losses=losses,
        lrs=lrs,
        summary=summary,
        spans=spans,
        start_step=done.step,
        stopped=stopped,
        calibration=calibrator.report if calibrator is not None else None,
    )
