"""Where an iteration begins and how one that will not finish ends: the boundary both the
engine's ``backward`` (runtime/engine.py) and its optimizer's ``step`` (runtime/optimizer.py)
cross, so neither calls the other.

At the first micro-step: apply what ``reconfigure()`` queued and adopt weights written since
the last step (torch's semantics), then freeze what the iteration reads (runtime/frozen.py:
the hyper-parameters of every param group, checked once, the loss scale, the threads, the
streamed parameters). A plain ``loss.backward()`` loop is armed at ``step()`` instead. An
interrupted iteration is rolled back when it can be -- before ``step()`` acted on its verdict,
ranks not stepping together -- and otherwise fails the engine, saying how to recover (never a
silent mix of two batches, docs/failure_semantics.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from superoffload.kernels.hyper import AdamHyper, hypers_of
from superoffload.runtime import stv
from superoffload.runtime.auto_rollback import check_rollback_mode
from superoffload.runtime.errors import EngineError, IterationInterrupted
from superoffload.runtime.frozen import FrozenIteration


class Boundary:
    """The boundary of ``engine``'s iterations (see the module docstring). Reads the engine's
    parts as they are now (a reconfiguration replaces its config); calls back only its
    ``synchronize``, when an interrupted iteration is rolled back."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def hypers(self) -> list[AdamHyper]:
        e = self.engine
        hypers = hypers_of(e.optimizer.param_groups)
        check_rollback_mode(e.config.rollback, e.config.speculation, hypers)
        return hypers

    def freeze(self, *, speculate: bool, accum_on_host: bool,
                hypers: Sequence[AdamHyper] = ()) -> FrozenIteration:
        """What the iteration beginning now reads once (runtime/frozen.py)."""
        e = self.engine
        # plain attributes, not the engine's properties: the boundary never calls back into
        # the engine on a step (the reading order, docs/engine.md)
        return FrozenIteration(
            number=e.launcher.iteration, config=e.config, streamed=self.streamed(),
            loss_scale=e.scaler.loss_scale, threads=e.state.schedule.threads,
            speculate=speculate, accum_on_host=accum_on_host, hypers=tuple(hypers))

    def at_boundary(self) -> None:
        """Where an iteration begins: apply what ``reconfigure()`` queued, adopt weights
        written since the last step (torch semantics) -- each a plain check first, the call
        only when something happened."""
        e = self.engine
        if e.reconfigurer.pending:
            e.reconfigurer.apply_pending()
        if e.contract.tainted is not None or e.contract.written(e.state.trainable,
                                                                     self.streamed()):
            e.writes.adopt_written()

    def streamed(self) -> frozenset[int]:
        e = self.engine
        flow = e.weights.flow
        return flow.streamed_indices if flow is not None else frozenset()

    def end_backward(self) -> None:
        e = self.engine
        flow = e.weights.flow
        # nothing streamed stays resident
        if flow is not None:
            flow.end_backward()

    def arm_without_backward(self) -> None:
        e = self.engine
        self.at_boundary()
        e.launcher.arm_without_backward(
            self.freeze(speculate=False, accum_on_host=False, hypers=self.hypers()))

    def abort(self) -> None:
        """Undo the iteration in progress (runtime/stv.py ``abort``); drain afterwards."""
        e = self.engine
        frozen = e.launcher.current.frozen
        stv.abort(e.launcher.disarm(), frozen, e.parts)
        e.launcher.forget()

    def interrupted(self, exc: BaseException, where: str) -> None:
        """An iteration will not finish (``exc`` in ``where``): undo it, or refuse to go on --
        never a silent mix of two batches. Before ``step()`` acted on its verdict, and when
        the ranks do not step together (``Transport.collective``): roll back. Half-settled,
        or under data parallel (the other ranks' collectives no longer match this rank's):
        the engine fails, saying how to recover."""
        e = self.engine
        if isinstance(exc, EngineError) or e.failures.failed:
            # a lane failure: already the engine's error
            return
        it = e.launcher.current
        if not it.settling and not e.transport.collective:
            try:
                self.abort()
                e.synchronize()
                e.telemetry.note(e.launcher.iteration, f"{where} interrupted ({type(exc).__name__}"
                                    "): the iteration was rolled back; train on from here")
                return
            except BaseException as cause:  # the engine fails below
                exc = cause
        # half-settled: some buckets took the verdict, others not; else the ranks step together
        if it.settling:
            why = "while settling the verdict"
        else:
            why = ("under data parallel: the other ranks' collectives no longer match this "
                   "rank's, so")
        e.failures.record("training", IterationInterrupted(
            f"{where} was interrupted ({exc!r}) {why} the iteration cannot be undone; the "
            "engine stops rather than train on a mix of two batches. Recover: load the last "
            "checkpoint into a new engine (engine.load_checkpoint; under data parallel on "
            "every rank), or build a new engine from the model's current weights"))
