"""Ulysses sequence-parallel attention on 2 gloo ranks against single-process references.

The worker run (tests/_dist_worker.py, scenario "ulysses") is shared by the tests of this file
through a module fixture: one 2-process launch computes the sharded attention for three cases
and a GPT forward/backward; the references are computed here, unsplit, from the same seeds.

Tolerances (fp32): attention outputs and q/k/v gradients 1e-5 abs + 1e-5 rel — the split
changes nothing but where values are computed, so only summation order differs; GPT loss and
parameter gradients 1e-5 abs + 1e-4 rel — a 2-layer model sums the gradients of the two halves
of the sequence on different ranks and adds them in the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _dist_support import run_ranks
from _dist_worker import ATTN_CASES, attention_inputs, gpt_model_and_batch

from superoffload.distributed import (
    check_sequence_split,
    check_ulysses_shapes,
    heads_to_seq,
    seq_to_heads,
    split_sequence,
    ulysses_attention,
)

WORLD = 2


def _prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close message: keep torch's mismatch report, say which tensor it is."""
    return lambda report: f"{prefix}: {report}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ulysses")
    results = run_ranks("ulysses", WORLD, out, timeout_s=120)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.log[-3000:]}"
    return [torch.load(out / f"ulysses_rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _unsplit_attention(case: str) -> dict[str, torch.Tensor | None]:
    *_, causal = ATTN_CASES[case]
    full = attention_inputs(case)
    q, k, v = (full[n].clone().requires_grad_() for n in "qkv")
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                       enable_gqa=k.shape[1] != q.shape[1])
    y.backward(full["dy"])
    return {"y": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_attention_forward_and_grads_match_unsplit(shards: list[dict], case: str) -> None:
    ref = _unsplit_attention(case)
    for name in ("y", "dq", "dk", "dv"):
        # rank r holds sequence positions [r*S/P, (r+1)*S/P): concatenating restores [B,H,S,D]
        got = torch.cat([shards[r][case][name] for r in range(WORLD)], dim=2)
        torch.testing.assert_close(got, ref[name], atol=1e-5, rtol=1e-5,
                                   msg=_prefixed(f"{case}/{name}"))


def test_causal_case_is_not_trivially_local(shards: list[dict]) -> None:
    # Guard against a test that cannot fail: attention restricted to each rank's own chunk
    # (what a missing all-to-all would compute) must differ from the reference on rank 1.
    full, ref = attention_inputs("causal"), _unsplit_attention("causal")
    q, k, v = (full[n][:, :, 8:] for n in "qkv")
    local_only = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y_ref = ref["y"]
    assert y_ref is not None and (local_only - y_ref[:, :, 8:]).abs().max() > 1e-2


def test_gpt_with_ulysses_matches_single_process(shards: list[dict]) -> None:
    model, idx, targets = gpt_model_and_batch()
    loss = model(idx, targets)
    loss.backward()
    for r in range(WORLD):
        gpt = shards[r]["gpt"]
        assert gpt["keys_same"], "apply_ulysses changed the state_dict keys"
        torch.testing.assert_close(gpt["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
        ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(gpt["grads"]) == set(ref_grads)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(gpt["grads"][name], grad, atol=1e-5, rtol=1e-4,
                                       msg=_prefixed(f"rank {r} grad {name}"))
    # each rank's local loss is the mean over its half; they differ, their mean is the loss
    assert not torch.equal(shards[0]["gpt"]["loss_local"], shards[1]["gpt"]["loss_local"])


def test_bad_shapes_raise_clear_errors_on_two_ranks(shards: list[dict]) -> None:
    assert "3 query heads are not divisible by the sequence-parallel group size 2" in (
        shards[0]["err_heads"])
    assert "sequence length 15 is not divisible by the sequence-parallel group size 2" in (
        shards[0]["err_seq"])


def test_shape_checks_are_pure() -> None:
    check_ulysses_shapes((2, 8, 16, 4), (2, 2, 16, 4), 2)
    with pytest.raises(ValueError, match="6 query heads are not divisible .* size 4"):
        check_ulysses_shapes((1, 6, 4, 2), (1, 6, 4, 2), 4)
    with pytest.raises(ValueError, match="2 key/value heads are not divisible .* size 4"):
        check_ulysses_shapes((1, 8, 4, 2), (1, 2, 4, 2), 4)
    with pytest.raises(ValueError, match=r"batch, heads, seq/P, head_dim"):
        check_ulysses_shapes((1, 8, 4), (1, 8, 4), 2)
    with pytest.raises(ValueError, match="differ in batch, sequence or head_dim"):
        check_ulysses_shapes((1, 8, 4, 2), (1, 8, 5, 2), 2)
    assert check_sequence_split(32, 4) == 8
    with pytest.raises(ValueError, match="multiple of 4 \\(e.g. 12\\)"):
        check_sequence_split(10, 4)


def test_single_rank_is_plain_sdpa() -> None:
    # Without torch.distributed (P=1) the all-to-alls are identities.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    torch.testing.assert_close(ulysses_attention(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(seq_to_heads(q, None), q) and torch.equal(heads_to_seq(q, None), q)
    assert torch.equal(split_sequence(q, dim=2), q)
