"""so.CPUAdam as the inner optimizer of torchao's CPUOffloadOptimizer
(docs/distributed.md, "torchao's `CPUOffloadOptimizer`").

torchao 0.18.0 installs on torch 2.13's CPU wheel (``pip install --no-deps torchao``) and
imports, but ``CPUOffloadOptimizer.__init__`` asserts a CUDA or XPU device ("CPU Offload
currently only supports CUDA & XPU"), so it cannot run on this machine; the real test below
is marked ``cuda`` and skips without a GPU and torchao (it did not run in this session: no
GPU). What runs here is the contract torchao holds its inner
optimizer to, built the way its constructor builds it: one optimizer per parameter from
``optimizer_class([{"params": p_host, **group}], **kwargs)`` (a bare tensor as "params"), a
pinned host ``.grad`` allocated once and overwritten in place by ``copy_`` before each
``step()``, and ``state_dict()`` / ``load_state_dict()`` per inner optimizer. so.CPUAdam
must match torch.optim.AdamW built the same way: 1e-6 over 20 steps (measured 6.0e-8).

Not possible with torchao's wrapper, whatever the inner optimizer (docs/distributed.md,
"torchao"): FSDP2 DTensor parameters (it copies each ``p_device`` into a host tensor with
``empty_like(..., device="cpu")``; it is documented for single-GPU training) and DCP's
``get_optimizer_state_dict`` (its ``state_dict()`` is ``{"offloaded": [...], "on-device":
...}``, not torch.optim's ``{"state", "param_groups"}``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import superoffload as so

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}


def torchao_like(params: list[torch.nn.Parameter], cls: type) -> list[tuple[torch.Tensor, Any]]:
    """(host parameter, inner optimizer) per parameter, as CPUOffloadOptimizer builds them."""
    out = []
    for p in params:
        host = p.detach().clone()
        host.grad = torch.empty_like(host)
        out.append((host, cls([{"params": host, "weight_decay": HYPER["weight_decay"]}],
                              lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])))
    return out


def test_inner_optimizer_contract_matches_adamw() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 3), torch.nn.Tanh(), torch.nn.Linear(3, 5))
    ours = torchao_like(list(model.parameters()), so.CPUAdam)
    ref = torchao_like(list(copy.deepcopy(model).parameters()), torch.optim.AdamW)
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        for (h, _), (r, _) in zip(ours, ref):
            grad = torch.randn(h.shape, generator=g)
            h.grad.copy_(grad)  # the same .grad tensor every step, written in place
            r.grad.copy_(grad)
        for (_, opt), (_, ref_opt) in zip(ours, ref):
            opt.step()
            ref_opt.step()
        if step == 9:  # the wrapper's per-inner-optimizer checkpoint round trip
            for _, opt in ours:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    diff = max(float((h - r).abs().max()) for (h, _), (r, _) in zip(ours, ref))
    moved = max(float((r - p.detach()).abs().max()) for (r, _), p in zip(ref, model.parameters()))
    assert diff <= 1e-6
    assert moved > 0.05


@pytest.mark.cuda
def test_torchao_cpu_offload_optimizer_with_cpu_adam() -> None:
    """The real wrapper on one GPU: optimizer_class=so.CPUAdam vs torch.optim.AdamW."""
    if not torch.cuda.is_available():
        pytest.skip("torchao's CPUOffloadOptimizer needs CUDA or XPU")
    cpu_offload = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 256)).cuda()
    ref_model = copy.deepcopy(model)
    # minimal_size=0: every parameter goes through the inner (host) optimizer
    opt = cpu_offload.CPUOffloadOptimizer(model.parameters(), optimizer_class=so.CPUAdam,
                                          minimal_size=0, **HYPER)
    ref = cpu_offload.CPUOffloadOptimizer(ref_model.parameters(),
                                          optimizer_class=torch.optim.AdamW, fused=False,
                                          minimal_size=0, **HYPER)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(20):
        x = torch.randn(8, 256, device="cuda", generator=g)
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                         ref_model.parameters()))
    assert diff <= 1e-5  # the forward runs on the GPU: TF32-free fp32, gradients identical
