"""Reference training loops (plain PyTorch) and a matching engine driver for the tests.

Reference: bf16/fp16 weights + fp32 master copies + ``torch.optim.AdamW`` (or an fp32 model
with AdamW directly), ``clip_grad_norm_`` on the fp32 gradients, loss / accumulation steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import superoffload as so

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


def cpu_config(**overrides: Any) -> so.OffloadConfig:
    """The engine tests' base: CPU device ops, 4 KiB buckets (many buckets even for a tiny
    model), one optimizer thread; `overrides` win."""
    return so.OffloadConfig(**{"device": "cpu", "bucket_bytes": 4096, "cpu_threads": 1,
                               **overrides})


def groups_for(model: torch.nn.Module, two_groups: bool,
               hyper: dict[str, Any]) -> list[dict[str, Any]]:
    """Two groups split like GPT recipes: no weight decay for 1-D params, other LR too."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not two_groups:
        return [{"params": params, **hyper}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, **hyper},
        {"params": no_decay, **{**hyper, "weight_decay": 0.0, "lr": hyper["lr"] * 0.5}},
    ]


def train_reference(model: torch.nn.Module, data: list, *, steps: int, gas: int = 1,
                    max_norm: float | None = None, two_groups: bool = False,
                    hyper: dict[str, Any] = HYPER, sched: Any = None,
                    during: Any = None, sum_fp32: bool = False) -> dict[str, torch.Tensor]:
    """Returns fp32 master weights by name. A step with a non-finite gradient is skipped
    (no moment update, no step count), as the engine does on overflow. ``sum_fp32``: a
    low-precision model's micro-step gradients are summed in fp32 (host accumulation), not
    in ``.grad``'s own dtype."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    lp = params[0].dtype != torch.float32
    master = {id(p): (p.detach().float().clone().requires_grad_() if lp else p) for p in params}
    groups = [{**g, "params": [master[id(p)] for p in g["params"]]}
              for g in groups_for(model, two_groups, hyper)]
    opt = torch.optim.AdamW(groups)
    scheduler = sched(opt) if sched else None
    it = iter(data)
    for step in range(steps):
        if during is not None:
            max_norm = during(None, step) or max_norm
        sums: dict[int, torch.Tensor] = {}
        for _ in range(gas):
            x, y = next(it)
            (model(x, y) / gas).backward()
            if sum_fp32:
                for p in params:
                    if p.grad is not None:
                        sums[id(p)] = sums.get(id(p), 0) + p.grad.float()
                        p.grad = None
        if lp or sum_fp32:
            for p in params:
                g = sums.get(id(p)) if sum_fp32 else p.grad
                master[id(p)].grad = None if g is None else g.float()
        grads = [master[id(p)].grad for p in params if master[id(p)].grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if max_norm and finite:
            torch.nn.utils.clip_grad_norm_([master[id(p)] for p in params], max_norm)
        if finite:
            opt.step()
        if scheduler:
            scheduler.step()
        with torch.no_grad():
            for p in params:
                if lp:
                    p.copy_(master[id(p)])
                p.grad = None
                master[id(p)].grad = None
    return {names[id(p)]: master[id(p)].detach().clone() for p in params}


def train_engine(model: torch.nn.Module, data: list, config: so.OffloadConfig, *, steps: int,
                 two_groups: bool = False, hyper: dict[str, Any] = HYPER, sched: Any = None,
                 inline: bool = False, during: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """Train with the engine; returns (master weights by name, engine stats)."""
    groups = groups_for(model, two_groups, hyper)
    with so.initialize(model, groups, config, inline=inline) as engine:
        scheduler = sched(engine.optimizer) if sched else None
        it = iter(data)
        for step in range(steps):
            if during is not None:
                during(engine, step)
            for _ in range(config.grad_accum_steps):
                x, y = next(it)
                engine.backward(model(x, y))
                engine.step()
            engine.zero_grad()
            if scheduler:
                scheduler.step()
        weights = engine.master_weights()
        stats = copy.copy(engine.stats)
    return weights, stats


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
