"""The base of every hook the engine puts on a user's model (runtime/launch.py, publishes.py,
flow_hooks.py, weight_writes.py), and ``in_backward``, which they ask.

A hook runs eagerly under ``torch.compile`` (``eager``) and holds only weak references (a
dropped engine is collected: runtime/lifetime.py) and is a module-level class, so the model
stays picklable while an engine is attached:
``torch.save(model)`` / ``pickle.dumps(model)`` write an inert function in the hook's place
(the engine, its threads and buffers do not travel with the model). A deep copy of
the model shares the hook object, whose owner check then makes it do nothing on the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """Run a hook as Python under ``torch.compile``: dynamo never traces into the engine's
    hooks, so a compiled graph can neither skip a wait for a bucket's weights nor keep guards
    on engine objects (whose ids a later engine may reuse); the hook is a graph break."""
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


def in_backward() -> bool:
    """True inside autograd's backward pass (activation-checkpoint recompute re-enters module
    forwards there). One place for the private call: ``torch._C._current_graph_task_id()`` is
    -1 outside a graph task (a backward pass)."""
    return bool(torch._C._current_graph_task_id() != -1)


def inert(*args: Any, **kwargs: Any) -> None:
    """What an engine hook becomes in a pickled model: nothing."""
    return None


def inert_hook() -> Callable[..., None]:
    """The unpickled form of an engine hook (``PicklableHook.__reduce__``)."""
    return inert


class PicklableHook:
    def __reduce__(self) -> tuple[Any, ...]:
        return (inert_hook, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> PicklableHook:
        return self
