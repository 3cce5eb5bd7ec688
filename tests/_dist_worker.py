"""One rank of a multi-process test (run by tests/_dist_support.py, or by torchrun).

    python tests/_dist_worker.py SCENARIO OUT_DIR ARGS_JSON

Reads torchrun's environment, runs the scenario and writes its results to OUT_DIR; the test
process computes the single-process references and compares. Scenarios:
  ulysses  sequence-parallel attention and GPT forward/backward on this rank's shard
  launch   init_distributed() + dp/sp groups + an all_reduce; writes DistInfo as JSON
  dies     rank 1 exits abruptly; rank 0's next collective must raise DistributedError
  stalls   rank 1 stays alive but never joins; rank 0 must time out after args["timeout_s"]
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from superoffload.distributed import (
    DistributedError,
    apply_ulysses,
    average_gradients,
    dist_info,
    get_groups,
    init_distributed,
    mean_over_group,
    shutdown,
    split_sequence,
    ulysses_attention,
)
from superoffload.models import GPT, gpt_tiny

# Shapes shared with the tests (they rebuild the same tensors from the same seeds).
ATTN_CASES = {  # name: (batch, q heads, kv heads, seq, head_dim, causal)
    "causal": (2, 4, 4, 16, 8, True),
    "full": (1, 2, 2, 8, 4, False),
    "gqa": (2, 4, 2, 16, 8, True),
}
GPT_BATCH, GPT_SEQ = 2, 32


def attention_inputs(case: str) -> dict[str, torch.Tensor]:
    """Full (unsplit) q, k, v and an upstream gradient dy for an attention case."""
    b, h, hkv, s, d, _ = ATTN_CASES[case]
    g = torch.Generator().manual_seed(1234)
    return {"q": torch.randn(b, h, s, d, generator=g), "k": torch.randn(b, hkv, s, d, generator=g),
            "v": torch.randn(b, hkv, s, d, generator=g), "dy": torch.randn(b, h, s, d, generator=g)}


def gpt_model_and_batch() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_head=4))
    g = torch.Generator().manual_seed(99)
    idx = torch.randint(0, model.config.vocab_size, (GPT_BATCH, GPT_SEQ), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (GPT_BATCH, GPT_SEQ), generator=g)
    return model, idx, targets


def _error_text(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def scenario_ulysses(out: Path, rank: int) -> None:
    init_distributed(sp=2, timeout_s=60)
    sp_group = get_groups().sp_group
    results: dict[str, object] = {}
    for case, (*_, causal) in ATTN_CASES.items():
        full = attention_inputs(case)
        local = {n: split_sequence(t, sp_group, dim=2).clone().requires_grad_(n != "dy")
                 for n, t in full.items()}
        y = ulysses_attention(local["q"], local["k"], local["v"], sp_group, causal=causal)
        y.backward(local["dy"])
        results[case] = {"y": y.detach(), **{f"d{n}": local[n].grad for n in "qkv"}}
    q3 = torch.zeros(1, 3, 4, 2)
    results["err_heads"] = _error_text(lambda: ulysses_attention(q3, q3, q3, sp_group))
    results["err_seq"] = _error_text(lambda: split_sequence(torch.zeros(1, 15), sp_group))

    model, idx, targets = gpt_model_and_batch()
    keys_before = list(model.state_dict())
    apply_ulysses(model, sp_group)
    loss_local = model(split_sequence(idx, sp_group), split_sequence(targets, sp_group))
    loss_local.backward()
    average_gradients(model.parameters(), get_groups().world_group)
    results["gpt"] = {
        "loss_local": loss_local.detach(),
        "loss": mean_over_group(loss_local, sp_group),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "keys_same": keys_before == list(model.state_dict()),
    }
    torch.save(results, out / f"ulysses_rank{rank}.pt")
    shutdown()


def scenario_launch(out: Path, rank: int, sp: int) -> None:
    info = init_distributed(sp=sp, timeout_s=60)
    groups = get_groups()
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    record = {"info": asdict(info), "sum": total.item(),
              "sp_group": dist.get_process_group_ranks(groups.sp_group),
              "dp_group": dist.get_process_group_ranks(groups.dp_group),
              "env_rank": int(os.environ["RANK"])}
    assert dist_info() == info
    (out / f"launch_rank{rank}.json").write_text(json.dumps(record))
    shutdown()


def scenario_failure(out: Path, rank: int, *, mode: str, timeout_s: float) -> None:
    init_distributed(timeout_s=timeout_s)
    mean_over_group(torch.ones(1))  # everyone is up and connected
    if rank == 1:
        if mode == "dies":
            os._exit(7)  # no cleanup, no goodbye: like a segfault or the OOM killer
        time.sleep(600)  # "stalls": alive but never joins the next collective; the test kills it
    time.sleep(0.5)
    t0 = time.monotonic()
    record: dict[str, object]
    try:
        mean_over_group(torch.ones(1))
        record = {"error": None}
    except DistributedError as exc:
        record = {"error": str(exc), "type": type(exc).__name__}
    record["seconds"] = time.monotonic() - t0
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip the process-group teardown with a dead peer


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    (out / f"pid_rank{rank}.txt").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    if scenario == "ulysses":
        scenario_ulysses(out, rank)
    elif scenario == "launch":
        scenario_launch(out, rank, args.get("sp", 1))
    elif scenario in ("dies", "stalls"):
        scenario_failure(out, rank, mode=scenario, timeout_s=args["timeout_s"])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
