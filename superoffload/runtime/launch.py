"""A bucket leaves the device: micro-steps, the gradient hook, the launch (paper §4.2-4.3).

``OffloadConfig.grad_accum_steps`` = K: the engine steps once per K backward passes, whether
they are ``engine.backward(loss)`` calls (which offload buckets as gradients become final)
or the user's own ``loss.backward()`` (gradients sum in ``.grad``; ``step()`` then launches
every bucket at once, without overlap or speculation). The gradient hook counts the user's
passes (``passes``), so a loop that calls ``step()`` on every micro-batch -- DeepSpeed's and
Accelerate's habit -- and one that calls it once per K backward passes -- torch's -- both
step once per K micro-batches. The two kinds never mix in one accumulation window, and more
than K passes before ``step()`` are refused: never a step over a silently different batch.

On the last micro-step (``Iteration.armed``) a parameter's post-accumulate-grad hook
(``GradReady``; a tied parameter has one AccumulateGrad node, so it fires once, after all its
uses) tells the ``Launcher``; when all of a bucket's have fired, it **launches**: the user's
gradient transforms run, the contract records the gradients taken, they depart
(runtime/departures.py: the transport starts moving them and returns the bucket's local
validation statistics as a future), and, when speculating, the CPU worker's step is queued
after them and its publish chained (runtime/publishes.py). With host accumulation an earlier
micro-step's buckets leave the same way to be summed. Everything here reads the frozen
iteration; nothing calls the engine. What happens next: runtime/stv.py.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from superoffload.config import OffloadConfig
from superoffload.kernels.hyper import AdamHyper
from superoffload.runtime import tier_steps
from superoffload.runtime.auto_rollback import may_speculate
from superoffload.runtime.contract import ContractError
from superoffload.runtime.departures import Departures
from superoffload.runtime.devices import DeviceOps
from superoffload.runtime.errors import EngineError
from superoffload.runtime.frozen import FrozenIteration
from superoffload.runtime.hook_base import PicklableHook, eager
from superoffload.runtime.iteration import Flight, Iteration, Parts
from superoffload.runtime.steps import make_calls, step_task

Transform = Callable[[str, torch.Tensor], "torch.Tensor | None"]


class Launcher:
    """The iteration in progress of one engine and its buckets' launches (see the module
    docstring). The training thread owns it; the hooks may run on autograd's threads."""

    def __init__(self, parts: Parts, device_ops: DeviceOps, frozen: FrozenIteration) -> None:
        self.parts, self.device_ops = parts, device_ops
        self.iteration = 0
        """Optimizer iterations completed (the next one's number)."""
        self.current = Iteration(frozen)
        self.departures = Departures(parts.state, parts.transport, parts.in_flight)
        """How gradients leave the device: freed once moved, the bound, host sums."""
        self.transforms: OrderedDict[int, Transform] = OrderedDict()
        """``engine.register_grad_transform``: applied to each gradient as its bucket launches."""
        self.in_engine_backward = False
        """``engine.backward`` is running: other backward passes are the user's own."""
        # hooks may fire on autograd's device threads
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the iteration
    def begin(self, frozen: FrozenIteration) -> None:
        """The first micro-step of an iteration: ``frozen`` is what it reads. The storage
        tier starts reading ahead the state backward will need (runtime/tier.py)."""
        self.current.frozen = frozen
        self.parts.stats.speculation_enabled = frozen.speculate
        tier = self.parts.transport.tier
        if tier is not None:
            tier.begin(frozen.number)

    def micro_step(self, hypers: Sequence[AdamHyper] | None) -> Iteration:
        """One more backward pass; ``hypers`` (per param group) at the last micro-step."""
        it = self.current
        it.micro_step += 1
        it.armed = it.micro_step >= it.frozen.config.grad_accum_steps
        it.moved = {}
        if it.armed:
            assert hypers is not None, "the last micro-step reads the hyper-parameters"
            it.frozen = replace(it.frozen, hypers=tuple(hypers))
        return it

    def arm_without_backward(self, frozen: FrozenIteration) -> None:
        """``step()`` after plain ``loss.backward()``: every bucket launches now, no STV (the
        gradients summed in ``.grad`` over the loop's backward passes)."""
        it = self.current
        it.frozen, it.armed = frozen, True
        self.launch_remaining()
        # armed, as after backward
        it.micro_step = frozen.config.grad_accum_steps

    def disarm(self) -> list[Flight]:
        """No bucket launches any more (an iteration taken apart): its launched buckets."""
        with self._lock:
            it = self.current
            it.armed = False
            return [it.flights[b] for b in sorted(it.flights)]

    def forget(self) -> None:
        """Forget the iteration in progress (undone, or its buckets re-planned): the next
        first micro-step restarts every host sum (the caller drains the lanes)."""
        self.current = Iteration(self.current.frozen)
        self.parts.contract.forget_grads()
        self.departures.reset()

    def next_iteration(self) -> None:
        """The iteration closed: the next one starts (its number, fresh books)."""
        self.iteration += 1
        self.current = Iteration(self.current.frozen)
        self.parts.contract.forget_grads()
        # validation waited for every copy
        self.departures.in_flight.clear()
        self.parts.in_flight.forget_done()

    # ------------------------------------------------------------------ the gradient hook
    def on_grad_ready(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index`` (tied: fires once, after all uses)."""
        it = self.current
        if not it.armed:
            # the user's loss.backward(): count the pass
            if not self.in_engine_backward:
                with self._lock:
                    it.plain[index] = it.plain.get(index, 0) + 1
            elif it.frozen.accum_on_host:  # an earlier micro-step: the bucket leaves to be summed
                self._collect(index, it.moved, self._accumulate)
            # device accumulation: gradients keep summing in .grad
            return
        self._collect(index, it.fired, self._ready)

    def _collect(self, index: int, fired_of: dict[int, set[int]],
                 complete: Callable[[int], None]) -> None:
        b = self.parts.state.bucket_of[index]
        with self._lock:
            fired = fired_of.setdefault(b, set())
            fired.add(index)
            if len(fired) == len(self.parts.bucket_params(b)):
                complete(b)

    def _accumulate(self, b: int) -> None:
        """Host accumulation, an earlier micro-step: bucket ``b``'s gradients of this
        micro-step leave to join the host sums (runtime/departures.py)."""
        moving, frozen = self.departures.moving(b), self.current.frozen
        # kept: they sum in .grad
        if moving and self.departures.sums_on_host(b, frozen):
            fut = self.departures.depart(b, moving, frozen, final=False)
            if fut is not None:
                self.parts.in_flight.add(fut)

    def accumulate_remaining(self) -> None:
        """After an earlier micro-step's backward: buckets some of whose parameters got no
        gradient in it leave with what they have."""
        with self._lock:
            for b in range(len(self.parts.state.buffers)):
                self._accumulate(b)

    def launch_remaining(self) -> None:
        """After the last backward: buckets some of whose parameters got no gradient."""
        with self._lock:
            for b in range(len(self.parts.state.buffers)):
                self._ready(b)

    # ------------------------------------------------------------------ the launch
    def _ready(self, b: int) -> None:
        """Launch ``b`` (in bucket order when the transport's collectives need it)."""
        it = self.current
        if b in it.flights or b in it.ready:
            return
        if not self.parts.transport.ordered_launch:
            self._launch(b)
            return
        it.ready.add(b)
        while it.next_launch in it.ready:
            self._launch(it.next_launch)
            it.next_launch += 1

    def _launch(self, b: int) -> None:
        it, parts, dep = self.current, self.parts, self.departures
        frozen, st, transport = it.frozen, parts.state, parts.transport
        buf = st.buffers[b]
        moving = dep.moving(b)
        # host accumulation: earlier micro-steps
        present = frozenset(moving) | dep.summed(b)
        if self.transforms:
            self.transform(moving)
        # an edit from now on would reach only some buckets
        parts.contract.took(moving, freeing=dep.frees(b, frozen))
        tier = transport.tier
        # a storage-tier bucket takes a pool slot first: its gradients land there, its read
        # ahead (or a read now) fills it with its state (runtime/tier.py)
        loaded = None
        if tier is not None and tier.holds(b) and present:
            loaded = tier.bind(b)
        stats = dep.depart(b, moving, frozen, final=True)
        calls = make_calls(buf, present, st.group_of, st.steps, frozen.hypers)
        fl = Flight(b, buf.on_device, present, calls, stats)
        it.flights[b] = fl
        published = self._speculate(fl, loaded)
        if loaded is not None:
            assert tier is not None
            tier_steps.after_launch(tier, fl, published)

    def _speculate(self, fl: Flight, loaded: Future[Any] | None) -> Future[Any] | None:
        """Queue bucket ``fl``'s speculative step and its publish when the iteration
        speculates and the bucket may (paper §4.3); returns the publish's device copy.
        ``loaded``: a storage-tier bucket's read into its slot (undone by its versions)."""
        it, parts = self.current, self.parts
        frozen, st, transport, b = it.frozen, parts.state, parts.transport, fl.bucket
        buf = st.buffers[b]
        # a collective transport publishes every host bucket on every rank (all-gathers
        # match by order), even when this rank's shard has nothing to step
        if buf.on_device or not frozen.speculate or not (fl.present or transport.ordered_launch):
            return None
        cfg = frozen.config
        # the same on every rank
        groups = {st.group_of[i] for i in parts.bucket_params(b)}
        moments = buf.exp_avg[0].dtype if buf.exp_avg else torch.float32
        if loaded is None and not may_speculate([frozen.hypers[g] for g in sorted(groups)],
                                                moments, cfg.rollback, cfg.max_grad_norm):
            # stepped once, after the verdict (runtime/stv.py)
            return None
        if cfg.rollback == "snapshot" and loaded is None:
            buf.ensure_snapshot(self.device_ops.alloc_host)
        fl.spec_scale = 1.0 / (frozen.loss_scale * transport.grad_divisor)
        # queued once its gradients landed (and its state, on the tier), then earliest
        # deadline first (lanes.py)
        after = tuple(f for f in (fl.stats, loaded) if f is not None)
        fl.spec = parts.submit(step_task(b, buf, fl.calls, frozen, parts.recorder,
                                         scale=fl.spec_scale, after=fl.stats, speculative=True,
                                         replay=False, versioned=loaded is not None),
                               b, frozen, after=after)
        fl.spec.add_done_callback(parts.stats.counter("speculated_buckets"))
        fl.spec.add_done_callback(parts.stats.count_rescue)
        return parts.publishes.publish(b, fl.calls, fl.spec, frozen).device

    def register_transform(self, fn: Any) -> RemovableHandle:
        """``engine.register_grad_transform``: ``fn`` joins the transforms (handle:
        ``.remove()``)."""
        if not callable(fn):
            raise TypeError(f"register_grad_transform: {fn!r} is not callable")
        handle = RemovableHandle(self.transforms)
        self.transforms[handle.id] = fn
        return handle

    def transform(self, indices: Iterable[int]) -> None:
        """The user's gradient transforms, in registration order, before the gradient leaves
        (on the thread that runs the hook: autograd's, during backward)."""
        st, fns = self.parts.state, list(self.transforms.values())
        with torch.no_grad():
            for i in sorted(indices):
                p = st.params[i]
                for fn in fns:
                    g = p.grad
                    assert g is not None
                    out = fn(st.names[i], g)
                    if out is not None and out is not g:
                        if out.shape != g.shape or out.dtype != g.dtype or out.device != g.device:
                            raise ValueError(
                                f"grad transform {getattr(fn, '__name__', fn)!r} returned a "
                                f"{out.dtype} tensor of shape {tuple(out.shape)} on {out.device} "
                                f"for {st.names[i]!r}; return one like the gradient "
                                f"({g.dtype}, {tuple(g.shape)}, {g.device}) or None")
                        p.grad = out


# ---------------------------------------------------------------------------- micro-steps
def plain_passes(it: Iteration) -> int:
    """Backward passes the user ran with plain ``loss.backward()`` since the last step."""
    return max(it.plain.values()) if it.plain else 0


def passes(it: Iteration) -> int:
    """Backward passes since the last step, of either kind."""
    return it.micro_step or plain_passes(it)


def check_backward(it: Iteration, config: OffloadConfig, *, accum_on_host: bool,
                   transforms: bool) -> None:
    """Before ``engine.backward``: refuse what cannot join this accumulation window
    (``accum_on_host``: the engine's resolved ``grad_accum_on`` is "host"; ``transforms``:
    a gradient transform is registered)."""
    plain = plain_passes(it)
    if plain:
        raise ContractError(
            f"engine.backward() after {plain} plain loss.backward() call(s) since the last "
            "step(): one accumulation window takes one kind of backward (engine.backward "
            "overlaps the offload; loss.backward() sums in .grad until step()). Finish the "
            "window with loss.backward() and step(), then use engine.backward from the next "
            "one; nothing was changed")
    if accum_on_host and transforms:
        raise ContractError(
            "engine.register_grad_transform with OffloadConfig.grad_accum_on='host': the "
            "gradients leave every micro-step and are summed on the host, so no device "
            "gradient holds the sum a transform should see. Use grad_accum_on='device', or "
            "remove the transform; nothing was changed")
    if it.micro_step >= config.grad_accum_steps:
        raise EngineError(
            f"backward() was called {it.micro_step + 1} times since the last step() with "
            f"OffloadConfig.grad_accum_steps={config.grad_accum_steps}: the last micro-step's "
            "buckets are already offloaded and stepped, so another gradient cannot join them. "
            "Call step() after every grad_accum_steps backward() calls (raise "
            "grad_accum_steps to accumulate more); nothing was changed")


def check_plain_passes(it: Iteration, config: OffloadConfig, where: str) -> None:
    """At the step boundary of the user's own backward passes: exactly K of them."""
    plain, gas = plain_passes(it), config.grad_accum_steps
    if plain > gas:
        raise ContractError(
            f"{where} after {plain} loss.backward() passes with OffloadConfig."
            f"grad_accum_steps={gas}: the engine steps once per {gas} backward pass(es), so "
            f"the gradients summed in .grad hold {plain} micro-batches. Call step() after "
            f"every {gas} backward pass(es) (or set grad_accum_steps={plain}); zero_grad() "
            "discards them; nothing was changed")


# ---------------------------------------------------------------------------- the hook
def grad_hooks(launcher: Launcher) -> list[Any]:
    """A ``GradReady`` hook on every trainable parameter (handles: ``.remove()`` on close)."""
    st, ref = launcher.parts.state, weakref.ref(launcher)
    return [st.params[i].register_post_accumulate_grad_hook(
        GradReady(ref, weakref.ref(st.params[i]), i)) for i in st.trainable]


class GradReady(PicklableHook):
    """Post-accumulate-grad hook: the parameter's gradient is final (tied: after all uses).
    Holds the launcher and the parameter weakly (runtime/lifetime.py, hook_base.py)."""

    def __init__(self, ref: weakref.ref[Launcher], owner: weakref.ref[torch.Tensor],
                 index: int) -> None:
        self.ref, self.owner, self.index = ref, owner, index

    @eager
    def __call__(self, param: torch.Tensor) -> None:
        launcher = self.ref()
        if launcher is not None and param is self.owner():
            launcher.on_grad_ready(self.index)
