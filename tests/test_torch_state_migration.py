"""Migrating a run: ``engine.optimizer.load_state_dict(adamw.state_dict())`` takes the torch
optimizer's moments, step counts and hyper-parameters (as torch's own load_state_dict does)
and the model's weights as the fp32 masters; the run then continues as the torch run does
(fp32, 1e-6; measured ~1e-8), with its LR scheduler. What cannot be honoured (other groups,
amsgrad's state) is refused with the way, before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_ref import HYPER, cpu_config, max_diff
from _tiny_models import batches, make_model

import superoffload as so

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = batches(6)


def torch_run(opt_cls=torch.optim.AdamW, **kw):
    """3 steps with a StepLR, the saved state, then 3 more: (saved model, optimizer and
    scheduler states, final weights)."""
    model = make_model()
    opt = opt_cls(model.parameters(), **{**HYPER, **kw})
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    for k in range(3):
        model(*DATA[k]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(sched.state_dict()))
    for k in range(3, 6):
        model(*DATA[k]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return saved, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_first", [True, False])
def test_a_torch_adamw_run_continues_in_the_engine(model_first):
    (model_sd, opt_sd, sched_sd), want = torch_run()
    model = make_model()
    with so.initialize(model, HYPER, cpu_config(ratio=0.5)) as engine:
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1, 0.5)
        if model_first:
            model.load_state_dict(model_sd)
        engine.optimizer.load_state_dict(opt_sd)
        if not model_first:  # written after: adopted at the next step, as torch would read it
            model.load_state_dict(model_sd)
        sched.load_state_dict(sched_sd)
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(HYPER["lr"] / 8)
        for k in range(3, 6):
            engine.backward(model(*DATA[k]))
            engine.step()
            engine.zero_grad()
            sched.step()
        assert max_diff(want, engine.master_weights()) < 1e-6
        assert all(s.step == 6 for s in engine.export_states().values())


def test_flags_of_the_saved_groups_are_honoured():
    (model_sd, opt_sd, _), _ = torch_run(maximize=True)
    model = make_model()
    with so.initialize(model, HYPER, cpu_config()) as engine:
        engine.optimizer.load_state_dict(opt_sd)
        assert engine.optimizer.param_groups[0]["maximize"] is True


def test_what_cannot_be_honoured_is_refused_before_anything_changes():
    (_, ams_sd, _), _ = torch_run(amsgrad=True)
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    with so.initialize(model, [{"params": params[:3], **HYPER}, {"params": params[3:], **HYPER}],
                       cpu_config()) as engine:
        before = engine.export_states()
        with pytest.raises(ValueError, match=r"groups of \[\d+\] parameters, the engine \[3, "):
            engine.optimizer.load_state_dict(torch_run()[0][1])
        regrouped = {**ams_sd, "param_groups": [
            {**ams_sd["param_groups"][0], "params": ams_sd["param_groups"][0]["params"][:3]},
            {**ams_sd["param_groups"][0], "params": ams_sd["param_groups"][0]["params"][3:]}]}
        with pytest.raises(ValueError, match="amsgrad=True is not supported"):
            engine.optimizer.load_state_dict(regrouped)
        after = engine.export_states()
        assert all(torch.equal(before[i].exp_avg, after[i].exp_avg) and after[i].step == 0
                   for i in before)
        assert engine.optimizer.param_groups[0]["lr"] == HYPER["lr"]
