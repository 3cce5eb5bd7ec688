"""Weight-flow with its homes on the storage tier (docs/storage.md, "Weights on the tier"),
checked by VALUE: the blocks streamed from the tier's file train bit for bit as the blocks
streamed from host memory (the same kernel calls on the same numbers: only where the weights
wait between a step and the next fetch differs), a fetch reads the version in force (a
speculative step undone is never seen), the engine keeps no home in host memory, and
checkpoints resume bit-identically. Then the pure rule (plan/storage.py) and the DeepSpeed
keys (``offload_param``).

The tiny model: 4 KiB buckets, every bucket offloaded under weight-flow (about a dozen), two
pool buffers and ``prefetch_depth=1`` (two staging buffers), so slots change hands, reads run
ahead, and each block's fetch reads spans of several buckets through both staging buffers.
Clipping at 0.05 fires every step (norms are ~0.3-1): every speculative step is undone by its
version and replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _engine_ref import HYPER, cpu_config, groups_for, max_diff, train_engine, train_reference
from _tiny_models import batches, make_model
from hypothesis import given, settings
from hypothesis import strategies as st

import superoffload as so
from superoffload.config import ConfigError
from superoffload.plan.buckets import Bucket
from superoffload.plan.storage import (
    ALIGN,
    ElementBytes,
    Homes,
    TierError,
    aligned,
    aligned_span,
    plan_tier,
)
from superoffload.telemetry.events import KIND_TIER_READ, LANE_STORAGE

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

STEPS = 4
CLIP = 0.05
FLOW: dict[str, Any] = {"weights": "flow", "prefetch_depth": 1}


def tier(path: Path, homes: str = "storage", **kw: Any) -> so.OffloadConfig:
    return cpu_config(storage_path=str(path), storage_buffer_count=2, weight_homes=homes,
                      **FLOW, **kw)


def ram(**kw: Any) -> so.OffloadConfig:
    return cpu_config(**FLOW, **kw)


# ---------------------------------------------------------------------------- the engine
@pytest.mark.parametrize(("dtype", "clip", "inline"), [
    (torch.bfloat16, CLIP, True), (torch.bfloat16, None, False), (torch.float32, CLIP, False)])
def test_homes_on_the_tier_train_bit_for_bit_as_homes_in_memory(
        tmp_path: Path, dtype: torch.dtype, clip: float | None, inline: bool) -> None:
    data = batches(STEPS)
    want, _ = train_engine(make_model(dtype=dtype), data, ram(max_grad_norm=clip),
                           steps=STEPS, inline=inline)
    model = make_model(dtype=dtype)
    with so.initialize(model, groups_for(model, False, HYPER),
                       tier(tmp_path, max_grad_norm=clip), inline=inline) as engine:
        store = engine.tier
        assert store is not None and store.plan.file_homes == store.plan.tier != ()
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        got, stats = engine.master_weights(), engine.stats
        reads = [s for s in engine.telemetry.spans()
                 if s.lane == LANE_STORAGE and s.kind == KIND_TIER_READ and s.bucket == -1]
    assert max_diff(want, got) == 0.0
    ref = train_reference(make_model(dtype=dtype), data, steps=STEPS, max_norm=clip)
    assert max_diff(ref, got) < 1e-6  # the in-memory engine's own distance to AdamW
    if clip:  # every step clipped: each speculative step undone by its version, replayed
        assert stats.clipped_steps == STEPS and stats.rollbacks == stats.replays > 0
    # every block came from the file: a forward reads each once, a backward all but the
    # prefetch_depth + 1 blocks still resident; each read extended to 4 KiB boundaries
    block_bytes = [sum(p.numel() for p in b.parameters()) * model.wte.weight.element_size()
                   for b in model.blocks]
    need = sum(block_bytes) + sum(block_bytes[:len(block_bytes) - 2])
    for it in range(STEPS):
        mine = [s.nbytes for s in reads if s.iteration == it]
        assert need <= sum(mine) <= need + 2 * ALIGN * len(mine), it
        assert all(n % ALIGN == 0 for n in mine)
    for name, p in model.named_parameters():  # close() read the weights back from the file
        assert torch.equal(p.detach(), got[name].to(dtype)), name
    assert list(tmp_path.iterdir()) == []


def test_the_engine_keeps_no_home_in_host_memory(tmp_path: Path) -> None:
    """The same bf16 model with its homes in memory and in the file: the tier's host buffers
    (sizes, not timing) are the rule's parts, and the homes' 2 B per element are gone."""
    held = {}
    for homes in ("host", "storage"):
        model = make_model(dtype=torch.bfloat16)
        with so.initialize(model, groups_for(model, False, HYPER),
                           tier(tmp_path / homes, homes)) as engine:
            store = engine.tier
            assert store is not None
            parts = store.plan.host_parts
            assert store.held_bytes == parts["storage_pool"] + parts["weight_stage_buffers"] \
                + parts["weight_flow_homes"]
            held[homes] = (parts, max(r.numel for r in store.plan.regions),
                           store.plan.tier_numel)
    (host_parts, largest, numel), (file_parts, _, _) = held["host"], held["storage"]
    assert host_parts["weight_flow_homes"] == 2 * numel and file_parts["weight_flow_homes"] == 0
    assert host_parts["weight_stage_buffers"] == 0
    # prefetch_depth + 1 buffers of the largest bucket's home, with room to align a read
    assert file_parts["weight_stage_buffers"] == 2 * (aligned(2 * largest) + ALIGN)
    # each slot grows by the copy it now carries in the state: 2 B per element of the largest
    assert file_parts["storage_pool"] - host_parts["storage_pool"] <= 2 * aligned(2 * largest)


def _block_weights_seen(model: torch.nn.Module) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """Copies of every block's weights as the forward sees them (a pre-hook after the engine's
    own, which fetched the block)."""
    seen: list[dict[str, torch.Tensor]] = []

    def grab(module: torch.nn.Module, args: Any) -> None:
        seen.append({n: p.detach().clone() for n, p in module.named_parameters()})

    return seen, [b.register_forward_pre_hook(grab) for b in model.blocks]


@pytest.mark.parametrize("undo", ["zero_grad", "nonfinite"])
def test_a_fetch_reads_the_version_in_force_not_the_speculative_one(
        tmp_path: Path, undo: str) -> None:
    """A speculative step writes its new weights to the version not in force; undone (the
    iteration abandoned by ``zero_grad()``, or skipped for a non-finite gradient that only
    the embedding's bucket, the last to leave, holds), the next forward must see the weights
    from before it, bit for bit."""
    model = make_model(dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.blocks.named_parameters()}
    with so.initialize(model, groups_for(model, False, HYPER), tier(tmp_path)) as engine:
        if undo == "nonfinite":
            engine.register_grad_transform(
                lambda name, g: g * float("inf") if name == "wte.weight" else None)
        x, y = batches(1)[0]
        engine.backward(model(x, y))
        engine.synchronize()  # the speculative steps ran and their versions were written
        assert engine.stats.speculated_buckets > 0
        if undo == "zero_grad":
            engine.zero_grad()  # abandons the iteration: every speculative step undone
        else:
            engine.step()
            assert engine.stats.skipped_steps == 1
            engine.zero_grad()
        seen, hooks = _block_weights_seen(model)
        with torch.no_grad():
            model(x, y)
        for h in hooks:
            h.remove()
    assert len(seen) == len(model.blocks)
    for k, weights in enumerate(seen):
        for name, value in weights.items():
            assert torch.equal(value, before[f"{k}.{name}"]), (k, name)


def test_an_overflow_skips_and_the_weights_in_force_stream_in(tmp_path: Path) -> None:
    data = batches(STEPS)
    kw: dict[str, Any] = {"initial_scale_power": 20, "loss_scale_window": 2}
    # homes in memory on the tier: the same versions undo the skipped steps, bit-exact
    want, want_stats = train_engine(make_model(dtype=torch.float16), data,
                                    tier(tmp_path / "host", "host", **kw), steps=STEPS)
    got, stats = train_engine(make_model(dtype=torch.float16), data,
                              tier(tmp_path / "file", **kw), steps=STEPS)
    assert stats.skipped_steps == want_stats.skipped_steps >= 1
    assert max_diff(want, got) == 0.0
    # the in-memory engine undoes by its inverse (rollback="auto"): within its own tolerance
    plain, _ = train_engine(make_model(dtype=torch.float16), data, ram(**kw), steps=STEPS)
    assert max_diff(plain, got) < 1e-6


def test_accumulation_two_groups_and_a_budget_with_some_homes_in_memory(tmp_path: Path) -> None:
    """``weight_homes="auto"`` under a budget that holds the pool, the staging buffers and only
    some homes: the first buckets' homes move to the file, the rest stay in memory, and a
    block may take its weights from both."""
    data = batches(2 * STEPS)
    kw: dict[str, Any] = {"grad_accum_steps": 2}  # clipping: the tests above
    big = {"dtype": torch.bfloat16, "n_blocks": 8}  # homes outweigh the staging buffers
    want, _ = train_engine(make_model(**big), data, ram(**kw), steps=STEPS, two_groups=True)
    need = {}
    for homes in ("host", "storage"):
        model = make_model(**big)
        with so.initialize(model, groups_for(model, True, HYPER),
                           tier(tmp_path, homes)) as engine:
            assert engine.tier is not None
            need[homes] = engine.tier.plan.host_bytes
    assert need["storage"] < need["host"]
    budget = (need["storage"] + need["host"]) // 2  # every home in memory does not fit
    cfg = tier(tmp_path, "auto", host_memory_budget_bytes=budget, **kw)
    model = make_model(**big)
    with so.initialize(model, groups_for(model, True, HYPER), cfg) as engine:
        store = engine.tier
        assert store is not None
        filed, on_tier = store.plan.file_homes, store.plan.tier
        assert 0 < len(filed) < len(on_tier) and filed == on_tier[:len(filed)]
        assert store.plan.host_bytes <= budget
    got, _ = train_engine(make_model(**big), data, cfg, steps=STEPS, two_groups=True)
    assert max_diff(want, got) == 0.0


def _run(config: so.OffloadConfig, data: list, steps: int, *, save: Path | None = None,
         save_at: int = -1, load: Path | None = None) -> dict[str, torch.Tensor]:
    model = make_model(dtype=torch.bfloat16)
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


def test_a_checkpoint_resumes_bit_identically_with_the_homes_anywhere(tmp_path: Path) -> None:
    data, ckpt = batches(6), tmp_path / "ckpt"
    cfg = tier(tmp_path / "t1", max_grad_norm=CLIP)
    full = _run(cfg, data, 6, save=ckpt, save_at=3)
    assert max_diff(_run(cfg, data, 6, load=ckpt), full) == 0.0
    assert max_diff(_run(tier(tmp_path / "t2", "host", max_grad_norm=CLIP), data, 6, load=ckpt),
                    full) == 0.0
    assert max_diff(_run(ram(max_grad_norm=CLIP), data, 6, load=ckpt), full) == 0.0


def test_what_the_homes_cannot_do_is_refused_at_initialize(tmp_path: Path) -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="weight_homes='storage' .*storage_path"):
        so.initialize(model, groups_for(model, False, HYPER),
                      cpu_config(weights="stationary", weight_homes="storage"))
    with pytest.raises(ConfigError, match="weight_homes='host' with weight-flow of an fp32"):
        so.initialize(model, groups_for(model, False, HYPER), tier(tmp_path, "host"))
    assert not any(tmp_path.glob("superoffload-state-*"))


# ---------------------------------------------------------------------------- the rule
BF16_FLOW = ElementBytes(moment=4, grad=2, lp=2, home=2)
FP32_FLOW = ElementBytes(moment=4, grad=4, lp=0)


def buckets(*numels: int) -> list[Bucket]:
    return [Bucket(i, (i,), n, False) for i, n in enumerate(numels)]


def test_a_home_in_the_file_is_part_of_both_versions_of_the_state() -> None:
    plan = plan_tier(buckets(1000, 3000), BF16_FLOW, storage=True, budget_bytes=None,
                     buffer_count=2, homes=Homes("storage", 2, 3))
    assert plan.file_homes == (0, 1)
    offset = 0
    for region, n in zip(plan.regions, (1000, 3000)):
        state = aligned(14 * n)  # master 4 + m 4 + v 4 + the copy 2
        assert region.state_bytes == state and region.home_offset == 12 * n
        assert region.state_offsets == (offset, offset + state)
        offset += 2 * state + aligned(2 * n)
    assert plan.file_bytes == offset
    assert plan.slot.grad_offset == aligned(14 * 3000)  # one read fills master..copy
    assert plan.stage == (3, aligned(2 * 3000) + ALIGN)
    assert plan.host_parts["weight_flow_homes"] == 0
    assert plan.host_parts["weight_stage_buffers"] == 3 * (aligned(2 * 3000) + ALIGN)
    assert plan.home_bytes(2) == 2 * 4000
    # an fp32 model's home is its master: nothing added, nothing in memory, even for "auto"
    fp32 = plan_tier(buckets(1000), FP32_FLOW, storage=True, budget_bytes=None,
                     buffer_count=2, homes=Homes("auto", 4, 2))
    (region,) = fp32.regions
    assert region.home_offset == 0 and region.state_bytes == aligned(12 * 1000)


def test_auto_keeps_the_homes_in_memory_until_the_budget_cannot_hold_them() -> None:
    sizes = (1000,) * 40  # the homes (80 KB) outweigh the staging buffers and bigger slots
    auto = Homes("auto", 2, 2)
    free = plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=None,
                     buffer_count=2, homes=auto)
    assert free.file_homes == () and free.host_parts["weight_flow_homes"] == 2 * 40_000
    in_memory = free.host_bytes
    assert plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=in_memory,
                     buffer_count=2, homes=auto).file_homes == ()
    filed = plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=None,
                      buffer_count=2, homes=Homes("storage", 2, 2))
    need_in_file = filed.host_bytes
    for moved in (14, 20, 40):  # below what every home in memory needs: the first ones move
        budget = need_in_file + 2 * 1000 * (40 - moved)
        assert budget < in_memory
        plan = plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=budget,
                         buffer_count=2, homes=auto)
        assert plan.file_homes == tuple(range(moved)) and plan.resident == ()
        assert plan.host_bytes <= budget
    with pytest.raises(TierError, match=r"staging buffers: 2 x .*prefetch_depth"):
        plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=need_in_file - 1,
                  buffer_count=2, homes=auto)
    with pytest.raises(TierError, match="weight_homes='auto'"):  # "host" says how
        plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=need_in_file,
                  buffer_count=2, homes=Homes("host", 2, 2))


def test_storage_homes_let_a_budget_keep_more_buckets_resident() -> None:
    sizes = (1000, 1000, 1000, 1000)
    storage = Homes("storage", 2, 2)
    base = plan_tier(buckets(*sizes), BF16_FLOW, storage=True, budget_bytes=None,
                     buffer_count=2, homes=storage).host_bytes
    plan = plan_tier(buckets(*sizes), BF16_FLOW, storage=True,
                     budget_bytes=base + 2 * 1000 * BF16_FLOW.resident, buffer_count=2,
                     homes=storage)
    assert plan.resident == (2, 3) and plan.file_homes == plan.tier == (0, 1)


def test_homes_the_rule_refuses() -> None:
    with pytest.raises(TierError, match="weight_homes='storage' .*storage_path"):
        plan_tier(buckets(1000), BF16_FLOW, storage=False, budget_bytes=None, buffer_count=2,
                  homes=Homes("storage", 2, 2))
    with pytest.raises(TierError, match="fp32 masters"):
        plan_tier(buckets(1000), FP32_FLOW, storage=True, budget_bytes=None, buffer_count=2,
                  homes=Homes("host", 4, 2))
    # fp32 "host" with every bucket resident: no tier bucket, nothing to refuse
    assert plan_tier(buckets(1000), FP32_FLOW, storage=True, budget_bytes=10**9,
                     buffer_count=2, homes=Homes("host", 4, 2)).tier == ()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 24), st.integers(1, 1 << 20))
def test_an_aligned_span_covers_its_bytes_within_a_staging_buffer(offset: int,
                                                                  nbytes: int) -> None:
    start, length, skip = aligned_span(offset, nbytes)
    assert start % ALIGN == 0 and length % ALIGN == 0
    assert start + skip == offset and start + length >= offset + nbytes
    assert length <= aligned(nbytes) + ALIGN  # what a staging buffer holds beyond the home


# ---------------------------------------------------------------------------- DeepSpeed
ZERO3 = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}


@pytest.mark.parametrize(("param", "want"), [
    ({"device": "cpu", "pin_memory": False},
     {"weights": "flow", "weight_homes": "host", "pin_memory": False}),
    ({"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 1e8,
      "max_in_cpu": 1e9},  # sizes the engine derives itself: accepted, listed
     {"weights": "flow", "weight_homes": "storage", "prefetch_depth": 2,
      "storage_path": "/nvme"}),
    ({"device": "none"}, {"weights": "stationary"}),
])
def test_offload_param_is_weight_flow(param: dict[str, Any], want: dict[str, Any]) -> None:
    config, _ = so.from_deepspeed({"zero_optimization": {**ZERO3, "offload_param": param}})
    assert {k: getattr(config, k) for k in want} == want


@pytest.mark.parametrize(("zero", "words"), [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs zero_optimization.stage 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "with the same nvme_path"),
    ({**ZERO3, "offload_param": {"device": "nvme", "nvme_path": "/other"}},
     "with the same nvme_path"),
    ({**ZERO3, "offload_param": {"device": "cpu", "nvme_path": "/nvme"}},
     "nvme_path is set but"),
    ({**ZERO3, "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 1}},
     "buffer_count=1: use a whole number >= 2"),
    ({**ZERO3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                     "pin_memory": True},
      "offload_param": {"device": "cpu", "pin_memory": False}}, "one setting here"),
    ({**ZERO3, "offload_param": {"device": "disk"}}, "use 'cpu', 'nvme' or 'none'"),
])
def test_offload_param_that_differs_is_refused_naming_it(zero: dict[str, Any],
                                                         words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        so.from_deepspeed({"zero_optimization": zero})
