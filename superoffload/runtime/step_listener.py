"""Call functions after every optimizer step of an engine, from the training thread.

torch's optimizer contract has ``Optimizer.register_step_post_hook(hook)``: hooks run after
each ``step()`` (``torch.optim.Optimizer.profile_hook_step`` runs them), in the thread
that stepped. The engine's ``optimizer`` is a torch optimizer whose ``step()`` is ``engine.step``,
so a hook sees every iteration end, whatever loop drives the engine (ours, Trainer,
Lightning, a notebook's background thread) -- without touching the engine.

One hook per optimizer, registered once; ``subscribe`` swaps in a new tuple of callbacks, so
subscribing or leaving never mutates what torch is iterating in the training thread (which
would raise "mutated during iteration"). A callback must not raise: training would.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

Callback = Callable[[], None]


class _Hook:
    def __init__(self) -> None:
        self.callbacks: tuple[Callback, ...] = ()

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # a tuple: replaced, never mutated
        for fn in self.callbacks:
            fn()


_HOOKS: weakref.WeakKeyDictionary[Any, _Hook] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def supported(engine: Any) -> bool:
    """Whether `engine.optimizer` takes torch step hooks."""
    return callable(getattr(getattr(engine, "optimizer", None), "register_step_post_hook", None))


def subscribe(engine: Any, fn: Callback) -> Callable[[], None]:
    """Call `fn()` after every ``engine.optimizer.step()``; returns the function that stops
    it (from any thread)."""
    if not supported(engine):
        raise ValueError(f"{type(engine).__name__} has no torch optimizer with step hooks "
                         "(engine.optimizer.register_step_post_hook)")
    optimizer = engine.optimizer
    with _LOCK:
        hook = _HOOKS.get(optimizer)
        if hook is None:
            hook = _HOOKS[optimizer] = _Hook()
            optimizer.register_step_post_hook(hook)
        hook.callbacks = (*hook.callbacks, fn)

    def leave() -> None:
        with _LOCK:
            hook.callbacks = tuple(f for f in hook.callbacks if f is not fn)

    return leave
