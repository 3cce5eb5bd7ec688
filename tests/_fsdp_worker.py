"""One rank of an FSDP2 + so.CPUAdam test (run by tests/test_fsdp_cpu_adam.py).

    python tests/_fsdp_worker.py SCENARIO[+SCENARIO...] OUT_DIR ARGS_JSON

The model (``Net``) has a 3-row layer, so its dim-0 shards are uneven over 2 ranks (2 + 1 rows)
and one is empty over 4 (1 + 1 + 1 + 0); its 13-row embedding and head are uneven over 4
(4 + 4 + 4 + 1). Each rank trains on its slice of every global batch; FSDP2 averages the
gradients. Scenarios (rank 0 writes ``OUT_DIR/<scenario>.json``):
  parity   args["cases"]: named FSDP2 set-ups; per case, two identical sharded models, one
           stepped by so.CPUAdam and one by the reference, 20 steps, two param groups; writes
           the max |diff| of the gathered parameters and both loss curves
  refuse   the refusals: a meta-device DTensor, a plain gradient on a DTensor parameter
  save     train 3 steps, save model + optimizer with torch.distributed.checkpoint, write
           the gathered state (full tensors) and a single-process-style optimizer state
           dict, train 3 more steps and write the parameters
  resume   (any world size) load that checkpoint into a fresh model with so.CPUAdam and with
           torch AdamW, and the single-process state dict into a third; compare the loaded
           state with the saved one; train the same 3 steps; write the parameters
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import superoffload as so
from superoffload.distributed import init_distributed, shutdown

VOCAB, DIM, GLOBAL_BATCH, SEQ = 13, 8, 4, 6
HYPER = {"betas": (0.9, 0.99), "eps": 1e-8}
GROUPS = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 5e-3, "weight_decay": 0.0})
"""2-D weights decay, biases / norms / embeddings do not (two param groups)."""
CASES: dict[str, dict[str, Any]] = {
    # parameters, gradients and state on the CPU by FSDP2's policy (a GPU set-up's layout)
    "offload": {"offload": True},
    # no policy: on a CPU mesh the shards are CPU tensors already
    "plain": {},
    # bf16 compute and all-gather, fp32 gradient reduce and fp32 shards
    "mixed": {"offload": True, "mp": "bf16"},
    # a bf16 model: CPUAdam keeps DTensor fp32 masters and writes the bf16 shard; the
    # reference is an fp32 model under MixedPrecisionPolicy(bf16, reduce bf16) with AdamW,
    # whose fp32 shards are the same masters
    "bf16_params": {"offload": True, "bf16_params": True},
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.narrow = nn.Linear(DIM, 3)  # the 3-row layer: uneven / empty shards
        self.wide = nn.Linear(3, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.wide(torch.tanh(self.narrow(x)))
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), tgt.view(-1))


def build(case: dict[str, Any], seed: int = 0, *, reference: bool = False) -> nn.Module:
    """``Net`` with the same initial weights on every rank, sharded per module + root."""
    torch.manual_seed(seed)
    model = Net()
    kw: dict[str, Any] = {}
    if case.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # no accelerator to pin for
    if case.get("mp") == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if case.get("bf16_params"):
        model = model.to(torch.bfloat16)  # both start from the same bf16 weights
        if reference:
            model = model.float()
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.bfloat16)
    for module in (model.narrow, model.wide):
        fully_shard(module, **kw)
    fully_shard(model, **kw)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2
             and not n.startswith("emb")]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    return [{"params": decay, **GROUPS[0]}, {"params": rest, **GROUPS[1]}]


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, rank: int,
          world: int) -> list[float]:
    per, losses = GLOBAL_BATCH // world, []
    for x, y in batches:
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full fp32 tensor (collective); for CPUAdam on a bf16
    model, the fp32 masters (its optimizer state) instead of the rounded weights."""
    return {n: p.detach().full_tensor().float() for n, p in model.named_parameters()}


def masters(model: nn.Module, opt: so.CPUAdam) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["master_param"].full_tensor() for n, p in model.named_parameters()}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        st = opt.state[p]
        out[f"exp_avg/{n}"] = st["exp_avg"].full_tensor()
        out[f"exp_avg_sq/{n}"] = st["exp_avg_sq"].full_tensor()
        out[f"step/{n}"] = st["step"].detach().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0
               for k in a)


def scenario_parity(out: Path, args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    steps, results = int(args.get("steps", 20)), {}
    batches = data(steps)
    for name in args["cases"]:
        case = CASES[name]
        ours, ref = build(case), build(case, reference=True)
        opt = so.CPUAdam(param_groups(ours), **HYPER)
        ref_opt = torch.optim.AdamW(param_groups(ref), **HYPER)
        start = full_params(ref)
        loss = train(ours, opt, batches, rank, world)
        ref_loss = train(ref, ref_opt, batches, rank, world)
        got = masters(ours, opt) if case.get("bf16_params") else full_params(ours)
        want = full_params(ref)
        local = torch.tensor([p.to_local().numel() for p in ours.parameters()])
        dist.all_reduce(local, op=dist.ReduceOp.MIN)  # the smallest shard over the ranks
        # every rank's step count of every parameter (-1: no state), empty shards included
        step = torch.tensor([float(opt.state.get(p, {}).get("step", -1.0))
                             for p in ours.parameters()])
        dist.all_reduce(step, op=dist.ReduceOp.MIN)
        results[name] = {"max_diff": max_diff(got, want), "moved": max_diff(start, want),
                         "max_abs": max(float(t.abs().max()) for t in want.values()),
                         "loss": loss, "ref_loss": ref_loss,
                         "min_local_numel": dict(zip(dict(ours.named_parameters()),
                                                     local.tolist())),
                         "min_step": dict(zip(dict(ours.named_parameters()), step.tolist()))}
        if case.get("bf16_params"):  # the fused copy reached FSDP2's shard: bf16(master)
            results[name]["lp_vs_master"] = max(
                float((p.to_local().float() - opt.state[p]["master_param"].to_local()
                       .to(torch.bfloat16).float()).abs().max()) if p.to_local().numel() else 0.0
                for p in ours.parameters())
    return results


def scenario_refuse(out: Path, args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with torch.device("meta"):
        meta = Net()
    fully_shard(meta)
    try:
        so.CPUAdam(meta.parameters())
        found["meta"] = None
    except ValueError as e:
        found["meta"] = str(e)
    model = build({"offload": True})
    opt = so.CPUAdam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros(p.shape)  # a plain (full) tensor on a DTensor parameter
    try:
        opt.step()
        found["plain_grad"] = None
    except ValueError as e:
        found["plain_grad"] = str(e)
    return found


def scenario_save(out: Path, args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    batches = data(6)
    model = build({"offload": True})
    opt = so.CPUAdam(param_groups(model), **HYPER)
    train(model, opt, batches[:3], rank, world)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(out / "dcp"))
    saved = full_state(model, opt)
    single = opt.state_dict()  # a single-process-style state dict: full plain tensors
    single["state"] = {pid: {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
                             for k, v in st.items()} for pid, st in single["state"].items()}
    if rank == 0:
        torch.save(saved, out / "saved_state.pt")
        torch.save(single, out / "single_process_optim.pt")
    train(model, opt, batches[3:], rank, world)
    params = full_params(model)
    if rank == 0:
        torch.save(params, out / f"continued_{world}.pt")
    return {"world": world}


def scenario_resume(out: Path, args: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    batches = data(6)[3:]
    ckpt = Path(args["ckpt"])
    saved = torch.load(ckpt / "saved_state.pt")
    result: dict[str, Any] = {"world": world}
    for name, cls in (("cpu_adam", so.CPUAdam), ("adamw", torch.optim.AdamW)):
        model = build({"offload": True}, seed=7)  # other weights: the load must replace them
        opt = cls(param_groups(model), **HYPER)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        # AdamW's param groups have keys CPUAdam's lack (maximize, foreach, ...): it keeps
        # its own values for those, so a partial load
        dcp.load(sd, checkpoint_id=str(ckpt / "dcp"),
                 planner=DefaultLoadPlanner(allow_partial_load=cls is torch.optim.AdamW))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        result[f"{name}_loaded_diff"] = max_diff(full_state(model, opt), saved)
        train(model, opt, batches, rank, world)
        result[f"{name}_params"] = str(out / f"resumed_{name}_{world}.pt")
        params = full_params(model)
        if rank == 0:
            torch.save(params, out / f"resumed_{name}_{world}.pt")
    # a full, single-process optimizer state dict (plain tensors) loads shard by shard
    model = build({"offload": True})
    opt = so.CPUAdam(param_groups(model), **HYPER)
    set_model_state_dict(model, {k[len("param/"):]: v for k, v in saved.items()
                                 if k.startswith("param/")},
                         options=_full_options())
    opt.load_state_dict(torch.load(ckpt / "single_process_optim.pt"))
    result["single_loaded_diff"] = max_diff(full_state(model, opt), saved)
    result["state_is_dtensor"] = all(isinstance(opt.state[p][k], DTensor)
                                     for p in model.parameters()
                                     for k in ("exp_avg", "exp_avg_sq"))
    return result


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


SCENARIOS = {"parity": scenario_parity, "refuse": scenario_refuse, "save": scenario_save,
             "resume": scenario_resume}


def main() -> None:
    """SCENARIO may name several, "parity+refuse+save": one launch (process start-up and
    FSDP2 imports are most of a test's time on 2 cores) runs them in turn."""
    scenarios, out = sys.argv[1].split("+"), Path(sys.argv[2])
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    (out / f"pid_rank{os.environ['RANK']}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=60)
    try:
        for scenario in scenarios:
            result = SCENARIOS[scenario](out, args, info.rank, info.world_size)
            if info.rank == 0:
                (out / f"{scenario}.json").write_text(json.dumps(result))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
