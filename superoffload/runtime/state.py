"""Optimizer state of the engine, laid out per bucket (paper §4.2, weight-stationary).

Legend: ``master`` = fp32 master weights, ``exp_avg``/``exp_avg_sq`` = Adam moments (m, v),
``grad_host`` = the host buffer a bucket's gradients land in, ``lp_host`` = the host buffer of
the low-precision (bf16/fp16) weight copy written by the CPU kernel (host-side casting).

Each bucket owns flat buffers (one allocation, reused every iteration, pinned on CUDA);
parameters are views into them. Host buckets keep master/m/v on the host; GPU tail buckets
keep them on the device. An fp32 model's tail buckets use the parameters themselves as the
master (no copy: "an fp32 model trains with fp32 device weights").

``ParamState`` is the placement-free form (CPU tensors) used to re-plan, checkpoint and load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from superoffload.plan.buckets import Bucket

Alloc = Callable[[int, torch.dtype], torch.Tensor]


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
    flat: list[torch.Tensor] = field(default_factory=list)
    """The underlying allocations (kept alive; counted in memory reports)."""

    @property
    def on_device(self) -> bool:
        return self.bucket.on_device

    def ensure_snapshot(self, alloc_host: Alloc) -> list[torch.Tensor]:
        if self.snapshot is None:
            numel = self.bucket.numel
            flat = alloc_host(3 * numel, torch.float32)
            self.flat.append(flat)
            self.snapshot = _views(flat, [p.shape for p in self.params] * 3)
        return self.snapshot


def _views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def initial_state(param: torch.nn.Parameter) -> ParamState:
    """Fresh state: master = the parameter in fp32 (on the CPU), zero moments."""
    master = param.detach().to("cpu", torch.float32).clone()
    return ParamState(master, torch.zeros_like(master), torch.zeros_like(master), 0)


def build_buffers(
    bucket: Bucket,
    params: Sequence[torch.nn.Parameter],
    states: Sequence[ParamState],
    *,
    alloc_host: Alloc,
    alloc_device: Alloc,
    grad_host_dtype: torch.dtype,
    lp_host: bool,
) -> BucketBuffers:
    """Allocate a bucket's buffers and fill them from ``states`` (placement-free)."""
    shapes = [p.shape for p in params]
    numel = bucket.numel
    model_fp32 = all(p.dtype == torch.float32 for p in params)
    alloc = alloc_device if bucket.on_device else alloc_host
    flats: list[torch.Tensor] = []
    if bucket.on_device and model_fp32:
        master = [p.data for p in params]  # the device weights are the master
    else:
        flat_master = alloc(numel, torch.float32)
        flats.append(flat_master)
        master = _views(flat_master, shapes)
    flat_m, flat_v = alloc(numel, torch.float32), alloc(numel, torch.float32)
    flats += [flat_m, flat_v]
    exp_avg, exp_avg_sq = _views(flat_m, shapes), _views(flat_v, shapes)
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
        buffers.grad_host = _views(flat_g, shapes)
        if lp_host:
            flat_lp = alloc_host(numel, params[0].dtype)
            flats.append(flat_lp)
            buffers.lp_host = _views(flat_lp, shapes)
            with torch.no_grad():
                for view, p in zip(buffers.lp_host, params):
                    view.copy_(p.data)
    return buffers


def export_state(buffers: BucketBuffers, steps: Sequence[int]) -> list[ParamState]:
    """Placement-free copies (CPU, fp32) of a bucket's state; ``steps`` per parameter."""
    out = []
    for i in range(len(buffers.params)):
        out.append(
            ParamState(
                buffers.master[i].detach().to("cpu", torch.float32, copy=True),
                buffers.exp_avg[i].detach().to("cpu", copy=True),
                buffers.exp_avg_sq[i].detach().to("cpu", copy=True),
                int(steps[i]),
            )
        )
    return out


def buffers_nbytes(buffers: Sequence[BucketBuffers]) -> tuple[int, int]:
    """(host bytes, device bytes) held by the engine's buffers."""
    host = device = 0
    for b in buffers:
        for t in b.flat:
            n = t.numel() * t.element_size()
            if t.device.type == "cpu":
                host += n
            else:
                device += n
    return host, device
