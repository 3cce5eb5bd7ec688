"""The demo's sample text: temperature + top-k sampling from a seeded generator
instead of greedy decoding, which loops ("def the the the ...")."""

from __future__ import annotations

import pytest
import torch

from superoffload.cli import build_parser
from superoffload.commands.train_output import sample_text
from superoffload.data import encode
from superoffload.models import GPT, gpt_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # torch's pool on 2 shared cores: see conftest


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_tiny()).eval()


def _gen(model: GPT, seed: int, **kw: object) -> torch.Tensor:
    idx = encode("def ").long()[None, :]
    return model.generate(idx, 40, generator=torch.Generator().manual_seed(seed), **kw)  # type: ignore[arg-type]


@torch.no_grad()
def test_every_sampled_byte_is_among_the_top_k(model: GPT) -> None:
    k = 5
    out = _gen(model, 0, temperature=1.5, top_k=k)
    logits = model(out[:, :-1])  # teacher forcing: the logits each byte was drawn from
    for pos in range(3, out.size(1) - 1):
        allowed = torch.topk(logits[0, pos], k).indices.tolist()
        assert int(out[0, pos + 1]) in allowed, pos


@torch.no_grad()
def test_top_1_is_greedy_and_seeds_reproduce(model: GPT) -> None:
    greedy = _gen(model, 0, temperature=0.0)
    assert torch.equal(_gen(model, 123, temperature=0.7, top_k=1), greedy)
    a, b = _gen(model, 7, temperature=0.8, top_k=40), _gen(model, 7, temperature=0.8, top_k=40)
    assert torch.equal(a, b)  # the same seed, the same text
    assert not torch.equal(a, _gen(model, 8, temperature=0.8, top_k=40))
    assert not torch.equal(a, greedy)


def test_bad_sampling_arguments_are_refused(model: GPT) -> None:
    with pytest.raises(ValueError, match="temperature"):
        _gen(model, 0, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        _gen(model, 0, temperature=1.0, top_k=0)


@torch.no_grad()
def test_cli_defaults_and_sample_text(model: GPT) -> None:
    args = build_parser().parse_args(["train"])
    assert (args.sample_temperature, args.sample_top_k) == (0.8, 40)
    cpu = torch.device("cpu")
    text = sample_text(model, cpu, temperature=0.8, top_k=40, seed=3, new_bytes=48)
    assert text == sample_text(model, cpu, temperature=0.8, top_k=40, seed=3, new_bytes=48)
    assert text.startswith("def ") and len(text.encode("utf-8", "replace")) >= 4 + 48
    greedy = sample_text(model, cpu, temperature=0.0, top_k=0, seed=3, new_bytes=48)
    assert greedy.encode("utf-8", "replace") != text.encode("utf-8", "replace")
