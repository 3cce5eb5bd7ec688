"""Every flag of torch.optim.AdamW is honoured or refused with the supported way, on every
entry point (kernels/hyper.py; docs/kernel.md, "torch.optim flags").

The flags come from torch.optim.AdamW's own ``defaults`` (a flag a newer torch adds fails
``test_every_torch_adamw_flag_is_classified``). ``maximize`` is checked by value against
torch.optim.AdamW/Adam(maximize=True) in float64 (kernels) and fp32 (engine, CPUAdam,
Lightning, Trainer); ``amsgrad``/``capturable``/``differentiable`` are refused with a message
naming the way, before anything is applied; ``foreach``/``fused`` run our kernels unchanged.
Entry points: the kernels, ``so.CPUAdam`` (constructor, groups, ``add_param_group``, a group
edited mid-run, ``load_state_dict`` of torch's state), ``so.initialize`` (a dict, torch-style
groups, ``add_param_group``, ``engine.optimizer.param_groups`` edited mid-run).
Lightning and Trainer: tests/test_torch_flags_integrations.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.kernels import torch_ref
from superoffload.kernels.hyper import FLAGS, HYPER_KEYS, torch_flag_keys

pytestmark = pytest.mark.usefixtures("one_thread")
REFUSED = sorted(k for k, f in FLAGS.items() if f.handling == "refused")
ACCEPTED = sorted(k for k, f in FLAGS.items() if f.handling == "accepted")
DATA = batches(6)


def test_every_torch_adamw_flag_is_classified():
    """Read from torch itself: a flag a newer torch adds must get a row in FLAGS."""
    p = torch.zeros(1, requires_grad=True)
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        flags = set(cls([p]).defaults) - HYPER_KEYS
        assert flags <= set(FLAGS), f"{cls.__name__} flags without a row: {flags - set(FLAGS)}"
    assert set(FLAGS) <= torch_flag_keys()  # and no stale row
    assert {"maximize", "amsgrad", "foreach", "fused", "capturable", "differentiable"} <= set(FLAGS)


def test_a_flag_superoffload_does_not_know_is_refused_away_from_its_default(monkeypatch):
    from superoffload.kernels import hyper

    monkeypatch.setattr(hyper, "torch_group_defaults",
                        lambda: {"lr": 1e-3, "newflag": False})
    so.kernels.AdamHyper.from_group({"newflag": False})
    with pytest.raises(ValueError, match="'newflag'.*leave it at its default False"):
        so.kernels.AdamHyper.from_group({"newflag": True}, "g")


# ------------------------------------------------------------------ the kernels, float64
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("backend", ["cffi", "torch"])
def test_maximize_steps_like_torch_in_float64(adamw, backend):
    gen = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(512, generator=gen), torch.randn(4, 512, generator=gen)
    p = p0.double().clone().requires_grad_()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=True)
    q, m, v = p0.clone(), torch.zeros(512), torch.zeros(512)
    step = so.kernels.adam_step_multi if backend == "cffi" else torch_ref.adam_step_multi
    for k, g in enumerate(grads):
        p.grad = g.double()
        opt.step()
        step([q], [g], [m], [v], step=k + 1, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
             weight_decay=0.1, adamw_mode=adamw, maximize=True, grad_scale=0.5 * 2)
    st = opt.state[p]
    # fp32 against float64 over 4 steps (measured 7.6e-7 on p, 5.4e-8 on m ~ 0.2, the same
    # as without maximize): a few ulps
    assert torch.allclose(q.double(), p.detach(), rtol=0, atol=2e-6)
    assert torch.allclose(m.double(), st["exp_avg"], rtol=1e-6, atol=1e-7)
    assert torch.allclose(v.double(), st["exp_avg_sq"], rtol=1e-6, atol=1e-10)
    # and the inverse undoes a maximizing step: the same sign flip
    before = (q.clone(), m.clone(), v.clone())
    step([q], [grads[0]], [m], [v], step=5, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
         weight_decay=0.1, adamw_mode=adamw, maximize=True)
    rollback = (so.kernels.adam_rollback_multi if backend == "cffi"
                else torch_ref.adam_rollback_multi)
    rollback([q], [grads[0]], [m], [v], step=5, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
             weight_decay=0.1, adamw_mode=adamw, maximize=True)
    for a, b in zip((q, m, v), before):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bias_correction", [True, False], ids=["fused", "foreach"])
def test_device_step_maximize_matches_torch(bias_correction):
    """The GPU tail's step (torch's fused op, or the foreach fallback), here on the CPU."""
    gen = torch.Generator().manual_seed(1)
    p0, grads = torch.randn(300, generator=gen), torch.randn(3, 300, generator=gen)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, maximize=True)
    p, m, v = p0.clone(), torch.zeros(300), torch.zeros(300)
    for k, g in enumerate(grads):
        ref.grad = g.clone()
        opt.step()
        so.kernels.device_adam_multi([p], [g], [m], [v], step=k + 1, lr=1e-2, beta1=0.9,
                                     beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=True,
                                     bias_correction=True)
    assert torch.allclose(p, ref.detach(), atol=1e-6)
    if not bias_correction:  # the foreach path agrees with the fused one
        q, m2, v2 = p0.clone(), torch.zeros(300), torch.zeros(300)
        for k, g in enumerate(grads):
            so.kernels.device_adam_multi([q], [g], [m2], [v2], step=k + 1, lr=1e-2, beta1=0.9,
                                         beta2=0.999, eps=1e-8, weight_decay=0.1,
                                         maximize=True, bias_correction=False)
        r, m3, v3 = p0.clone(), torch.zeros(300), torch.zeros(300)
        for k, g in enumerate(grads):
            so.kernels.adam_step(r, g, m3, v3, step=k + 1, lr=1e-2, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.1, maximize=True,
                                 bias_correction=False)
        assert torch.allclose(q, r, atol=1e-6)


# ------------------------------------------------------------------ so.CPUAdam
def _cpu_adam_run(opt_factory, *, edit=None, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = opt_factory(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for k in range(steps):
        if edit is not None:
            edit(k, opt)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["constructor", "group", "add_param_group", "mid_run"])
def test_cpu_adam_maximize_matches_torch_everywhere(how):
    kw = dict(lr=1e-2, weight_decay=0.1)

    def torch_opt(model):
        return torch.optim.AdamW(model.parameters(), **kw, maximize=how != "mid_run")

    def ours(model):
        if how == "constructor":
            return so.CPUAdam(model.parameters(), **kw, maximize=True)
        if how == "group":
            return so.CPUAdam([{"params": [model.weight], "maximize": True},
                               {"params": [model.bias], "maximize": True}], **kw)
        if how == "add_param_group":
            opt = so.CPUAdam([model.weight], **kw, maximize=True)
            opt.add_param_group({"params": [model.bias], "maximize": True})
            return opt
        return so.CPUAdam(model.parameters(), **kw)

    def edit(k, opt):
        if how == "mid_run" and k == 2:
            opt.param_groups[0]["maximize"] = True

    want = _cpu_adam_run(torch_opt, edit=edit)
    got = _cpu_adam_run(ours, edit=edit)
    assert max_diff(want, got) < 1e-6
    assert max_diff(_cpu_adam_run(lambda m: so.CPUAdam(m.parameters(), **kw)), want) > 1e-3


@pytest.mark.parametrize("flag", REFUSED)
def test_cpu_adam_refuses_each_flag_everywhere_naming_the_way(flag):
    model = torch.nn.Linear(4, 2)
    why = re.escape(FLAGS[flag].note)  # the message names the supported way
    with pytest.raises(ValueError, match=f"'{flag}'.*{why}"):
        so.CPUAdam(model.parameters(), **{flag: True})
    with pytest.raises(ValueError, match=flag):
        so.CPUAdam([{"params": model.parameters(), flag: True}])
    opt = so.CPUAdam([model.weight])
    with pytest.raises(ValueError, match=flag):
        opt.add_param_group({"params": [model.bias], flag: True})
    assert len(opt.param_groups) == 1
    # mid-run, in the second group: the step raises before the first group moves
    opt = so.CPUAdam([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1][flag] = True
    with pytest.raises(ValueError, match=rf"param_groups\[1\]\['{flag}'\]"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.param_groups[1][flag] = False
    opt.step()  # and training goes on


@pytest.mark.parametrize("flag", ACCEPTED)
def test_cpu_adam_accepts_implementation_flags_with_the_same_result(flag):
    base = _cpu_adam_run(lambda m: so.CPUAdam(m.parameters(), lr=1e-2))
    for value in (True, False, None):
        got = _cpu_adam_run(lambda m, v=value: so.CPUAdam(m.parameters(), lr=1e-2,
                                                           **{flag: v}))
        assert max_diff(base, got) == 0.0


def test_cpu_adam_loads_torch_adamw_state_with_its_flags():
    """maximize from a torch state dict is honoured; amsgrad refused with nothing loaded."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, maximize=True)
    model(torch.randn(4, 8)).sum().backward()
    ref.step()
    opt = so.CPUAdam(model.parameters(), lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["maximize"] is True
    ams = torch.optim.AdamW(model.parameters(), lr=5e-2, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(ams.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["maximize"] is True


# ------------------------------------------------------------------ the engine
def _reference(steps, *, maximize_from=0, two_groups=False):
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    if two_groups:  # maximize in the first group only
        groups = [{"params": params[::2], "maximize": True}, {"params": params[1::2]}]
    else:
        groups = [{"params": params}]
    opt = torch.optim.AdamW(groups, **HYPER)
    for k in range(steps):
        if k == maximize_from and not two_groups:
            opt.param_groups[0]["maximize"] = True
        model(*DATA[k]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _engine(optimizer, steps, *, between=None, plain=False):
    model = make_model()
    if callable(optimizer):
        optimizer = optimizer(model)
    with so.initialize(model, optimizer, cpu_config(ratio=0.5)) as engine:
        for k in range(steps):
            if between is not None:
                between(k, engine)
            if plain:
                model(*DATA[k]).backward()
            else:
                engine.backward(model(*DATA[k]))
            engine.step()
            engine.zero_grad()
        return engine.master_weights()


def test_engine_maximize_from_a_dict_and_from_torch_style_groups():
    want = _reference(4)
    assert max_diff(_engine({**HYPER, "maximize": True, "foreach": True, "fused": False},
                            4), want) < 1e-5

    def groups(model):
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": params[::2], **HYPER, "maximize": True},
                {"params": params[1::2], **HYPER}]

    assert max_diff(_engine(groups, 4), _reference(4, two_groups=True)) < 1e-5


@pytest.mark.parametrize("plain", [False, True], ids=["engine.backward", "loss.backward"])
def test_engine_maximize_set_mid_run_takes_effect_at_the_next_step(plain):
    def between(k, engine):
        if k == 2:
            engine.optimizer.param_groups[0]["maximize"] = True

    got = _engine(HYPER, 5, between=between, plain=plain)
    assert max_diff(got, _reference(5, maximize_from=2)) < 1e-5
    assert max_diff(got, _reference(5, maximize_from=99)) > 1e-3


@pytest.mark.parametrize("flag", REFUSED)
def test_engine_refuses_each_flag_at_every_entry_point(flag):
    model = make_model()
    with pytest.raises(ValueError, match=rf"optimizer\['{flag}'\]=True: {flag}=True"):
        so.initialize(model, {**HYPER, flag: True}, cpu_config())
    params = list(model.parameters())
    with pytest.raises(ValueError, match=rf"optimizer\[1\]\['{flag}'\]"):
        so.initialize(model, [{"params": params[:2]}, {"params": params[2:], flag: True}],
                      cpu_config())
    with so.initialize(model, [{"params": params[:2], **HYPER}], cpu_config()) as engine:
        with pytest.raises(ValueError, match=flag):
            engine.optimizer.add_param_group({"params": params[2:], flag: True})
        assert len(engine.optimizer.param_groups) == 1


@pytest.mark.parametrize("plain", [False, True], ids=["engine.backward", "loss.backward"])
def test_engine_flag_set_mid_run_is_refused_before_anything_is_applied(plain):
    """amsgrad=True written into engine.optimizer.param_groups: the next step raises with the
    weights untouched; set back, training continues exactly as if it had never been set."""
    seen = {}

    def between(k, engine):
        if k != 2:
            return
        model = engine.model
        before = engine.master_weights()
        engine.optimizer.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\]=True.*amsgrad=False"):
            if plain:
                model(*DATA[k]).backward()
            else:
                engine.backward(model(*DATA[k]))
            engine.step()
        engine.zero_grad()
        seen["unchanged"] = max_diff(before, engine.master_weights())
        engine.optimizer.param_groups[0]["amsgrad"] = False

    got = _engine(HYPER, 5, between=between, plain=plain)
    assert seen["unchanged"] == 0.0
    assert max_diff(got, _reference(5, maximize_from=99)) < 1e-5


def test_engine_decoupled_weight_decay_is_adamw_mode():
    """torch's decoupled_weight_decay=False (torch.optim.Adam's groups) trains Adam with L2;
    a contradiction with adamw_mode is refused."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), **HYPER)
    for k in range(3):
        model(*DATA[k]).backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = _engine({**HYPER, "decoupled_weight_decay": False}, 3)
    assert max_diff(got, want) < 1e-5
    with pytest.raises(ValueError, match="contradicts adamw_mode"):
        so.initialize(make_model(), {**HYPER, "decoupled_weight_decay": False,
                                     "adamw_mode": True}, cpu_config())
