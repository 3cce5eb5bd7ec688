"""rollback="auto": the inverse is used only within its error bound (docs/engine.md, "The default
rollback").

* The bound B(rho) of runtime/auto_rollback.py is checked against the kernel: step, invert,
  and the restored moments' effect on the next update stays below B(rho) element by element.
* The default configuration of every entry point matches AdamW + clip_grad_norm_ within
  1e-5 relative (max |diff| / max |w| over the fp32 masters after 20 steps) for clip ratios
  1 to 1e6 and max_grad_norm down to 1e-4; measured ~1.2e-7 (the fp32 op order). The
  unguarded inverse is shown to miss the same bound (so the tests can fail).
"""

from __future__ import annotations

import math

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload import kernels
from superoffload.config import ConfigError
from superoffload.kernels import AdamHyper
from superoffload.runtime.auto_rollback import (
    INVERSE_TOLERANCE,
    inverse_bound,
    rho_limit,
    risky,
)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 20
TOL = 1e-5


# ---------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.9)])
def test_rho_limit_is_where_the_bound_meets_the_tolerance(betas):
    lim = rho_limit(*betas)
    assert lim > 0
    assert inverse_bound(lim, *betas) == pytest.approx(INVERSE_TOLERANCE, rel=1e-5)
    assert inverse_bound(lim * 1.01, *betas) > INVERSE_TOLERANCE


def test_no_bound_once_v_is_lost_to_rounding():
    assert inverse_bound(1e8, 0.9, 0.999) == math.inf


def test_no_inverse_for_zero_betas():
    assert rho_limit(0.0, 0.999) == 0.0 and rho_limit(0.9, 0.0) == 0.0


@pytest.mark.parametrize("log_rho", [-2, 0, 2, 4, 6])
def test_kernel_inverse_stays_within_the_bound(log_rho):
    """Elements with |m| <= sqrt(v) and g set so that rho = 10**log_rho (spread x3 around it):
    after step + inverse, |m_r/sqrt(v_r) - m/sqrt(v)| <= B(rho) for every element."""
    b1, b2 = 0.9, 0.999
    n = 1 << 14
    gen = torch.Generator().manual_seed(log_rho + 10)
    v = torch.rand(n, generator=gen, dtype=torch.float64).add_(0.5) * 1e-6
    m = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * v.sqrt()
    spread = torch.empty(n, dtype=torch.float64).uniform_(-1.1, 1.1, generator=gen)
    rho = 10.0**log_rho * torch.exp(spread)
    sign = torch.sign(torch.randn(n, generator=gen, dtype=torch.float64))
    g = torch.sqrt(rho * b2 * v / (1 - b2)) * sign
    p = torch.randn(n, generator=gen, dtype=torch.float64)
    p32, m32, v32, g32 = (x.float() for x in (p, m, v, g))
    m0, v0 = m32.double(), v32.double()
    rho32 = (1 - b2) * g32.double() ** 2 / (b2 * v0)
    hp = dict(step=7, lr=1e-3, beta1=b1, beta2=b2, eps=1e-12, weight_decay=0.1)
    kernels.adam_step(p32, g32, m32, v32, **hp)
    kernels.adam_rollback(p32, g32, m32, v32, **hp)
    err = (m32.double() / v32.double().sqrt() - m0 / v0.sqrt()).abs()
    bound = torch.tensor([inverse_bound(float(r), b1, b2) for r in rho32])
    assert bool((err <= bound).all()), float((err / bound).max())
    # and the bound is not vacuous: the worst element uses a good share of it at large rho
    if log_rho >= 4:
        assert float((err / bound).max()) > 0.05


def test_risky_finds_exactly_the_elements_beyond_the_limit():
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    limit = rho_limit(0.9, 0.999)
    v = torch.full((1000,), 1e-6)
    m = torch.zeros(1000)
    g = torch.full((1000,), 1e-5)  # rho = 1e-3*1e-10/(0.999*1e-6) ~ 1e-7
    g[[3, 500, 999]] = 1.0          # rho ~ 1e3
    v[[10, 11]] = 0.0               # v = m = 0: exact, not risky
    g[[10, 11]] = 1.0
    m[11] = 1e-3                    # m != 0 with v = 0: risky
    p = torch.zeros(1000)
    idx = risky(g, p, m, v, hyper=hyper, grad_scale=1.0, limit=limit)
    assert idx is not None and sorted(idx.tolist()) == [3, 11, 500, 999]
    assert risky(g * 1e-6, p, m, v.clamp_min(1e-6), hyper=hyper, grad_scale=1.0,
                 limit=limit) is None


# ---------------------------------------------------------------------------- training
class Scaled(torch.nn.Module):
    """The loss times ``k``: gradients k times larger, clip ratio ~k."""

    def __init__(self, model: torch.nn.Module, k: float, spike: float = 0.0) -> None:
        super().__init__()
        self.model, self.k, self.spike = model, k, spike

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y) * self.k
        if self.spike:  # one parameter's gradient dwarfs the rest: c tiny for every bucket
            loss = loss + self.spike * self.model.ln_f.bias.sum()
        return loss


def rel_diff(ref, got):
    return max_diff(ref, got) / max(float(v.abs().max()) for v in ref.values())


def pair(config, *, k=1.0, clip=1.0, spike=0.0, hyper=HYPER):
    data = batches(STEPS)
    ref = train_reference(Scaled(make_model(), k, spike), data, steps=STEPS, max_norm=clip,
                          hyper=hyper)
    got, stats = train_engine(Scaled(make_model(), k, spike), data, config.replace(
        max_grad_norm=clip), steps=STEPS, hyper=hyper)
    return rel_diff(ref, got), stats


@pytest.mark.parametrize("k,clip", [(1.0, 1.0), (1e3, 1.0), (1e6, 1.0), (1.0, 1e-3), (1.0, 1e-4)])
def test_default_matches_adamw_with_clipping(k, clip):
    rel, stats = pair(cpu_config(), k=k, clip=clip)
    assert stats.clipped_steps > 0
    assert rel < TOL, rel


def test_unguarded_inverse_misses_the_bound_where_auto_holds():
    """The same heavy clipping with rollback="inverse": the error the guard prevents."""
    rel, _ = pair(cpu_config(rollback="inverse"), k=1e3, clip=1.0)
    assert rel > 10 * TOL, rel


def test_one_huge_gradient_small_buckets_are_rescued_or_declined():
    """One bias gets a gradient ~1e4 larger than everything else: every other bucket is under
    max_grad_norm alone, is speculated, and is replayed with c ~1e-4 (rho of the history
    built from clipped gradients ~1e5): the guard keeps those elements (or declines)."""
    rel, stats = pair(cpu_config(), k=1.0, clip=1.0, spike=1e4)
    assert stats.speculated_buckets > 0 and stats.rollbacks > 0 and stats.guarded_elements > 0
    assert rel < TOL, rel
    rel_inverse, _ = pair(cpu_config(rollback="inverse"), k=1.0, clip=1.0, spike=1e4)
    assert rel_inverse > rel


@pytest.mark.parametrize("make", [
    lambda: so.OffloadConfig(device="cpu"),
    lambda: so.presets.tiny_cpu(),
    lambda: so.presets.gh200().replace(device="cpu"),
    lambda: so.presets.pcie_host().replace(device="cpu"),
], ids=["OffloadConfig", "tiny_cpu", "gh200", "pcie_host"])
def test_every_preset_default_matches_under_heavy_clipping(make):
    rel, stats = pair(make().replace(cpu_threads=1), k=1e3, clip=1.0)
    assert stats.clipped_steps == STEPS
    assert rel < TOL, rel


def test_deepspeed_dict_default_matches_under_heavy_clipping():
    data = batches(STEPS)
    ref = train_reference(Scaled(make_model(), 1e3), data, steps=STEPS, max_norm=1.0)
    model = Scaled(make_model(), 1e3)
    ds = {"gradient_clipping": 1.0, "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW",
                        "params": {"lr": HYPER["lr"], "betas": list(HYPER["betas"]),
                                   "weight_decay": HYPER["weight_decay"],
                                   "eps": HYPER["eps"]}}}
    with so.initialize(model, None, ds) as engine:
        assert engine.config.rollback == "auto"
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got = engine.master_weights()
    assert rel_diff(ref, got) < TOL


@pytest.mark.parametrize("betas", [(0.0, 0.95), (0.9, 0.0)])
def test_zero_betas_with_clipping_train_under_auto(betas):
    hyper = {**HYPER, "betas": betas, "eps": 1e-3}  # b2 = 0 with eps 1e-8 is chaotic in torch too
    rel, stats = pair(cpu_config(), k=1e2, clip=1.0, hyper=hyper)
    assert rel < TOL and stats.rollbacks == 0


@pytest.mark.parametrize("betas", [(0.0, 0.95), (0.9, 0.0)])
def test_zero_betas_refuse_the_unguarded_inverse_at_initialize(betas):
    with pytest.raises(ConfigError, match="rollback"):
        so.initialize(make_model(), {**HYPER, "betas": betas},
                      cpu_config(rollback="inverse", max_grad_norm=1.0))


def test_bound_formula_matches_its_documented_limit():
    """docs/engine.md quotes rho_limit ~5.3 for betas (0.9, 0.999): keep the doc true."""
    assert math.isclose(rho_limit(0.9, 0.999), 5.3, rel_tol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_precheck_counts_exactly_what_torch_counts(dtype, threads):
    """cext/so_guard.c against the fp32 torch formula: odd lengths, an empty tensor, several
    tensors, v = 0 elements, both gradient dtypes and thread counts (exact counts)."""
    if kernels.backend() != "cffi":
        pytest.skip("the compiled kernel is not built (SUPEROFFLOAD_KERNEL=torch?)")
    from superoffload.kernels import torch_ref

    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1, 7, 4099, (1 << 17) + 3]
    grads = [(torch.randn(n, generator=gen) * 10).to(dtype) for n in sizes]
    vs = [torch.rand(n, generator=gen) * 50 for n in sizes]
    vs[3][::5] = 0.0
    for gs, c in ((1.0, 1.0), (0.1, 3.0), (2.5, 0.7)):
        want = torch_ref.rollback_risk_multi(grads, vs, grad_scale=gs, c_v=c)
        got = kernels.rollback_risk_multi(grads, vs, grad_scale=gs, c_v=c, threads=threads)
        assert got == want and 0 < want < sum(sizes)


def test_rescued_elements_refresh_the_host_bf16_copy():
    """A bf16 model with host casting (the kernel writes the bf16 copy the H2D sends): after
    replays over kept elements, every device weight is exactly bf16(master)."""
    model = Scaled(make_model(dtype=torch.bfloat16), 1.0, spike=1e4)
    cfg = cpu_config(max_grad_norm=1.0, grad_cast="host", param_cast="host")
    with so.initialize(model, dict(HYPER), cfg) as engine:
        for x, y in batches(8):
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
        assert engine.stats.guarded_elements > 0 and engine.stats.rollbacks > 0
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("dense", [False, True])
def test_rescue_restore_writes_every_kept_value_back(dense):
    """Rescue.restore by itself: p, m, v and the low-precision copy of each kept element get
    their pre-step values back (whole runs when dense), and nothing else is touched."""
    from superoffload.runtime.auto_rollback import Rescue

    gen = torch.Generator().manual_seed(5)
    p, m, v, g = (torch.randn(1000, generator=gen) for _ in range(4))
    lp = p.to(torch.bfloat16)
    before = [t.clone() for t in (p, m, v, lp)]
    idx = torch.tensor([0, 17, 999])
    rescue = Rescue.keep([(p, m, v, g, lp)], [idx], dense=dense)
    for t in (p, m, v):
        t.add_(1.0)          # what a step and an inexact inverse might leave
    lp.copy_(p)
    rescue.restore()
    touched = torch.arange(1000) if dense else idx
    for t, b in zip((p, m, v, lp), before):
        assert torch.equal(t[touched], b[touched])
    if not dense:
        assert torch.equal(lp[1:17], (before[0][1:17] + 1.0).to(torch.bfloat16))
