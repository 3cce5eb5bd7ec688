"""The storage tier checked by VALUE: training with the offloaded buckets' state in files
matches the in-memory engine bit for bit (same kernel calls on the same numbers: the tier only
moves them), and AdamW within the in-memory engine's own tolerance; checkpoints resume
bit-identically and load under another layout or no tier at all (docs/storage.md).

The tiny model has 8 buckets of 4 KiB at ratio 0.7: 5 offloaded, all on the tier unless a
budget keeps some in memory; two pool buffers, so buckets wait for buffers, reads run ahead
and slots change hands every iteration. Clipping at 0.05 fires every step (the norms are
~0.3-1), so every speculative step is rolled back (by its version) and replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, cpu_config, groups_for, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model

import superoffload as so
from superoffload.config import ConfigError
from superoffload.runtime.ckpt_files import CheckpointCorrupt

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS = 4
CLIP = 0.05


def tier(path: Path, **kw: Any) -> so.OffloadConfig:
    return cpu_config(storage_path=str(path), ratio=0.7, storage_buffer_count=2, **kw)


@pytest.mark.parametrize(("dtype", "clip", "inline"), [
    (torch.float32, None, True), (torch.float32, CLIP, False),
    (torch.bfloat16, CLIP, True), (torch.bfloat16, None, False)])
def test_training_on_the_tier_matches_the_in_memory_engine_bit_for_bit(
        tmp_path: Path, dtype: torch.dtype, clip: float | None, inline: bool) -> None:
    data = batches(STEPS)
    ram, ram_stats = train_engine(make_model(dtype=dtype), data,
                                  cpu_config(ratio=0.7, max_grad_norm=clip, rollback="snapshot"),
                                  steps=STEPS, inline=inline)
    got, stats = train_engine(make_model(dtype=dtype), data, tier(tmp_path, max_grad_norm=clip),
                              steps=STEPS, inline=inline)
    assert max_diff(ram, got) == 0.0
    ref = train_reference(make_model(dtype=dtype), data, steps=STEPS, max_norm=clip)
    assert max_diff(ref, got) < 1e-6  # the in-memory engine's own distance to AdamW
    if clip:  # every step clipped: each speculative step undone by its version, replayed
        assert stats.clipped_steps == STEPS and stats.rollbacks == stats.replays > 0
        assert stats.rollbacks == ram_stats.rollbacks  # snapshot mode speculates the same
    assert list(tmp_path.iterdir()) == []  # close() deleted the tier's file


def test_accumulation_bf16_moments_and_two_groups_on_the_tier(tmp_path: Path) -> None:
    data = batches(2 * STEPS)
    kw: dict[str, Any] = {"grad_accum_steps": 2, "optimizer_state_dtype": "bf16",
                          "max_grad_norm": 0.3}
    ram, _ = train_engine(make_model(dtype=torch.bfloat16), data, cpu_config(ratio=0.7, **kw),
                          steps=STEPS, two_groups=True)
    got, _ = train_engine(make_model(dtype=torch.bfloat16), data, tier(tmp_path, **kw),
                          steps=STEPS, two_groups=True)
    assert max_diff(ram, got) == 0.0  # the same stochastic-rounding streams, per bucket


def test_an_overflow_skips_the_step_and_keeps_the_version_in_force(tmp_path: Path) -> None:
    """fp16 at scale 2**20 overflows the first steps: their speculative versions are never
    committed and the device gets the weights in force back (the republish)."""
    data = batches(STEPS)
    kw: dict[str, Any] = {"initial_scale_power": 20, "loss_scale_window": 2}
    ram, ram_stats = train_engine(make_model(dtype=torch.float16), data,  # bit-exact undo too
                                  cpu_config(ratio=0.7, rollback="snapshot", **kw), steps=STEPS)
    model = make_model(dtype=torch.float16)
    got, stats = train_engine(model, data, tier(tmp_path, **kw), steps=STEPS)
    assert stats.skipped_steps == ram_stats.skipped_steps >= 1
    assert max_diff(ram, got) == 0.0
    for name, p in model.named_parameters():  # the device holds fp16(master) exactly
        assert torch.equal(p.detach(), got[name].to(torch.float16)), name


def test_a_budget_keeps_the_last_buckets_in_memory_and_the_rest_on_the_tier(
        tmp_path: Path) -> None:
    data = batches(STEPS)
    model = make_model()
    # pool: 2 x the largest tier bucket's working set (16 B/element, 4 KiB-aligned parts);
    # budget: the pool and room for the two smallest offloaded buckets
    engine = so.initialize(model, groups_for(model, False, HYPER),
                           tier(tmp_path, host_memory_budget_bytes=100_000), inline=True)
    store = engine.tier
    assert store is not None and store.plan.tier and store.plan.resident
    host = [b.id for b in engine.bucket_plan.host_buckets]
    assert store.plan.resident == tuple(host[-len(store.plan.resident):])  # finished last
    assert store.plan.host_bytes <= 100_000
    engine.close()
    ram, _ = train_engine(make_model(), data, cpu_config(ratio=0.7, max_grad_norm=CLIP),
                          steps=STEPS)
    got, _ = train_engine(make_model(), data,
                          tier(tmp_path, host_memory_budget_bytes=100_000, max_grad_norm=CLIP),
                          steps=STEPS)
    assert max_diff(ram, got) == 0.0


def _run(config: so.OffloadConfig, data: list, steps: int, *, save: Path | None = None,
         save_at: int = -1, load: Path | None = None) -> dict[str, torch.Tensor]:
    model = make_model()
    with so.initialize(model, groups_for(model, True, HYPER), config) as engine:
        if load is not None:
            engine.load_checkpoint(str(load))
        for k in range(engine.iteration, steps):
            engine.backward(model(*data[k]))
            engine.step()
            engine.zero_grad()
            if k + 1 == save_at:
                assert save is not None
                engine.save_checkpoint(str(save))
        return engine.master_weights()


def test_a_checkpoint_copies_the_tier_and_resumes_bit_identically_under_any_layout(
        tmp_path: Path) -> None:
    data, ckpt = batches(6), tmp_path / "ckpt"
    cfg = tier(tmp_path / "t1", max_grad_norm=CLIP)
    full = _run(cfg, data, 6, save=ckpt, save_at=3)
    files = sorted(p.name for p in ckpt.iterdir())
    assert [f for f in files if f.startswith("tier-state-")] and "engine.pt" in files
    assert max_diff(_run(cfg, data, 6, load=ckpt), full) == 0.0  # bit-identical
    assert max_diff(_run(cpu_config(max_grad_norm=CLIP), data, 6, load=ckpt), full) == 0.0
    other = cpu_config(storage_path=str(tmp_path / "t2"), ratio=0.5, bucket_bytes=8192,
                       storage_buffer_count=3, max_grad_norm=CLIP)
    assert max_diff(_run(other, data, 6, load=ckpt), full) == 0.0
    # saving again replaces the tier file: only the new engine.pt's own stays
    _run(cfg, data, 5, save=ckpt, save_at=5, load=ckpt)
    tier_files = [p for p in ckpt.iterdir() if p.name.startswith("tier-state-")]
    assert len(tier_files) == 1 and tier_files[0].name not in files


def test_a_checkpoint_whose_tier_file_is_missing_or_damaged_is_refused_naming_it(
        tmp_path: Path) -> None:
    data, ckpt = batches(3), tmp_path / "ckpt"
    _run(tier(tmp_path / "t"), data, 3, save=ckpt, save_at=2)
    (state_file,) = ckpt.glob("tier-state-*.bin")
    raw = bytearray(state_file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    state_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match=state_file.name):
        _run(tier(tmp_path / "t"), data, 3, load=ckpt)
    state_file.unlink()
    with pytest.raises(CheckpointCorrupt, match="is missing"):
        _run(tier(tmp_path / "t"), data, 3, load=ckpt)


def test_full_grad_and_state_dict_read_the_tier(tmp_path: Path) -> None:
    data = batches(2)
    out = {}
    for name, cfg in (("ram", cpu_config(ratio=0.7)), ("tier", tier(tmp_path))):
        model = make_model()
        with so.initialize(model, groups_for(model, False, HYPER), cfg) as engine:
            engine.backward(model(*data[0]))
            grads = {n: engine.full_grad(p) for n, p in model.named_parameters()}
            engine.step()
            engine.zero_grad()
            sd = engine.state_dict()
        out[name] = (grads, sd)
    assert out["ram"][0].keys() == out["tier"][0].keys()
    for n, g in out["ram"][0].items():
        assert g is not None and torch.equal(g, out["tier"][0][n]), n
    ram_state, tier_state = out["ram"][1]["state"], out["tier"][1]["state"]
    for n, s in ram_state.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], tier_state[n][key]), (n, key)


def test_weights_written_between_steps_become_the_masters_on_the_tier(tmp_path: Path) -> None:
    """torch semantics: a weight written between steps is what the next step starts from."""
    data = batches(STEPS)

    def during(engine: Any, step: int) -> None:
        if engine is not None and step == 2:  # the supported way: load_state_dict
            halved = {k: v * 0.5 for k, v in engine.model.state_dict().items()}
            engine.model.load_state_dict(halved)

    ram, _ = train_engine(make_model(), data, cpu_config(ratio=0.7), steps=STEPS, during=during)
    got, _ = train_engine(make_model(), data, tier(tmp_path), steps=STEPS, during=during)
    assert max_diff(ram, got) == 0.0


@pytest.mark.parametrize(("changes", "words"), [
    ({"grad_accum_steps": 2, "grad_accum_on": "host"}, "grad_accum_on='host'"),
    ({"host_memory_budget_bytes": 10_000}, "storage_buffer_count"),
])
def test_what_the_tier_cannot_do_is_refused_at_initialize(
        tmp_path: Path, changes: dict[str, Any], words: str) -> None:
    model = make_model()
    with pytest.raises(ConfigError, match=words):
        so.initialize(model, groups_for(model, False, HYPER), tier(tmp_path, **changes))
    assert not any(tmp_path.glob("superoffload-state-*"))


def test_a_budget_without_a_tier_refuses_a_state_that_does_not_fit(tmp_path: Path) -> None:
    model = make_model()
    with pytest.raises(ConfigError,
                       match=r"host_memory_budget_bytes=10,000 is below .*storage_path"):
        so.initialize(model, groups_for(model, False, HYPER),
                      cpu_config(ratio=0.7, host_memory_budget_bytes=10_000))


def test_an_export_reads_the_tier_live_and_from_a_checkpoint(tmp_path: Path) -> None:
    """``export_hf`` of a tier run: the masters bit for bit, read back through a slot (live)
    and from the checkpoint's tier-state file."""
    from safetensors import torch as safetensors_torch

    data, ckpt = batches(2), tmp_path / "ckpt"
    model = make_model(dtype=torch.bfloat16)
    with so.initialize(model, groups_for(model, False, HYPER), tier(tmp_path / "t")) as engine:
        for batch in data:
            engine.backward(model(*batch))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
        engine.save_checkpoint(str(ckpt))
        so.export_hf(engine, tmp_path / "live")
    so.export_hf(ckpt, tmp_path / "saved")
    for folder in ("live", "saved"):
        got = safetensors_torch.load_file(str(tmp_path / folder / "model.safetensors"))
        for name, master in masters.items():
            assert torch.equal(got[name], master), (folder, name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pinned_slots_and_copies_train_bit_for_bit(tmp_path: Path) -> None:
    """The CUDA path: pinned pool slots, gradients copied into them on the D2H stream, the
    publish read from them on the H2D stream before the slot is reused (host_wait)."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(STEPS)]
    base = {"device": "cuda", "bucket_bytes": 4096, "ratio": 0.7, "max_grad_norm": CLIP,
            "rollback": "snapshot"}
    ram, _ = train_engine(make_model(dtype=torch.bfloat16).cuda(), data,
                          so.OffloadConfig(**base), steps=STEPS)
    got, stats = train_engine(make_model(dtype=torch.bfloat16).cuda(), data,
                              so.OffloadConfig(**base, storage_path=str(tmp_path),
                                               storage_buffer_count=2), steps=STEPS)
    assert max_diff(ram, got) == 0.0 and stats.replays > 0
