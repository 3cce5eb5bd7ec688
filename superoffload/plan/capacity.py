"""The largest model a machine can train with a policy (memory only, DESIGN.md §5).

Model family: GPT-3-like shapes, hidden = 128 x layers (shapes.gpt_by_layers), bisected on the
layer count until nothing fits. "superoffload" may use any of its memory-saving settings, found
by the search ``tune`` starts from (plan/feasible.py: the ratio down from 1 when the host
binds, weight-flow when the device binds; bf16 moments only when allowed), also with data
parallel; "zero-offload" is DeepSpeed ZeRO-2 +
offload_optimizer with the device buffers its code allocates (plan/deepspeed.py: bf16 weights,
the 5e8-element reduce bucket, per-parameter gradient temporaries, activations); "gpu" keeps
all 18 B/param on the device. Data parallel (dp > 1): the check is
per rank over FSDP2 (each holds 1/dp of the weights, gradients and offloaded state, and
FSDP2's unsharded units at their moments: plan/memory_fsdp.py).
"""

from __future__ import annotations

from typing import Literal

from superoffload.config import OffloadConfig, choices_of
from superoffload.plan.feasible import Feasibility, search
from superoffload.plan.grad_accum import resolve_decided
from superoffload.plan.hardware import HardwareProfile
from superoffload.plan.memory import check_fits, memory
from superoffload.plan.parallel import rank_profile
from superoffload.plan.shapes import ModelShape
from superoffload.plan.simulator import choose_weights
from superoffload.plan.techniques import SYSTEMS
from superoffload.plan.tier_budget import tier_config

MAX_LAYERS = 1000


def gpt_by_layers(layers: int, *, seq: int, micro_batch: int, vocab: int = 50257,
                  activation_checkpointing: bool = True, dp: int = 1,
                  ranks_per_host: int = 1) -> ModelShape:
    """GPT-3-like shape: hidden = 128 x layers, head size 128 (13B: 40 x 5120; 175B: 96 x 12288)."""
    hidden = 128 * layers
    return ModelShape(layers=layers, hidden=hidden, heads=layers, vocab=vocab, seq=seq,
                      micro_batch=micro_batch, activation_checkpointing=activation_checkpointing,
                      dp=dp, ranks_per_host=ranks_per_host)


def fit_problems(shape: ModelShape, prof: HardwareProfile, system: str,
                 config: OffloadConfig | None = None, *,
                 allow_bf16_moments: bool = False,
                 weights: Literal["stationary", "flow"] | None = None,
                 storage: bool = False) -> list[str]:
    """Reasons `shape` does not fit (empty list when it does). For "superoffload" without a
    config, every setting that saves memory is searched (plan/feasible.py: the ratio down from
    1 when the host binds, weight-flow when the device binds, bf16 moments only when
    `allow_bf16_moments`): the same search ``tune`` starts from; ``weights`` ("stationary" or
    "flow") keeps the weight policy fixed in it; ``storage``: what host memory cannot hold
    may go to the profile's storage tier (plan/tier_budget.py)."""
    return list(feasibility(shape, prof, system, config, allow_bf16_moments=allow_bf16_moments,
                            weights=weights, storage=storage).problems)


def feasibility(shape: ModelShape, prof: HardwareProfile, system: str,
                config: OffloadConfig | None = None, *, allow_bf16_moments: bool = False,
                weights: Literal["stationary", "flow"] | None = None,
                storage: bool = False) -> Feasibility:
    """``fit_problems``' answer with the setting found (``Feasibility.config``; for a given
    config or another system, the config itself when it fits)."""
    if config is not None or system != "superoffload":
        # per rank: its share of the host
        prof = rank_profile(prof, shape.ranks_per_host)
        auto = None
        if config is not None and config.weights == "auto" and system == "superoffload":
            # as plan.simulate decides it
            auto = choose_weights(shape, prof, config)
        plan = resolve_decided(shape, prof, system, config, None, auto=auto)
        why = check_fits(memory(shape, prof, plan), prof)
        # a config that does not fit is no setting found: the reasons say why
        fitting = None if why else config
        return Feasibility(fitting, None, tuple(why))
    # bf16 moments change the maths: searched only when allowed
    dtypes = choices_of("optimizer_state_dtype") if allow_bf16_moments else ("fp32",)
    base = OffloadConfig()
    if storage:
        if not prof.has_storage:
            return Feasibility(None, None, (f"profile {prof.name} has no storage tier",))
        base = base.replace(**tier_config(shape, prof))
    if weights is not None:
        return search(shape, prof, base.replace(weights=weights), fixed={"weights"},
                      dtypes=dtypes)
    return search(shape, prof, base, dtypes=dtypes)


def max_model_size(prof: HardwareProfile, system: str = "superoffload", seq: int = 1024,
                   micro_batch: int = 1, config: OffloadConfig | None = None,
                   activation_checkpointing: bool = True, dp: int = 1,
                   ranks_per_host: int = 1, allow_bf16_moments: bool = False) -> int:
    """Parameters of the largest GPT-like model that fits `prof` running `system` (default
    "superoffload"; 0 if none); with `dp` ranks (`ranks_per_host` per host) every rank must fit
    (plan/parallel.py)."""
    if system not in SYSTEMS:
        raise ValueError(f"system={system!r}: use one of {', '.join(SYSTEMS)}")
    best = 0
    lo, hi = 1, MAX_LAYERS
    # memory grows monotonically with layers (and hidden), so bisect on the layer count
    while lo <= hi:
        mid = (lo + hi) // 2
        shape = gpt_by_layers(mid, seq=seq, micro_batch=micro_batch,
                              activation_checkpointing=activation_checkpointing, dp=dp,
                              ranks_per_host=ranks_per_host)
        if fit_problems(shape, prof, system, config, allow_bf16_moments=allow_bf16_moments):
            hi = mid - 1
        else:
            best = shape.params
            lo = mid + 1
    return best
