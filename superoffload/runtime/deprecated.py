"""Old names a user may still type, kept working with a ``DeprecationWarning``.

The engine's words were made one word per thing (docs/engine.md, "Glossary"); an attribute or
keyword a training loop may already use keeps working under its old name for a while, and the
warning names the new one.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

T = TypeVar("T")


class DeprecatedAlias:
    """A class attribute that reads ``new`` and warns:
    ``backend = DeprecatedAlias("device_ops")``."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warnings.warn(f"{type(obj).__name__}.{self.old} is deprecated: use .{self.new}",
                      DeprecationWarning, stacklevel=2)
        return getattr(obj, self.new)


def renamed_keyword(old: str, old_value: T | None, new: str, new_value: T | None) -> T | None:
    """``new_value``, or ``old_value`` (with a warning) when only the old keyword was passed."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{old}= is the old name of {new}=: pass {new}= only")
    warnings.warn(f"{old}= is deprecated: use {new}=", DeprecationWarning, stacklevel=3)
    return old_value
