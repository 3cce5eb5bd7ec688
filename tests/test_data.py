"""The embedded corpus, the byte tokenizer, the deterministic split and the seeded sampler."""

from __future__ import annotations

import pytest
import torch

from superoffload.data import (
    VOCAB_SIZE,
    BatchSampler,
    decode,
    encode,
    load_corpus,
    load_tokens,
    split_train_val,
)


def test_corpus_ships_with_the_package() -> None:
    text = load_corpus()
    assert len(text) > 500_000  # enough for a few minutes of training without repeats
    assert b"# abc" in text[:100]  # the first module of the standard library, alphabetically
    tokens = load_tokens()
    assert tokens.dtype == torch.uint8 and tokens.numel() == len(text)
    assert int(tokens.max()) < VOCAB_SIZE


def test_byte_tokenizer_round_trips() -> None:
    for text in ("hello", "naïve café ☕", ""):
        assert decode(encode(text)) == text
    assert encode("A").tolist() == [65]
    assert decode([104, 105]) == "hi"


def test_split_is_deterministic_interleaved_and_disjoint() -> None:
    tokens = torch.arange(100, dtype=torch.int64)
    train, val = split_train_val(tokens, val_fraction=0.25, block_tokens=10)
    # blocks 3 and 7 (every 4th, counting from 0) go to validation
    assert val.tolist() == list(range(30, 40)) + list(range(70, 80))
    assert sorted(train.tolist() + val.tolist()) == list(range(100))
    train2, val2 = split_train_val(tokens, val_fraction=0.25, block_tokens=10)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    # the real corpus: about 10% held out
    full_train, full_val = split_train_val(load_tokens())
    assert 0.05 < full_val.numel() / (full_train.numel() + full_val.numel()) < 0.15
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(tokens, val_fraction=1.5)


def test_sampler_is_seeded_and_targets_are_shifted() -> None:
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    a = BatchSampler(tokens, batch_size=4, seq_len=8, seed=3)
    b = BatchSampler(tokens, batch_size=4, seq_len=8, seed=3)
    c = BatchSampler(tokens, batch_size=4, seq_len=8, seed=4)
    xa, ya = a.next_batch()
    xb, yb = b.next_batch()
    xc, _ = c.next_batch()
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
    assert xa.shape == (4, 8) and xa.dtype == torch.int64
    torch.testing.assert_close(ya[:, :-1], xa[:, 1:])  # y is x shifted by one
    assert torch.equal((xa[:, 1:] - xa[:, :-1]) % 256, torch.ones(4, 7, dtype=torch.int64))


def test_sampler_state_resumes_the_same_batches() -> None:
    tokens = torch.arange(500, dtype=torch.int64)
    s = BatchSampler(tokens, batch_size=2, seq_len=4, seed=0)
    s.next_batch()
    state = s.state_dict()
    expected = [s.next_batch()[0] for _ in range(3)]
    s2 = BatchSampler(tokens, batch_size=2, seq_len=4, seed=99)
    s2.load_state_dict(state)
    assert all(torch.equal(e, next(s2)[0]) for e in expected)


def test_sampler_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(torch.arange(10), batch_size=1, seq_len=0)
    with pytest.raises(ValueError, match="too few"):
        BatchSampler(torch.arange(10), batch_size=1, seq_len=20)
    with pytest.raises(ValueError, match="1-D"):
        BatchSampler(torch.zeros(2, 2), batch_size=1, seq_len=1)
