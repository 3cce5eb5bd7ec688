"""Scale-out on torch.distributed: torchrun plumbing, dp x sp groups, Ulysses attention.

    from superoffload.distributed import init_distributed, get_groups, apply_ulysses
    info = init_distributed(sp=2)                 # under torchrun; gloo on CPU, nccl on CUDA
    apply_ulysses(model, get_groups().sp_group)

See docs/distributed.md. Data parallel of the offloaded optimizer state over PyTorch's FSDP2
(each rank keeps and steps its shards; HSDP and Ulysses on one DeviceMesh, mesh.py):
``superoffload.distributed.fsdp`` (imported on demand: it pulls in the engine). Our GPT's
Ulysses adapter (``apply_ulysses``,
``remove_ulysses``, ``UlyssesSelfAttention``) lives in ``ulysses_gpt.py`` and loads on first
use, so importing this package does not import the model zoo.
"""

from typing import Any

from superoffload.distributed.groups import (
    ParallelGroups,
    ParallelLayout,
    create_groups,
    plan_parallel_layout,
)
from superoffload.distributed.process_group import (
    DistInfo,
    DistributedError,
    add_parallel_args,
    collective_guard,
    dist_info,
    get_groups,
    init_distributed,
    init_from_args,
    shutdown,
)
from superoffload.distributed.sequence_parallel import (
    average_gradients,
    average_gradients_in_backward,
    mean_over_group,
    sequence_positions,
    split_sequence,
)
from superoffload.distributed.ulysses import (
    UlyssesAttention,
    check_sequence_split,
    check_ulysses_shapes,
    heads_to_seq,
    seq_to_heads,
    ulysses_attention,
)

_GPT_ADAPTER = ("UlyssesSelfAttention", "apply_ulysses", "remove_ulysses")


def __getattr__(name: str) -> Any:
    if name in _GPT_ADAPTER:
        from superoffload.distributed import ulysses_gpt

        return getattr(ulysses_gpt, name)
    raise AttributeError(f"module 'superoffload.distributed' has no attribute {name!r}")


__all__ = [
    "DistInfo",
    "DistributedError",
    "ParallelGroups",
    "ParallelLayout",
    "UlyssesAttention",
    "UlyssesSelfAttention",
    "add_parallel_args",
    "apply_ulysses",
    "average_gradients",
    "average_gradients_in_backward",
    "check_sequence_split",
    "check_ulysses_shapes",
    "collective_guard",
    "create_groups",
    "dist_info",
    "get_groups",
    "heads_to_seq",
    "init_distributed",
    "init_from_args",
    "mean_over_group",
    "plan_parallel_layout",
    "remove_ulysses",
    "seq_to_heads",
    "sequence_positions",
    "shutdown",
    "split_sequence",
    "ulysses_attention",
]
