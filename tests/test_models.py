"""The compact GPT: shapes, tied head, causality, checkpointing, validation, and that plain
AdamW lowers its loss (the reference loop the engine's differential tests compare against)."""

from __future__ import annotations

import copy

import pytest
import torch

from superoffload.models import GPT, PRESETS, GPTConfig, gpt_tiny


def _batch(cfg: GPTConfig, b: int = 2, t: int = 16,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg)
    x, y = _batch(cfg)
    logits = model(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    loss = model(x, y)
    assert loss.dim() == 0
    # small init: predictions are near uniform, so the loss is near ln(256) = 5.545
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)


def test_head_is_tied_to_the_embedding() -> None:
    model = GPT(gpt_tiny())
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # counted once
    # gradient from both uses lands in the one tensor
    x, y = _batch(model.config)
    model(x, y).backward()
    assert model.wte.weight.grad is not None
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny()).eval()
    x, _ = _batch(model.config, b=1, t=12)
    changed = x.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 256
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # positions before 8 cannot see position 8
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = GPT(gpt_tiny())
    ckpt = copy.deepcopy(plain)
    ckpt.config.checkpointing = True
    x, y = _batch(plain.config)
    plain(x, y).backward()
    ckpt(x, y).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        # recomputation replays the same ops: identical up to reduction order (fp32)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_model_returns_fp32_loss() -> None:
    model = GPT(gpt_tiny()).to(torch.bfloat16)
    x, y = _batch(model.config)
    loss = model(x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_plain_adamw_lowers_the_loss_on_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    x, y = _batch(model.config, b=4, t=32)
    losses = []
    for _ in range(15):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # memorising one batch: the loss must fall well below its start (~5.5)
    assert losses[-1] < losses[0] - 1.0, losses


def test_presets_and_validation() -> None:
    assert set(PRESETS) >= {"tiny", "small", "medium"}
    assert GPT(PRESETS["small"]()).num_params() > GPT(gpt_tiny()).num_params()
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=65, n_head=2).validate()
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0).validate()
    model = GPT(gpt_tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(5, dtype=torch.long))


def test_flops_per_token_is_six_n_plus_attention() -> None:
    model = GPT(gpt_tiny())
    c = model.config
    n = model.num_params() - c.block_size * c.n_embd  # without position embeddings
    assert model.flops_per_token(32) == 6 * n + 12 * c.n_layer * c.n_embd * 32


def test_generate_extends_the_sequence() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny()).eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 5, temperature=0.0)
    assert out.shape == (1, 8)
