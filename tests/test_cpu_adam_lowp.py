"""so.CPUAdam as a drop-in for bf16/fp16 CPU models, checked on the cases DeepSpeed's
own CPU Adam unit tests use (sizes 64, 22, 128, 1024 and 2^20; fp16, bf16 and fp32
parameters; 10 steps of N(0,1) gradients in the parameter's dtype; the parameter norm within
1% of torch.optim.AdamW's; bf16 optimizer states within 5% of fp32 ones), and on stricter
ones: the fp32 master equals torch AdamW run on an fp32 copy to fp32 rounding, and the
low-precision parameter is exactly the master rounded to its dtype.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import superoffload as so

SIZES = [64, 22, 128, 1024, 1048576]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float32, id="fp32")]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _norm_close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """DeepSpeed's check: |norm(a) - norm(b)| <= rel * norm(a)."""
    na, nb = float(a.detach().float().norm()), float(b.detach().float().norm())
    return abs(na - nb) <= rel * na


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_deepspeed_cases_against_torch_adamw(size, dtype):
    torch.manual_seed(size)
    data = torch.randn(size).to(dtype)
    ours = torch.nn.Parameter(data.clone())
    ref = torch.nn.Parameter(data.clone())  # torch steps the low-precision tensor itself
    ref32 = torch.nn.Parameter(data.float())  # what a master-weight optimizer should hold
    opt = so.CPUAdam([ours], **HP)
    ref_opt = torch.optim.AdamW([ref], **HP)
    ref32_opt = torch.optim.AdamW([ref32], **HP)
    for _ in range(10):
        g = torch.randn(size).to(dtype)
        ours.grad, ref.grad, ref32.grad = g.clone(), g.clone(), g.float()
        opt.step()
        ref_opt.step()
        ref32_opt.step()
    assert ours.dtype == dtype
    if dtype != torch.float16:  # torch AdamW's fp16 moments reach inf on the CPU (DeepSpeed
        assert _norm_close(ours, ref, 1e-2)  # skips the case too); its tolerance otherwise
    master = opt.state[ours].get("master_param", ours.detach())
    assert master.dtype == torch.float32
    # stricter: the master is fp32 AdamW to a few fp32 roundings of 10 steps of lr 1e-3
    assert torch.allclose(master, ref32.detach(), rtol=0, atol=2e-6)
    # and the parameter is the master rounded to nearest even, bit for bit
    assert torch.equal(ours.detach(), master.to(dtype))
    # moments to fp32 rounding of their operands (|g| ~ 1: m can cancel to ~0, so absolute)
    for key, atol in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-8)):
        assert opt.state[ours][key].dtype == torch.float32
        assert torch.allclose(opt.state[ours][key], ref32_opt.state[ref32][key], rtol=1e-5,
                              atol=atol)


@pytest.mark.parametrize("size", [64, 1024])
def test_bf16_optimizer_states_like_deepspeed(size):
    """fp32_optimizer_states=False (DeepSpeed's name) = moment_dtype=torch.bfloat16: bf16
    moments with stochastic rounding, within 5% of the fp32-state run's norm (DeepSpeed's
    band) and, stricter, 1% of the distance the parameters moved."""
    torch.manual_seed(0)
    base = torch.randn(size).to(torch.bfloat16)
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt_a = so.CPUAdam([a], fp32_optimizer_states=True)
    opt_b = so.CPUAdam([b], fp32_optimizer_states=False)
    for _ in range(10):
        g = torch.randn(size).to(torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a.state[a]["exp_avg"].dtype == torch.float32
    assert opt_b.state[b]["exp_avg"].dtype == torch.bfloat16
    assert opt_b.state[b]["exp_avg_sq"].dtype == torch.bfloat16
    assert opt_b.state[b]["master_param"].dtype == torch.float32
    assert _norm_close(a, b, 5e-2)
    moved = (opt_a.state[a]["master_param"] - base.float()).abs().mean()
    drift = (opt_a.state[a]["master_param"] - opt_b.state[b]["master_param"]).abs().mean()
    assert float(drift) < 0.01 * float(moved)
    with pytest.raises(ValueError, match="contradicts"):
        so.CPUAdam([a], moment_dtype=torch.float32, fp32_optimizer_states=False)
    with pytest.raises(TypeError, match="moment_dtype"):
        so.CPUAdam([a], moment_dtype=torch.float16)


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.GELU(),
                               torch.nn.Linear(129, 5)).to(dtype)


def _train(model, opt, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(16, 37, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trips_the_masters(moment_dtype):
    model = _model(torch.bfloat16)
    opt = so.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1, moment_dtype=moment_dtype)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    twin = _model(torch.bfloat16, seed=7)
    twin.load_state_dict(saved["model"])
    opt2 = so.CPUAdam(twin.parameters(), lr=1e-2, weight_decay=0.1)  # dtype comes from the dict
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), twin.parameters()):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == opt.state[p][key].dtype  # not cast to bf16
            assert torch.equal(opt2.state[q][key], opt.state[p][key])
            assert opt2.state[q][key].data_ptr() != opt.state[p][key].data_ptr()
    _train(model, opt, 2, seed=9)
    _train(twin, opt2, 2, seed=9)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
        assert float(opt2.state[q]["step"]) == 5.0


def test_loads_a_torch_adamw_state_of_a_bf16_model():
    """torch AdamW on a bf16 model keeps bf16 moments and no master: CPUAdam widens the
    moments (exactly) and starts the master from the parameter."""
    model = _model(torch.bfloat16)
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train(ref, torch_opt, 4)
    model.load_state_dict(ref.state_dict())
    opt = so.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt.load_state_dict(torch_opt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        st, ref_st = opt.state[p], torch_opt.state[q]
        assert st["exp_avg"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], ref_st["exp_avg"].float())
        assert torch.equal(st["master_param"], p.detach().float())
        assert float(st["step"]) == 4.0
    _train(model, opt, 3, seed=2)
    _train(ref, torch_opt, 3, seed=2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _norm_close(p, q, 1e-2)
    # and the other way: torch AdamW loads CPUAdam's state (it casts to the param dtype)
    torch_opt.load_state_dict(opt.state_dict())
    assert torch_opt.state[next(ref.parameters())]["exp_avg"].dtype == torch.bfloat16


def test_mixed_dtype_group_and_rollback():
    """fp32, bf16 and fp16 parameters in one group (three kernel calls), fp16 gradients
    widened; rollback restores masters and moments and rewrites the copies."""
    p32 = torch.nn.Parameter(torch.randn(300))
    p16 = torch.nn.Parameter(torch.randn(301).half())
    pbf = torch.nn.Parameter(torch.randn(302).bfloat16())
    params = [p32, p16, pbf]
    opt = so.CPUAdam(params, lr=1e-2, weight_decay=0.1)
    refs = [torch.nn.Parameter(p.detach().double()) for p in params]
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        for p, r in zip(params, refs):
            g = torch.randn(p.numel()).to(p.dtype)
            p.grad, r.grad = g, g.double()
        if step == 3:
            snap = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
            snap_p = [p.detach().clone() for p in params]
        opt.step()
        if step < 3:
            ref_opt.step()
    opt.rollback()
    for p, was, r in zip(params, snap_p, refs):
        st = opt.state[p]
        master = st.get("master_param", p.detach())
        assert torch.allclose(master.double(), r.detach(), rtol=0, atol=1e-5)
        assert torch.allclose(master, snap[id(p)].get("master_param", was), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), master.to(p.dtype))
        assert float(st["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(st[key], snap[id(p)][key], rtol=1e-5, atol=1e-6)


def test_cache_is_rebuilt_when_tensors_change():
    """The prepared kernel calls are reused across steps and rebuilt when a parameter is
    re-pointed, loses its gradient, or a state tensor is replaced: each step still equals
    torch AdamW on the same history."""
    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (100, 200, 300)]
    refs = [torch.nn.Parameter(p.detach().double()) for p in ps]
    opt = so.CPUAdam(ps, **HP)
    ref_opt = torch.optim.AdamW(refs, **HP)

    def step(with_grad=(True, True, True)):
        for p, r, on in zip(ps, refs, with_grad):
            g = torch.randn(p.numel()) if on else None
            p.grad, r.grad = g, None if g is None else g.double()
        opt.step()
        ref_opt.step()

    step()
    batch = opt._cache[0].batches[0]
    step()
    assert opt._cache[0].batches[0] is batch  # reused
    ps[1].data = ps[1].data.clone()  # re-pointed
    step()
    assert opt._cache[0].batches[0] is not batch
    step(with_grad=(True, False, True))  # p1 untouched, the others step
    opt.state[ps[0]]["exp_avg"] = opt.state[ps[0]]["exp_avg"].clone()  # replaced by hand
    step()
    opt.state[ps[2]]["step"] = torch.tensor(float(opt.state[ps[2]]["step"]))  # replaced
    step()
    for p, r in zip(ps, refs):
        assert torch.allclose(p.detach().double(), r.detach(), rtol=0, atol=2e-6)
        assert float(opt.state[p]["step"]) == float(ref_opt.state[r]["step"])


def test_step_counts_are_per_parameter_views():
    p, q = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = so.CPUAdam([p, q])
    for _ in range(2):
        p.grad, q.grad = torch.randn(10), torch.randn(10)
        opt.step()
    assert float(opt.state[p]["step"]) == float(opt.state[q]["step"]) == 2.0
    opt.state[p]["step"].fill_(7.0)  # edited in place: the next step splits the batch
    p.grad, q.grad = torch.randn(10), torch.randn(10)
    opt.step()
    assert float(opt.state[p]["step"]) == 8.0 and float(opt.state[q]["step"]) == 3.0
