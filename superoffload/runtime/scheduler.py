"""The iteration core: one schedule for one process and for ZeRO (paper §4.2-4.3, DESIGN.md §3).

Lifecycle of a bucket in one iteration:

1. backward: its last gradient is final (post-accumulate-grad hook, ``on_grad_ready``) ->
   ``launch``: the transport starts moving the gradients and returns the bucket's local
   validation statistics as a future; if speculating, the CPU worker steps the bucket (or
   this rank's shard) as soon as they land, and the transport publishes the new weights;
2. ``step()`` -> ``runtime/settle.py``: the statistics of every bucket and rank give the
   global norm and overflow verdict; speculative steps are kept, rolled back and replayed,
   or rolled back and skipped; the GPU tail buckets are stepped on the device;
3. the next forward waits, per module, only for its own bucket's last publish.

The transport (``runtime/transport.py``) is the only difference between one process
(D2H/H2D) and ZeRO data parallel (reduce-scatter/all-gather); everything here runs for
both. The training thread owns all bookkeeping; lanes run frozen tasks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from superoffload.config import OffloadConfig
from superoffload.kernels import AdamHyper
from superoffload.runtime.backend import Backend
from superoffload.runtime.departures import Departures
from superoffload.runtime.errors import (
    EngineError,
    FailureBox,
    IterationInterrupted,
    WatchdogTimeout,
)
from superoffload.runtime.guard import Contract
from superoffload.runtime.iteration import EngineStats, Flight, Iteration
from superoffload.runtime.loss_scaler import LossScaler
from superoffload.runtime.publishes import Publishes
from superoffload.runtime.rollback_guard import Rescue
from superoffload.runtime.state import EngineState
from superoffload.runtime.steps import (
    Guard,
    KernelCall,
    RollbackTask,
    StepTask,
    make_calls,
    members_of,
    speculable,
)
from superoffload.runtime.stv import AdaptiveSTV
from superoffload.runtime.transfers import wait_for
from superoffload.runtime.transport import Transport
from superoffload.runtime.worker import Barrier, Lane, Priority, describe
from superoffload.telemetry.recorder import Recorder


class IterationScheduler:
    """Owns the iteration in flight, the pending publishes and the CPU worker's tasks."""

    def __init__(self, *, state: EngineState, transport: Transport, backend: Backend,
                 recorder: Recorder, worker: Lane, config: Callable[[], OffloadConfig],
                 scaler: LossScaler, adaptive: AdaptiveSTV, failures: FailureBox,
                 streamed: Callable[[], frozenset[int]], contract: Contract) -> None:
        self.state, self.transport, self.backend = state, transport, backend
        self.contract = contract
        self.transforms: OrderedDict[int, Callable[[str, torch.Tensor], torch.Tensor | None]] = \
            OrderedDict()
        """``engine.register_grad_transform``: applied to each gradient as its bucket launches."""
        self.recorder, self.worker, self.failures = recorder, worker, failures
        self.config, self.scaler, self.adaptive = config, scaler, adaptive
        self.streamed = streamed
        self.stats = EngineStats()
        self.iteration = 0
        self.current = Iteration()
        self.publishes = Publishes(
            state=state, contract=contract, backend=backend, recorder=recorder,
            transport=transport, wait=self.wait, streamed=streamed,
            iteration=lambda: self.iteration)
        """Per bucket, the last publish a module must wait for before it runs."""
        self.home_ready: dict[int, Future[Any]] = {}
        """Weight-flow: per bucket, the last step/gather that wrote its host homes."""
        self.outstanding: list[Future[Any]] = []
        """Every worker task and publish since the last drain (chained ones included)."""
        self._launch_lock = threading.Lock()  # hooks may fire on autograd's device threads
        self._count_lock = threading.Lock()   # lane callbacks; never held while launching
        self.departures = Departures(state, transport, contract, self.wait)
        """How gradients leave the device: freed once moved, the bound, host sums."""
        self.sum_on_host = False
        """Gradients accumulate on the host (the engine's resolved ``grad_accum_on``)."""
        self.last_grad_norm: float | None = None  # the last step's (engine.grad_norm())
        self.in_engine_backward = False
        """``engine.backward`` is running: other backward passes are the user's own."""

    # ------------------------------------------------------------------ iteration state
    @property
    def threads(self) -> int:
        schedule = self.state.schedule
        return schedule.threads if schedule is not None else 1

    def end_iteration(self) -> None:
        """A new iteration starts: forget what finished (``outstanding`` keeps only futures
        still running, so a run that never synchronizes does not accumulate them)."""
        self.current = Iteration()
        self.contract.forget_grads()
        self.departures.in_flight.clear()  # validation waited for every copy
        self.outstanding = [f for f in self.outstanding if not f.done()]

    def reset(self) -> None:
        """Forget a partial iteration (after a load or a rebuild)."""
        self.current = Iteration()
        self.contract.forget_grads()
        self.departures.reset()
        self.home_ready.clear()

    def _configure_departures(self, *, sum_on_host: bool) -> None:
        cfg = self.config()
        self.departures.configure(bound=cfg.grad_buckets_in_flight,
                                  release=not cfg.keep_device_grads, sum_on_host=sum_on_host)

    def begin_micro_step(self, hypers: Callable[[], list[AdamHyper]]) -> Iteration:
        it = self.current
        if it.micro_step == 0:
            it.speculate = self.adaptive.enabled
            self.stats.speculation_enabled = self.adaptive.enabled
            self._configure_departures(sum_on_host=self.sum_on_host)
        it.micro_step += 1
        it.armed = it.micro_step >= self.config().grad_accum_steps
        it.moved = {}
        if it.armed:
            it.hypers = hypers()
        return it

    def plain_passes(self) -> int:
        """Backward passes the user ran with plain ``loss.backward()`` since the last step."""
        plain = self.current.plain
        return max(plain.values()) if plain else 0

    def arm_without_backward(self, hypers: Callable[[], list[AdamHyper]]) -> None:
        """``step()`` after plain ``loss.backward()``: every bucket launches now, no STV (the
        gradients summed in ``.grad`` over the loop's backward passes)."""
        it = self.current
        it.speculate, it.armed, it.hypers = False, True, hypers()
        self._configure_departures(sum_on_host=False)
        self.launch_remaining()

    # ------------------------------------------------------------------ launching
    def on_grad_ready(self, index: int) -> None:
        """Post-accumulate-grad hook of parameter ``index`` (tied: fires once, after all uses)."""
        it = self.current
        if not it.armed:
            if not self.in_engine_backward:  # the user's loss.backward(): count the pass
                with self._launch_lock:
                    it.plain[index] = it.plain.get(index, 0) + 1
            elif self.sum_on_host:  # an earlier micro-step: the bucket leaves to be summed
                self._collect(index, it.moved, self._accumulate)
            return  # device accumulation: gradients keep summing in .grad
        self._collect(index, it.fired, self._ready)

    def _collect(self, index: int, fired_of: dict[int, set[int]],
                 complete: Callable[[int], None]) -> None:
        b = self.state.bucket_of[index]
        with self._launch_lock:
            fired = fired_of.setdefault(b, set())
            fired.add(index)
            if len(fired) == len(self.bucket_params(b)):
                complete(b)

    def _accumulate(self, b: int) -> None:
        """Host accumulation, an earlier micro-step: bucket ``b``'s gradients of this
        micro-step leave to join the host sums (runtime/departures.py)."""
        moving = self.departures.moving(b)
        if moving and not self.state.buffers[b].on_device:
            fut = self.departures.depart(b, moving, self.iteration, self.streamed(), final=False)
            if fut is not None:
                self.outstanding.append(fut)

    def accumulate_remaining(self) -> None:
        """After an earlier micro-step's backward: buckets some of whose parameters got no
        gradient in it leave with what they have."""
        with self._launch_lock:
            for b in range(len(self.state.buffers)):
                self._accumulate(b)

    def launch_remaining(self) -> None:
        """After the last backward: buckets some of whose parameters got no gradient."""
        with self._launch_lock:
            for b in range(len(self.state.buffers)):
                self._ready(b)

    def bucket_params(self, b: int) -> tuple[int, ...]:
        """Every parameter of bucket ``b`` (the plan's; a ZeRO shard steps a part of them)."""
        schedule = self.state.schedule
        assert schedule is not None, "the engine builds its buckets before training"
        return schedule.bucket_plan.buckets[b].param_indices

    def _ready(self, b: int) -> None:
        """Launch ``b`` (in bucket order when the transport's collectives need it)."""
        it = self.current
        if b in it.flights or b in it.ready:
            return
        if not self.transport.ordered_launch:
            self._launch(b)
            return
        it.ready.add(b)
        while it.next_launch in it.ready:
            self._launch(it.next_launch)
            it.next_launch += 1

    def _launch(self, b: int) -> None:
        it, st, dep = self.current, self.state, self.departures
        buf = st.buffers[b]
        moving = dep.moving(b)
        present = frozenset(moving) | dep.summed(b)  # host accumulation: earlier micro-steps
        if self.transforms:
            self.transform(moving)
        streamed = self.streamed()
        # an edit from now on would reach only some buckets
        self.contract.took(moving, freeing=dep.frees(b, streamed))
        stats = dep.depart(b, moving, self.iteration, streamed, final=True)
        calls = make_calls(buf, present, st.group_of, st.steps, it.hypers)
        fl = Flight(b, buf.on_device, present, calls, stats)
        it.flights[b] = fl
        # a collective transport publishes every host bucket on every rank (all-gathers
        # match by order), even when this rank's shard has nothing to step
        if buf.on_device or not it.speculate or not (present or self.transport.ordered_launch):
            return
        cfg = self.config()
        groups = {st.group_of[i] for i in self.bucket_params(b)}  # the same on every rank
        moments = buf.exp_avg[0].dtype if buf.exp_avg else torch.float32
        if not speculable([it.hypers[g] for g in sorted(groups)], moments, cfg.rollback,
                          cfg.max_grad_norm):
            return  # stepped once, after the verdict (settle.py)
        if cfg.rollback == "snapshot":
            buf.ensure_snapshot(self.backend.alloc_host)
        fl.spec_scale = 1.0 / (self.scaler.loss_scale * self.transport.grad_divisor)
        # queued once its gradients landed, then earliest deadline first (worker.py)
        fl.spec = self.submit(self.step_task(fl, calls, scale=fl.spec_scale, after=stats,
                                             speculative=True, replay=False),
                              b, after=() if stats is None else (stats,))
        fl.spec.add_done_callback(self.counter("speculated_buckets"))
        fl.spec.add_done_callback(self.count_guarded)
        self.publish(b, calls, fl.spec)

    def transform(self, indices: Iterable[int]) -> None:
        """The user's gradient transforms, in registration order, before the gradient leaves
        (on the thread that runs the hook: autograd's, during backward)."""
        st, fns = self.state, list(self.transforms.values())
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

    def abort(self) -> None:
        """Undo the iteration in progress (an interrupted backward, ``zero_grad()`` before
        ``step()``): every speculative step that ran is rolled back and its restored weights
        published; nothing else of the iteration was applied (the tail steps, the step
        counts and the loss scale change only in ``step()``). Drain the lanes afterwards."""
        with self._launch_lock:  # no hook launches while the iteration is taken apart
            it = self.current
            it.armed = False
            flights = [it.flights[b] for b in sorted(it.flights)]
        for fl in flights:
            if fl.spec is not None:
                self.publish(fl.bucket, fl.calls, self.rollback(fl))
        self.transport.discard([fl.bucket for fl in flights if fl.on_device])
        self.current = Iteration()
        self.contract.forget_grads()
        self.departures.reset()  # the next first micro-step restarts every host sum

    def recover(self, exc: BaseException, where: str, synchronize: Callable[[], None]) -> None:
        """An iteration will not finish (``exc`` in ``where``): undo it, or refuse to go on —
        never a silent mix of two batches. One process, before ``step()`` acted on its
        verdict: roll back (``abort``). Data parallel (the other ranks' collectives no longer
        match this rank's) or half-settled: the engine fails, saying how to recover."""
        if isinstance(exc, EngineError) or self.failures.failed:
            return  # a lane failure: already the engine's error
        it = self.current
        if not it.settling and not self.transport.ordered_launch:
            try:
                self.abort()
                synchronize()
                self.recorder.note(self.iteration, f"{where} interrupted ({type(exc).__name__}):"
                                   " the iteration was rolled back; train on from here")
                return
            except BaseException as cause:  # the engine fails below
                exc = cause
        state = "while settling the verdict" if it.settling else "under data parallel"
        self.failures.record("training", IterationInterrupted(
            f"{where} was interrupted ({exc!r}) {state}: the iteration cannot be undone, so "
            "the engine stops rather than train on a mix of two batches. Recover: load the "
            "last checkpoint into a new engine (engine.load_checkpoint), or build a new engine "
            "from the model's current weights"))

    # ------------------------------------------------------------------ tasks
    def step_task(self, fl: Flight, calls: tuple[KernelCall, ...], *, scale: float,
                  after: Future[Any] | None, speculative: bool, replay: bool,
                  undone: Future[Any] | None = None) -> StepTask:
        cfg = self.config()
        return StepTask(
            bucket=fl.bucket, iteration=self.iteration, buffers=self.state.buffers[fl.bucket],
            calls=calls, grad_scale=scale, threads=self.threads, after=after,
            skip_nonfinite=speculative, snapshot=speculative and cfg.rollback == "snapshot",
            replay=replay, recorder=self.recorder, watchdog_s=cfg.watchdog_s, seed=cfg.seed,
            guard=Guard(cfg.max_grad_norm, self.threads)
            if speculative and cfg.rollback == "auto" else None,
            undone=undone)

    def rollback(self, fl: Flight) -> Future[Any]:
        """Undo ``fl``'s speculative step (if it ran) on the worker."""
        assert fl.spec is not None
        cfg = self.config()
        fut = self.submit(RollbackTask(
            bucket=fl.bucket, iteration=self.iteration, buffers=self.state.buffers[fl.bucket],
            calls=fl.calls, grad_scale=fl.spec_scale, threads=self.threads,
            step_future=fl.spec, mode=cfg.rollback, recorder=self.recorder,
            watchdog_s=cfg.watchdog_s, seed=cfg.seed), fl.bucket, after=(fl.spec,))
        fut.add_done_callback(self.counter("rollbacks"))
        return fut

    def deadline(self, b: int) -> Priority:
        """Worker / H2D priority of bucket ``b``: earliest deadline first — the next forward
        needs the highest offloaded bucket id (the first layers) first, while backward
        produced it last (DESIGN.md §6); ``step_order="fifo"`` keeps gradient-ready order."""
        order = -b if self.config().step_order == "deadline" else b
        return (float(self.iteration), float(order))

    def submit(self, task: Any, b: int, *, after: Sequence[Future[Any]] = ()) -> Future[Any]:
        """A task of bucket ``b`` on the CPU worker, once ``after`` is done, by deadline."""
        fut = self.worker.submit(task, after=after, priority=self.deadline(b))
        self.outstanding.append(fut)
        return fut

    def publish(self, b: int, calls: tuple[KernelCall, ...], after: Future[Any]) -> None:
        """Bring bucket ``b``'s weights back after ``after`` (a step or a rollback)."""
        pub = self.transport.publish(b, tuple(members_of(calls)), after, self.iteration,
                                     self.streamed(), self.deadline(b))
        if pub.device is not None:
            self.publishes.pending[b] = pub.device
            self.outstanding.append(pub.device)
        if pub.home is not None:
            self.home_ready[b] = pub.home

    def count_guarded(self, fut: Future[Any]) -> None:
        """A speculative step's ``Rescue`` (rollback="auto"): count the elements it kept."""
        if fut.exception() is None and isinstance(fut.result(), Rescue):
            with self._count_lock:
                self.stats.guarded_elements += fut.result().elements

    def counter(self, name: str, *, when: Future[Any] | None = None
                ) -> Callable[[Future[Any]], None]:
        """A done-callback adding 1 to ``stats.<name>`` when the task ran (returned True, or a
        step's Rescue) and, with ``when`` (done before the task ran), that one ran too."""
        def done(fut: Future[Any]) -> None:
            if when is not None and not (when.exception() is None and bool(when.result())):
                return
            if fut.exception() is None and bool(fut.result()):
                with self._count_lock:
                    setattr(self.stats, name, getattr(self.stats, name) + 1)
        return done

    # ------------------------------------------------------------------ waiting
    def wait(self, future: Future[Any], what: str) -> Any:
        """Wait with the watchdog; a lane failure surfaces as the engine's own error."""
        try:
            return wait_for(future, self.config().watchdog_s, what)
        except WatchdogTimeout as exc:
            self.failures.raise_if_failed()
            raise WatchdogTimeout(f"{exc}; {self.transport.stall_hint()}") from None
        except Exception:
            self.failures.raise_if_failed()
            raise

    def drain_pending(self, lanes: Sequence[Lane]) -> None:
        """Every lane has run what was submitted; every publish has landed."""
        for lane in lanes:
            try:
                wait_for(lane.submit(Barrier()), self.config().watchdog_s, "synchronize")
            except Exception as exc:
                self.failures.raise_if_failed()
                raise type(exc)(f"{describe(lane)}: {exc}") from exc
        # chained tasks are queued late (worker.py): wait for each future itself
        outstanding, self.outstanding = self.outstanding, []
        for fut in outstanding:
            self.wait(fut, "a task submitted before synchronize()")
        self.publishes.discard_racing_writes()
