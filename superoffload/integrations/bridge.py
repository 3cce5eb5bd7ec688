"""What every framework integration needs from the engine (docs/integrations.md).

* `engine_config`: the framework's clipping threshold and accumulation steps become the
  engine's. The engine clips inside its step (global norm, speculation-then-validation, paper
  §4.3), so the framework must not clip `p.grad` itself; an OffloadConfig that contradicts the
  framework is refused, naming both settings -- as DeepSpeed's Trainer integration refuses a
  DeepSpeed config that mismatches TrainingArguments (transformers' DeepSpeed
  config check when the Trainer starts; docs/integrations.md).
* `backward`: framework losses arrive already divided by the accumulation steps
  (`Trainer.training_step`, Lightning's `_ClosureResult`), and `engine.backward` divides
  again (DeepSpeed semantics; `Trainer` passes `scale_wrt_gas=False` to DeepSpeed for the same
  reason). Multiplying back by a power of two is exact; in general the gradient seed
  `fp32(1/k) * k` rounds to 1.0, so gradients equal a plain `loss.backward()`.
* `gradients_in_grad`: while a framework hook that inspects gradients runs (Lightning's
  `on_before_optimizer_step`, whose documented recipe is `grad_norm(self, norm_type=2)`), every
  offloaded parameter's gradient is in `p.grad` as a plain loop holds it; afterwards `p.grad`
  is None again. Otherwise such a helper would read the GPU tail's gradients only (the rest
  left the device with their buckets) and log a fraction of the norm without a word.
* `EngineMetrics`: the engine's telemetry since the previous call as a flat dict of floats,
  named, scaled and defined by `telemetry.vocabulary` (the names the dashboard, the CLI,
  TensorBoard and the trace use): `superoffload/tokens_per_s`, `iteration_ms`,
  `d2h_gbps_busy` / `h2d_gbps_busy` (while moving), `d2h_gbps_wall` / `h2d_gbps_wall` (per
  iteration), `cpu_step_hidden_pct`, `device_idle_pct`, `exposed_optimizer_ms`, `rollbacks`...
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from superoffload.config import ConfigError, OffloadConfig
from superoffload.telemetry import vocabulary as vocab
from superoffload.telemetry.events import Span
from superoffload.telemetry.metrics import IterationMetrics, iteration_metrics
from superoffload.telemetry.window import window_values

METRIC_PREFIX = "superoffload/"
"""Key prefix of every logged engine metric (TensorBoard groups them under one heading);
after it, a `telemetry.vocabulary` name."""


def engine_config(
    config: OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    max_grad_norm: float | None,
    grad_accum_steps: int,
    names: tuple[str, str],
) -> OffloadConfig:
    """`config` with the framework's clipping (`max_grad_norm`, None or <= 0: off) and
    accumulation. `names` are the framework's names of the two settings, for error messages.
    A DeepSpeed-style dict is converted with `superoffload.from_deepspeed`; its `optimizer`
    section is refused (the framework's arguments set the hyperparameters)."""
    if config is None:
        base = OffloadConfig()
    elif isinstance(config, OffloadConfig):
        base = config
    elif isinstance(config, Mapping | str | os.PathLike):
        from superoffload import ds_keys
        from superoffload.ds_config import from_deepspeed

        # a copy of the dict, or a DeepSpeed JSON file's
        ds = ds_keys.read(config)[0]
        if "optimizer" in ds:
            raise ConfigError(
                "DeepSpeed config key 'optimizer': the training framework's own arguments set "
                "the learning rate, betas, eps and weight decay here; remove the section"
            )
        base, _ = from_deepspeed(ds)
    else:
        raise TypeError(f"offload config: pass an OffloadConfig or a DeepSpeed-style dict, not "
                        f"{type(config).__name__}")
    clip = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None
    ours = base.max_grad_norm if base.max_grad_norm else None
    if ours is not None and ours != clip:
        raise ConfigError(
            f"OffloadConfig.max_grad_norm={ours} contradicts {names[0]}={max_grad_norm}: the "
            f"engine clips with the framework's value; set {names[0]}={ours} and leave "
            "OffloadConfig.max_grad_norm unset"
        )
    if base.grad_accum_steps not in (1, grad_accum_steps):
        raise ConfigError(
            f"OffloadConfig.grad_accum_steps={base.grad_accum_steps} contradicts "
            f"{names[1]}={grad_accum_steps}: set {names[1]} and leave grad_accum_steps at 1"
        )
    return base.replace(max_grad_norm=clip, grad_accum_steps=int(grad_accum_steps))


def backward(engine: Any, loss: torch.Tensor) -> None:
    """`engine.backward` of a loss the framework already divided by the accumulation steps."""
    steps = engine.config.grad_accum_steps
    engine.backward(loss * steps if steps != 1 else loss)


@contextlib.contextmanager
def gradients_in_grad(engine: Any) -> Iterator[None]:
    """Put each offloaded parameter's gradient (`engine.full_grad`: unscaled, summed over
    the micro-steps, in the parameter's dtype and on its device) in `p.grad` for the duration,
    then set `p.grad` back to None. It costs those gradients' bytes on the device while it
    lasts. A gradient edited meanwhile (a manual clip) stays in `p.grad`, where `step()` finds
    it and refuses the edit as for any gradient (docs/failure_semantics.md). Before the last
    micro-step's backward there is nothing final to show: nothing is put."""
    from superoffload.runtime.contract import ContractError

    params = [p for p in engine.trainable_params() if p.grad is None]
    shown: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    try:
        for p in params:
            g = engine.full_grad(p)
            if g is not None:
                g = g.to(p.device, p.dtype)
                p.grad = g
                shown.append((p, g, g._version))
    except ContractError:
        # not the last micro-step: the gradients are not final yet
        pass
    try:
        yield
    finally:
        for p, g, version in shown:
            if p.grad is g and g._version == version:
                p.grad = None


def adam_hyper(group: Mapping[str, Any], *, adamw: bool) -> dict[str, Any]:
    """The engine's keys of one torch-style param group (lr, betas, eps, weight_decay)."""
    out = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    out["adamw_mode"] = adamw
    return out


class EngineMetrics:
    """The engine's metrics over the iterations completed since the previous `collect()`.

    Reads only public telemetry (`Recorder.spans_since`, `iteration_metrics`; the same
    definitions as the dashboard, the CLI and the HTML report, named by
    `telemetry.vocabulary`) and `engine.stats`. An iteration is reported once the next one
    has started (its window ends there), so a value lags one optimizer step. The figures
    pool the iterations completed since the previous call (`telemetry.window`; their count is
    `window_iterations`), as the dashboard and the CLI pool theirs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._seq = engine.telemetry.last_seq
        self._spans: list[Span] = []
        self._reported = -1
        self._tokens: dict[int, int] = {}

    def add_tokens(self, n: int) -> None:
        """Count the tokens of one micro-batch, for the iteration it trains (tokens/s)."""
        it = int(getattr(self.engine, "iteration", 0))
        self._tokens[it] = self._tokens.get(it, 0) + int(n)

    def collect(self) -> dict[str, float]:
        """Flat dict of floats, keys `METRIC_PREFIX` + a vocabulary name."""
        out: dict[str, float] = {}
        new, self._seq = self.engine.telemetry.spans_since(self._seq)
        self._spans.extend(new)
        if self._spans:
            newest = max(s.iteration for s in self._spans)
            done = [m for m in iteration_metrics(self._spans)
                    if self._reported < m.iteration < newest]
            # keep the newest iteration and the one before (its CPU work may end late)
            self._spans = [s for s in self._spans if s.iteration >= newest - 1]
            if done:
                self._reported = done[-1].iteration
                out.update(aggregate(done, {it: n for it, n in self._tokens.items()
                                            if done[0].iteration <= it <= done[-1].iteration}))
                self._tokens = {it: n for it, n in self._tokens.items() if it > self._reported}
        stats = self.engine.stats
        for name in ("rollbacks", "replays", "clipped_steps", "skipped_steps"):
            out[name] = float(getattr(stats, name))
        for name in ("grad_norm", "loss_scale"):
            last = self.last_scalar(name)
            if last is not None and math.isfinite(last):
                out[name] = last
        # names: the vocabulary's
        return {METRIC_PREFIX + vocab.metric(k).name: v for k, v in out.items()}

    def last_scalar(self, name: str) -> float | None:
        """The newest value of an engine scalar (`grad_norm`, `loss_scale`...), or None."""
        values = self.engine.telemetry.scalars(name)
        return float(values[-1].value) if values else None


def aggregate(done: list[IterationMetrics], tokens: Mapping[int, int]) -> dict[str, float]:
    """The vocabulary's figures over several complete iterations, pooled as every view pools
    them (`telemetry.window.window_values`: bytes over busy or wall seconds, hidden over all
    CPU step time, tokens over wall seconds), with `window_iterations`, the number pooled.
    Undefined figures (no bytes moved, no CPU work) are left out of the log."""
    values = window_values(done, tokens=sum(tokens.values()) or None)
    values["window_iterations"] = float(len(done))
    return {k: v for k, v in values.items() if math.isfinite(v)}
