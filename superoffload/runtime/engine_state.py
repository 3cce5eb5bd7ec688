"""Optimizer state of the engine, laid out per bucket (paper §4.2, weight-stationary).

Legend: ``master`` = fp32 master weights, ``exp_avg``/``exp_avg_sq`` = Adam moments (m, v),
``grad_host`` = the host buffer a bucket's gradients land in, ``lp_host`` = the host buffer of
the low-precision (bf16/fp16) weight copy written by the CPU kernel (host-side casting).

Each bucket owns flat buffers (one allocation, reused every iteration, pinned on CUDA);
parameters are views into them. Host buckets keep master/m/v on the host; GPU tail buckets
keep them on the device. An fp32 model's tail buckets use the parameters themselves as the
master (no copy: "an fp32 model trains with fp32 device weights").

``ParamState`` is the placement-free form (CPU tensors) used to re-plan, checkpoint and load.
``EngineState`` is what every part of the engine shares about the model and its buckets
(the launch and STV phases, the transports, hooks, weight-flow, checkpoints read it; only the
engine and its transport write the bucket table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from superoffload.plan.buckets import Bucket, ParamSpec
from superoffload.plan.schedule import Schedule

Alloc = Callable[[int, torch.dtype], torch.Tensor]
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``OffloadConfig.precision`` -> the dtype the trainable parameters must have."""


@dataclass(slots=True)
class ParamState:
    """fp32 master, moments and step count of one parameter, on the CPU."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


@dataclass(slots=True)
class BucketBuffers:
    """Flat buffers of one bucket and per-parameter views into them."""

    bucket: Bucket
    params: list[torch.nn.Parameter]
    """The model's parameters (device), in bucket order."""
    master: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    grad_host: list[torch.Tensor] = field(default_factory=list)
    """Host buckets: where D2H writes each gradient (fp32, or model dtype for host casting)."""
    lp_host: list[torch.Tensor] | None = None
    """Host buckets of a low-precision model with host-side param casting."""
    snapshot: list[torch.Tensor] | None = None
    """Snapshot rollback: pre-step copies [p, m, v] per parameter (12 B/param)."""
    prepared: dict[Any, Any] = field(default_factory=dict)
    """Kernel calls prepared once (``kernels.prepare_adam``), by (members, grads given)."""
    flat: list[torch.Tensor] = field(default_factory=list)
    """The underlying allocations (kept alive; counted in memory reports)."""
    on_device: bool = field(init=False, default=False)
    """A GPU tail bucket (the bucket's placement; a plain field: read on every launch)."""

    def __post_init__(self) -> None:
        self.on_device = self.bucket.on_device

    def ensure_snapshot(self, alloc_host: Alloc) -> list[torch.Tensor]:
        if self.snapshot is None:
            numel = self.bucket.numel
            flat = alloc_host(3 * numel, torch.float32)
            self.flat.append(flat)
            # the masters' shapes: a weight-flow parameter between uses holds no elements
            self.snapshot = split_views(flat, [m.shape for m in self.master] * 3)
        return self.snapshot


def split_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` shaped as ``shapes`` (a bucket's per-parameter views)."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def unallocated_buffers(bucket: Bucket, params: Sequence[torch.nn.Parameter], *,
                        lp_host: bool) -> BucketBuffers:
    """A storage-tier bucket's buffers: no memory of their own; runtime/tier.py points them
    into a pool slot while the bucket is worked on (empty lists otherwise, so a stray use
    fails loudly instead of reading another bucket's numbers)."""
    return BucketBuffers(bucket, list(params), [], [], [], grad_host=[],
                         lp_host=[] if lp_host else None)


def initial_state(param: torch.nn.Parameter) -> ParamState:
    """Fresh state: master = the parameter in fp32 (on the CPU), zero moments."""
    master = param.detach().to("cpu", torch.float32).clone()
    return ParamState(master, torch.zeros_like(master), torch.zeros_like(master), 0)


class InitialStates(Mapping[int, ParamState]):
    """``initial_state`` of parameters ``indices``, made when read: a build takes them bucket
    by bucket, so a model whose state exceeds host memory (the storage tier) never holds
    them all at once."""

    def __init__(self, params: Sequence[torch.nn.Parameter], indices: Sequence[int]) -> None:
        self.params, self.indices = params, list(indices)
        self._known = frozenset(self.indices)

    def __getitem__(self, index: int) -> ParamState:
        if index not in self._known:
            raise KeyError(index)
        return initial_state(self.params[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_buffers(
    bucket: Bucket,
    params: Sequence[torch.nn.Parameter],
    states: Sequence[ParamState],
    *,
    alloc_host: Alloc,
    alloc_device: Alloc,
    grad_host_dtype: torch.dtype,
    lp_host: bool,
    moment_dtype: torch.dtype = torch.float32,
) -> BucketBuffers:
    """Allocate a bucket's buffers and fill them from ``states`` (placement-free)."""
    # the states' shapes: a weight-flow parameter between uses holds no elements (a re-plan)
    shapes = [st.master.shape for st in states]
    numel = bucket.numel
    model_fp32 = all(p.dtype == torch.float32 for p in params)
    alloc = alloc_device if bucket.on_device else alloc_host
    flats: list[torch.Tensor] = []
    if bucket.on_device and model_fp32:
        # the device weights are the master
        master = [p.data for p in params]
    else:
        flat_master = alloc(numel, torch.float32)
        flats.append(flat_master)
        master = split_views(flat_master, shapes)
    # host buckets may keep bf16 moments (OffloadConfig.optimizer_state_dtype); tail buckets
    # are stepped on the device by torch's fused Adam, with fp32 moments
    mdt = torch.float32 if bucket.on_device else moment_dtype
    flat_m, flat_v = alloc(numel, mdt), alloc(numel, mdt)
    flats += [flat_m, flat_v]
    exp_avg, exp_avg_sq = split_views(flat_m, shapes), split_views(flat_v, shapes)
    with torch.no_grad():
        for i, st in enumerate(states):
            if master[i].data_ptr() != params[i].data_ptr():
                master[i].copy_(st.master)
            exp_avg[i].copy_(st.exp_avg)
            exp_avg_sq[i].copy_(st.exp_avg_sq)
    buffers = BucketBuffers(bucket, list(params), master, exp_avg, exp_avg_sq, flat=flats)
    if not bucket.on_device:
        flat_g = alloc_host(numel, grad_host_dtype)
        flat_g.zero_()
        flats.append(flat_g)
        buffers.grad_host = split_views(flat_g, shapes)
        if lp_host:
            flat_lp = alloc_host(numel, params[0].dtype)
            flats.append(flat_lp)
            buffers.lp_host = split_views(flat_lp, shapes)
            with torch.no_grad():
                for view, p, st in zip(buffers.lp_host, params, states):
                    # a released weight-flow parameter: its weights are the master's
                    # rounding (the kernel's copy rounds to nearest even, as copy_ does)
                    source = p.data
                    if p.numel() != view.numel():
                        source = st.master
                    view.copy_(source)
    return buffers


def adopt_value(master: torch.Tensor, written: torch.Tensor, lp: torch.Tensor | None) -> None:
    """A weight written outside the engine becomes the optimizer's (runtime/weight_writes.py):
    ``master`` (fp32, any placement) takes ``written``; for a low-precision model only where
    the written value differs from what the device held (the master rounded to its dtype), so
    rewriting unchanged weights (a restore of the same values) keeps the masters' fp32 bits.
    ``lp``: the host low-precision copy, if any."""
    w = written.detach().reshape(master.shape).to(master.device)
    with torch.no_grad():
        if w.dtype == torch.float32:
            master.copy_(w)
        else:
            changed = master.to(w.dtype) != w
            master.copy_(torch.where(changed, w.float(), master))
        if lp is not None:
            lp.copy_(w)


def export_state(buffers: BucketBuffers, steps: Sequence[int]) -> list[ParamState]:
    """Placement-free copies (CPU, fp32) of a bucket's state; ``steps`` per parameter."""
    out = []
    for i in range(len(buffers.params)):
        out.append(
            ParamState(
                buffers.master[i].detach().to("cpu", torch.float32, copy=True),
                buffers.exp_avg[i].detach().to("cpu", torch.float32, copy=True),
                buffers.exp_avg_sq[i].detach().to("cpu", torch.float32, copy=True),
                int(steps[i]),
            )
        )
    return out


@dataclass(slots=True)
class EngineState:
    """The model's parameters and the engine's book of them (one per engine).

    Indices are positions in ``model.named_parameters()`` order ("parameter index")."""

    model: torch.nn.Module
    names: list[str]
    params: list[torch.nn.Parameter]
    shapes: list[torch.Size]
    """Shapes at construction (a weight-flow parameter released later holds 0 elements)."""
    index: dict[int, int]
    """``id(param)`` -> parameter index."""
    trainable: list[int]
    """Indices of the parameters the optimizer owns (requires_grad and in a param group)."""
    group_of: dict[int, int]
    """Parameter index -> param group."""
    model_dtype: torch.dtype
    steps: list[int]
    """Optimizer steps taken, per parameter index (0 for frozen ones)."""
    schedule: Schedule | None = None
    """The schedule in force (``plan.schedule.resolve_schedule``); set by every build."""
    buffers: list[BucketBuffers] = field(default_factory=list)
    """Per bucket id: the buffers the optimizer steps (a ZeRO rank: its shard's)."""
    bucket_of: dict[int, int] = field(default_factory=dict)
    """Trainable parameter index -> bucket id."""

    @classmethod
    def from_model(cls, model: torch.nn.Module,
                   groups: Sequence[Mapping[str, Any]]) -> EngineState:
        """Index ``model``'s parameters; ``groups`` are the normalised param groups."""
        named = list(model.named_parameters())
        params = [p for _, p in named]
        index = {id(p): i for i, p in enumerate(params)}
        group_of: dict[int, int] = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                if id(p) not in index:
                    raise ValueError(f"optimizer[{g}]: a parameter does not belong to the model")
                group_of[index[id(p)]] = g
        trainable = [i for i, p in enumerate(params) if p.requires_grad and i in group_of]
        if not trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {params[i].dtype for i in trainable}
        if len(dtypes) != 1:
            raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast "
                            "the model to one dtype first (model.to(torch.bfloat16))")
        return cls(model=model, names=[n for n, _ in named], params=params,
                   shapes=[p.shape for p in params], index=index, trainable=trainable,
                   group_of=group_of, model_dtype=dtypes.pop(), steps=[0] * len(params))

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """The trainable parameters as the rule book's ``plan_buckets`` takes them."""
        return tuple(ParamSpec(i, self.shapes[i].numel(), True, self.names[i])
                     for i in self.trainable)

    @property
    def dtype_name(self) -> str:
        """"float32", "bfloat16" or "float16"."""
        return str(self.model_dtype).removeprefix("torch.")

    def signature(self) -> list[list[Any]]:
        """[name, shape, dtype, trainable] per parameter: what a checkpoint must match."""
        return [[n, list(shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
                for n, p, shape in zip(self.names, self.params, self.shapes)]

    def check_placement(self, device: torch.device, precision: str) -> None:
        """Every parameter on the engine's device, dense and contiguous; the trainable dtype
        the one asked for. Checked when the engine is built, not at the first step."""
        for i in self.trainable:
            if not self.params[i].is_contiguous():
                raise ValueError(
                    f"model parameter {self.names[i]!r} is not contiguous (strides "
                    f"{self.params[i].stride()}); the engine's buffers are flat: make it "
                    f"contiguous first (p.data = p.data.contiguous())")
        for name, module in self.model.named_modules():
            if getattr(module, "sparse", False) and isinstance(
                    module, torch.nn.Embedding | torch.nn.EmbeddingBag):
                raise ValueError(
                    f"module {name!r} produces sparse gradients (sparse=True); the engine "
                    "offloads dense gradients: build it with sparse=False")
        for i, p in enumerate(self.params):
            if p.device.type == "cpu" and hasattr(p, "device_mesh"):
                # an FSDP2 shard kept on the host by CPUOffloadPolicy (weight-flow)
                continue
            if p.device.type != device.type or (device.type == "cuda"
                                                 and p.device.index != device.index):
                raise ValueError(f"model parameter {self.names[i]!r} is on {p.device} but "
                                 f"OffloadConfig.device resolves to {device}; move the model "
                                 "first (model.to(...))")
        if self.model_dtype not in PRECISION_DTYPES.values():
            raise TypeError(f"trainable parameters have dtype {self.model_dtype}; use float32, "
                            "bfloat16 or float16")
        want = PRECISION_DTYPES.get(precision)
        if want is not None and self.model_dtype != want:
            from superoffload.config import ConfigError

            raise ConfigError(
                f"OffloadConfig.precision={precision!r} (a DeepSpeed config's bf16.enabled / "
                f"fp16.enabled) but the model's trainable parameters are {self.model_dtype}; "
                f"cast the model first, e.g. model.to({want})")
