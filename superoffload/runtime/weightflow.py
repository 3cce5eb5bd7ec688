"""Weight-flow: block weights live on the host and stream to the device per block (paper §4.5).

Under weight-flow the optimizer runs on the host for every bucket (the engine plans with
ratio 1), so the host copy each CPU step writes -- the bf16 copy (``lp_host``) of a
low-precision model, the fp32 master of an fp32 model -- is the weights' *home*. The
transformer blocks (the longest ``nn.ModuleList``, as ``plan.ModelShape.from_module`` reads
it) stream; everything else (embeddings, final norm, head, tied or frozen weights) stays on
the device as in weight-stationary.

Per block ``k`` (``param.data`` is swapped between a device buffer and an empty placeholder,
the mechanism ZeRO-3 uses; autograd saves leaf parameters by reference, so backward reads
whatever buffer is current):

* forward pre-hook: make ``k`` resident (fetch, or wait for its prefetch) and prefetch the
  next blocks while fewer than ``prefetch_depth + 1`` are resident (the memory bound);
* forward post-hook: release ``k`` -- except the last ``prefetch_depth + 1`` blocks of a
  forward that will be differentiated, which backward needs first -- and wrap the output
  in an identity autograd node whose backward fetches ``k`` before its backward runs;
* backward: that node makes ``k`` resident and prefetches ``k-1, k-2, ...``; block ``j`` is
  released once every one of its streamed parameters has accumulated its gradient (a
  post-accumulate-grad hook; AccumulateGrad needs the full-shape parameter) and the
  backward has moved below it;
* activation-checkpoint recompute re-enters the forward hooks inside backward
  (``hook_base.in_backward()``): the pre-hook acts as the backward entry of ``k`` (``on_pre``
  says why), the post-hook does nothing.

A fetch is a frozen task on its own lane (the ``fetch`` thread, driving the device ops' H2D
stream on CUDA) and waits for the CPU step (or rollback/replay) that last wrote the block's
home buckets; it records a ``weight_fetch`` span on the h2d lane. A home may also live in the
storage tier's file (``OffloadConfig.weight_homes``): the fetch then reads the version in force
through the tier's staging buffers (runtime/home_reads.py), so neither the device nor host
memory holds the streamed weights beyond the blocks in flight (docs/storage.md).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from superoffload.runtime.fetch import FetchTask, find_blocks, streamed_params
from superoffload.runtime.flow_hooks import grad_hook, post_hook, pre_hook, wrap_output
from superoffload.runtime.home_reads import HomeSpan, copy_spans, spans
from superoffload.runtime.hook_base import in_backward
from superoffload.telemetry.events import KIND_WAIT, LANE_COMPUTE

if TYPE_CHECKING:
    from superoffload.runtime.devices import DeviceOps
    from superoffload.runtime.launch import Launcher


@dataclass(slots=True)
class _Resident:
    flat: torch.Tensor
    future: Future[Any]
    nbytes: int


@dataclass(slots=True)
class FlowStats:
    """What the weight-flow schedule did (tests read it; telemetry gets the scalars)."""

    fetches: int = 0
    fetch_order: list[tuple[str, int]] = field(default_factory=list)
    """("f"|"b"|"r"|"m", block) per fetch submitted: forward, backward, recompute-time,
    materialize (every block at once: checkpoints, switching, close)."""
    peak_resident_blocks: int = 0
    peak_resident_bytes: int = 0
    """Peak bytes of blocks in use."""
    peak_held_bytes: int = 0
    """Peak bytes of device weight buffers (in use + kept for reuse)."""
    max_fetch_order: int = 10_000


class WeightFlow:
    """Streams the blocks of ``model`` (see the module docstring).

    ``launcher``: the engine's iteration in progress (its number, its watchdog) and its parts
    (state, telemetry, the waits, the per-bucket futures a fetch waits for); ``home``: where a
    parameter's host copy lives (the transport's; runtime/transport.py)."""

    def __init__(self, model: torch.nn.Module, launcher: Launcher, device_ops: DeviceOps,
                 home: Callable[[int], torch.Tensor], depth: int, lane: Any) -> None:
        self.launcher, self.parts, self.device_ops = launcher, launcher.parts, device_ops
        self.home = home
        self.depth = depth
        self.lane = lane
        st = self.parts.state
        blocks = find_blocks(model)
        streamable = {id(st.params[i]) for i in st.trainable if i in st.bucket_of}
        self.blocks = blocks
        self.params = streamed_params(model, blocks, streamable)
        self.indices = [[st.index[id(p)] for p in ps] for ps in self.params]
        self._streamed = {id(p) for ps in self.params for p in ps}
        self.streamed_indices: frozenset[int] = frozenset(i for ids in self.indices for i in ids)
        """Parameter indices of every streamed parameter (fixed: read per bucket launch)."""
        # full shapes, read while every block is resident (released parameters hold 0 elements)
        self.shapes = [[p.shape for p in ps] for ps in self.params]
        self.numel = [sum(p.numel() for p in ps) for ps in self.params]
        self.dtype = st.model_dtype
        self.device = device_ops.device
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.resident: dict[int, _Resident] = {}
        self._pool: list[torch.Tensor] = []
        self.resident_bytes = 0
        self.iteration_peak_bytes = 0
        """Peak of resident_bytes since the last iteration boundary (telemetry)."""
        self.stats = FlowStats()
        self._seen: list[set[int]] = [set() for _ in blocks]
        self._cursor = -1
        self._backward = False
        self.handles: list[Any] = []

    def is_streamed(self, param: torch.Tensor) -> bool:
        return id(param) in self._streamed

    # ------------------------------------------------------------------ lifetime
    @property
    def streamed_bytes(self) -> int:
        """Bytes of all streamed weights (what weight-stationary would keep resident)."""
        return sum(self.numel) * self._empty.element_size()

    @property
    def block_bytes(self) -> list[int]:
        return [n * self._empty.element_size() for n in self.numel]

    def attach(self) -> None:
        """Install the hooks and release every streamed block (weights already in their homes)."""
        ref = weakref.ref(self)  # hooks must not keep a dropped engine alive (lifetime.py)
        for k, block in enumerate(self.blocks):
            if not self.numel[k]:
                continue
            owner = weakref.ref(block)
            self.handles.append(block.register_forward_pre_hook(pre_hook(ref, owner, k)))
            self.handles.append(block.register_forward_hook(post_hook(ref, owner, k)))
            for p in self.params[k]:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    grad_hook(ref, weakref.ref(p), k)))
        for k in range(len(self.blocks)):
            self._release_now(k, force=True)

    def detach(self) -> None:
        """Make every block resident again (weight-stationary) and remove the hooks."""
        self.materialize()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.resident.clear()
        self._pool.clear()
        self.resident_bytes = 0

    def restore_in_place(self) -> None:
        """Every streamed parameter holds its latest weights again (from its home), copied
        synchronously without the lanes — for an engine that failed or is shutting down —
        and the hooks are removed. A block whose home in the file cannot be read is left
        released (0 elements, so a use fails loudly), saying why."""
        for h in self.handles:
            h.remove()
        self.handles = []
        with torch.no_grad():
            for k, ps in enumerate(self.params):
                fresh = [torch.empty(shape, dtype=self.dtype, device=self.device)
                         for shape in self.shapes[k]]
                src, dst, stored = self._sources(k, fresh)
                try:
                    if stored:
                        copy_spans(self._tier(), stored, self.device_ops, self.parts.recorder,
                                   iteration=self.launcher.iteration)
                        self.device_ops.synchronize()
                except Exception as exc:  # the engine is going: say it, keep closing
                    warnings.warn(f"weight-flow: block {k}'s weights could not be read back "
                                  f"from the storage tier ({exc}); its parameters stay "
                                  "released (0 elements)", RuntimeWarning, stacklevel=2)
                    continue
                for home, d in zip(src, dst):
                    d.copy_(home)
                for p, t in zip(ps, fresh):
                    p.data = t
        self.resident.clear()
        self._pool.clear()
        self.resident_bytes = 0

    def materialize(self) -> None:
        """Fetch every block and wait (checkpoints, switching policy); exceeds the bound."""
        for k in range(len(self.blocks)):
            self.ensure(k, kind="m")

    def release_all(self) -> None:
        for k in list(self.resident):
            self._release_now(k, force=True)

    # ------------------------------------------------------------------ fetch / release
    def _home_buckets(self, k: int) -> list[int]:
        """The buckets holding block k's weights."""
        return sorted({self.parts.state.bucket_of[i] for i in self.indices[k]})

    def submit(self, k: int, kind: str) -> None:
        """Allocate block k's device buffer, point its parameters at it, queue the copy."""
        if not 0 <= k < len(self.blocks) or k in self.resident or not self.numel[k]:
            return
        launcher, parts = self.launcher, self.parts
        flat = self._alloc(self.numel[k])
        views, offset = [], 0
        for shape in self.shapes[k]:
            n = shape.numel()
            views.append(flat[offset: offset + n].view(shape))
            offset += n
        after = tuple(f for f in (parts.publishes.home_ready.get(b)
                                  for b in self._home_buckets(k)) if f is not None)
        be = self.device_ops
        ready = be.ready_token() if be.device.type == "cuda" else None
        src, dst, stored = self._sources(k, views)
        task = FetchTask(
            block=k, iteration=launcher.iteration, src_host=src, dst_device=dst,
            after=after, ready=ready, device_ops=be, recorder=parts.recorder,
            watchdog_s=launcher.current.frozen.config.watchdog_s, stored=stored,
            tier=self._tier() if stored else None,
        )
        with torch.no_grad():
            # pointed before the copy lands: nobody reads block k before ensure(k) waits for it
            for p, v in zip(self.params[k], views):
                p.data = v
        nbytes = self.numel[k] * flat.element_size()
        self.resident[k] = _Resident(flat, self.lane.submit(task), nbytes)
        self.resident_bytes += nbytes
        st = self.stats
        st.fetches += 1
        if len(st.fetch_order) < st.max_fetch_order:
            st.fetch_order.append((kind, k))
        # materialize() exceeds the bound on purpose (checkpoints, switching): no peak counted
        if kind == "m":
            return
        st.peak_resident_blocks = max(st.peak_resident_blocks, len(self.resident))
        st.peak_resident_bytes = max(st.peak_resident_bytes, self.resident_bytes)
        st.peak_held_bytes = max(st.peak_held_bytes, self.held_bytes)
        self.iteration_peak_bytes = max(self.iteration_peak_bytes, self.held_bytes)

    def _tier(self) -> Any:
        return self.parts.transport.tier

    def _sources(self, k: int, views: list[torch.Tensor]) -> tuple[
            tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[HomeSpan, ...]]:
        """Where block ``k``'s weights come from, for its device ``views``: (homes in host
        memory, their views, the spans of the homes in the storage tier's file)."""
        st, tier = self.parts.state, self._tier()
        src, dst, wanted = [], [], []
        for i, view in zip(self.indices[k], views):
            b = st.bucket_of[i]
            if tier is not None and tier.home_in_file(b):
                wanted.append((b, st.buffers[b].bucket.param_indices.index(i), view))
            else:
                src.append(self.home(i))
                dst.append(view)
        return tuple(src), tuple(dst), spans(tier, wanted) if wanted else ()

    @property
    def held_bytes(self) -> int:
        """Device bytes of weight buffers: resident blocks plus the reuse pool."""
        in_use = sum(_base_nbytes(r.flat) for r in self.resident.values())
        return in_use + sum(_base_nbytes(t) for t in self._pool)

    def _alloc(self, numel: int) -> torch.Tensor:
        """A device buffer for one block: a released one of the same size when pooled (no
        allocator round trip, no fresh page faults on the CPU), else a new one."""
        fits = [i for i, t in enumerate(self._pool) if t.numel() >= numel]
        if fits:
            i = min(fits, key=lambda j: self._pool[j].numel())  # best fit
            return self._pool.pop(i)[:numel]
        # none fits: give one back so at most depth + 1 buffers exist
        if self._pool:
            self._pool.pop(0)
        return self.device_ops.alloc_device(numel, self.dtype)

    def ensure(self, k: int, kind: str = "f") -> None:
        """Block k is resident and its copy has landed (the compute stream waits on CUDA)."""
        if not self.numel[k]:
            return
        self.submit(k, kind)
        res = self.resident[k]
        rec = self.parts.recorder
        if not res.future.done():
            t0 = rec.now()
            token = self.parts.in_flight.wait(res.future, f"fetch of block {k}",
                                              self.launcher.current.frozen.config.watchdog_s)
            rec.add(LANE_COMPUTE, KIND_WAIT, t0, rec.now(), iteration=self.launcher.iteration)
        else:
            token = res.future.result()
        self.device_ops.wait(token)

    def _release_now(self, k: int, *, force: bool = False) -> None:
        res = self.resident.pop(k, None)
        if res is not None:
            # an unused prefetch may still be copying: the compute stream orders after it
            # before the memory is handed out again
            self.device_ops.wait(self.parts.in_flight.wait(
                res.future, f"fetch of block {k}", self.launcher.current.frozen.config.watchdog_s))
            self.resident_bytes -= res.nbytes
            # at most depth + 1 buffers exist at any time: one more is dropped, not pooled
            if len(self.resident) + len(self._pool) < self.depth + 1:
                self._pool.append(_base(res.flat))
        if res is not None or force:
            with torch.no_grad():
                for p in self.params[k]:
                    p.data = self._empty

    def _top_up(self) -> None:
        """Prefetch in the current direction while fewer than depth + 1 blocks are resident."""
        step = -1 if self._backward else 1
        k = self._cursor + step
        ahead = 0
        while 0 <= k < len(self.blocks) and ahead < self.depth:
            if self.numel[k]:
                ahead += 1
                if k not in self.resident:
                    if len(self.resident) >= self.depth + 1:
                        return
                    self.submit(k, "b" if self._backward else "f")
            k += step

    # ------------------------------------------------------------------ phases
    def begin_forward(self) -> None:
        """Root forward pre-hook: a new pass starts in forward order."""
        self.release_all()
        self._backward = False
        self._cursor = -1
        self._seen = [set() for _ in self.blocks]
        self._top_up()

    def end_backward(self) -> None:
        """After backward (or at step()): nothing streamed stays resident."""
        self.release_all()
        self._backward = False
        self._cursor = -1

    def enter_backward(self, k: int) -> None:
        self._backward = True
        self._cursor = k
        for j in [j for j in self.resident if j > k and self._done(j)]:
            self._release_now(j)
        self.ensure(k, "b")
        self._top_up()

    def _done(self, j: int) -> bool:
        return len(self._seen[j]) == len(self.params[j])

    # ------------------------------------------------------------------ hooks
    def on_pre(self, k: int) -> None:
        """Forward pre-hook of block k."""
        if in_backward():
            # activation-checkpoint recompute, inside block k's backward: non-reentrant
            # checkpointing got here through the output node (a no-op then); reentrant
            # ran the forward under no_grad, so this is where backward meets block k
            self.enter_backward(k)
            return
        self._cursor = k
        self.ensure(k, "f")
        self._top_up()

    def on_post(self, k: int, output: Any) -> Any:
        """Forward hook of block k: release it (unless backward needs it first) and wrap the
        output so its backward fetches the block again."""
        if in_backward():
            return None
        grad = torch.is_grad_enabled()
        keep = grad and k >= self._keep_from()
        if not keep:
            self._release_now(k)
        if grad:
            return wrap_output(output, self, k)
        return None

    def _keep_from(self) -> int:
        """Blocks from here on stay resident after forward: backward needs them first."""
        streamed = [k for k, n in enumerate(self.numel) if n]
        if not streamed:
            return 0
        # the last depth + 1 streamed blocks: backward starts at the end, prefetching depth
        return streamed[max(0, len(streamed) - self.depth - 1)]

    def on_grad(self, k: int, pid: int) -> None:
        """A streamed parameter of block k accumulated its gradient."""
        self._seen[k].add(pid)
        if self._backward and k > self._cursor and self._done(k) and k in self.resident:
            self._release_now(k)
            self._top_up()


def _base(t: torch.Tensor) -> torch.Tensor:
    """The whole pooled buffer behind a (prefix) slice."""
    return t if t._base is None else t._base


def _base_nbytes(t: torch.Tensor) -> int:
    b = _base(t)
    return b.numel() * b.element_size()
