"""Numbers read from a model's config, each checked once, where it is read.

A Hugging Face ``config.json`` is data someone typed: ``num_hidden_layers: 2.5`` used to be
taken as 2 layers, ``1e9`` hung the planner (one list entry per layer), ``Infinity`` raised a
bare ``OverflowError`` and ``NaN`` an error naming no key. So no formula reads the dict
itself: it asks a ``ConfigReader`` for a whole number, a fraction, a flag or a list of names,
and the reader checks the value as it hands it over -- JSON type, finite, integral where it
must be, inside its bounds -- and names the key in its error. What is checked is therefore
exactly what is read (``looked_up``, which ``plan.hf_config.config_keys`` reports), not a list
kept by hand beside the formulas. ``check_numbers`` does the same for the keys a
meta-device build hands to transformers (plan/hf_meta.py): every number in them finite, whole
where the config class declares an int, a flag where it declares a bool.

Bounds. A whole number is at least ``lo`` (1 for every count) and at most ``MAX_WHOLE``
(2**53: RFC 8259 section 6 -- beyond it a JSON number is no longer an exact integer in the
IEEE doubles every JSON reader uses). What the numbers add up to is bounded where it is
computed: the layer count by the simulation's size limit (plan/size_limit.py) before any
per-layer list is built, the parameter count by ``MAX_PARAMS``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

MAX_WHOLE = 2**53
"""The largest whole number a config may hold (module docstring)."""
MAX_PARAMS = 10**15
"""The largest parameter count the planner takes from a config: a thousand times the largest
models trained (DeepSeek-V3's 671 B), so no real config meets it, while the element counts
the planner sums in int64 (plan/shapes.py) stay a factor 9,000 from overflow."""

_MISSING: Any = object()


class ConfigNumberError(ValueError):
    """A config value that is not the number (or flag) its key needs; the message names the
    key, the value and the fix."""


def describe_value(value: Any) -> str:
    """``value`` as the config file spells it (JSON's Infinity / NaN / true / false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


class ConfigReader:
    """Checked reads of one config dict; remembers every key it was asked for."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self._data = dict(data)
        self.where = where
        """What the config is, for messages (e.g. "HF config (llama)")."""
        self.looked_up: set[str] = set()
        """Every key read, present or not (``plan.hf_config.config_keys``)."""

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key`` unchecked (None counts as absent); a missing key without a
        default is an error naming it."""
        self.looked_up.add(key)
        value = self._data.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigNumberError(f"{self.where}: missing {key!r}")
            return default
        return value

    def _fail(self, key: str, value: Any, fix: str) -> ConfigNumberError:
        return ConfigNumberError(f"{self.where}: {key}={describe_value(value)} is invalid: "
                                 f"{fix}")

    def whole(self, key: str, default: Any = _MISSING, *, lo: int = 1) -> int:
        """A whole number in [lo, MAX_WHOLE]: a JSON integer, or a float with no fraction
        (1e3); not a bool, a string, a fraction, Infinity or NaN."""
        value = self.raw(key, default)
        fix = f"use a whole number >= {lo}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, value, fix + " (a JSON number, not a string or a flag)")
        if not math.isfinite(value) or value != int(value):
            raise self._fail(key, value, fix)
        whole = int(value)
        if not lo <= whole <= MAX_WHOLE:
            raise self._fail(key, value, f"{fix} and <= 2**53 (what JSON holds exactly)")
        return whole

    def fraction(self, key: str, default: Any = _MISSING) -> float:
        """A probability: a finite number in [0, 1]."""
        value = self.raw(key, default)
        fix = "use a number in [0, 1] (a dropout probability)"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, value, fix)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise self._fail(key, value, fix)
        return float(value)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        """true or false (1, "yes" and the like are refused: they would be read as true)."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, value, "use true or false")
        return value

    def names(self, key: str, default: Any = _MISSING) -> list[str]:
        """A list of strings (``architectures``)."""
        value = self.raw(key, default)
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self._fail(key, value, 'use a list of class names, e.g. ["LlamaForCausalLM"]')
        return value


def _numbers(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key, number) of every number in a value, nested lists and dicts included."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _numbers(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _numbers(f"{key}[{i}]", v)


def check_numbers(data: Mapping[str, Any], keys: tuple[str, ...], where: str,
                  kinds: Mapping[str, str]) -> None:
    """Every number under ``keys`` of ``data`` finite and at most 2**53 in size; a top-level
    key whose kind (``kinds``: what its config class declares) is "whole" a whole number,
    "flag" true or false. Raises ConfigNumberError naming the (dotted) key."""
    for key in keys:
        value = data.get(key)
        kind = kinds.get(key, "")
        if kind == "flag" and value is not None and not isinstance(value, bool):
            raise ConfigNumberError(f"{where}: {key}={describe_value(value)} is invalid: use "
                                    "true or false")
        if kind == "whole" and isinstance(value, (bool, str)):
            raise ConfigNumberError(f"{where}: {key}={describe_value(value)} is invalid: use "
                                    "a whole number (a JSON number, not a string or a flag)")
        for name, number in _numbers(key, value):
            if not math.isfinite(number):
                raise ConfigNumberError(f"{where}: {name}={describe_value(number)} is invalid: "
                                        "use a finite number")
            if abs(number) > MAX_WHOLE:
                raise ConfigNumberError(f"{where}: {name}={number!r} is invalid: use a number "
                                        "of at most 2**53 in size (what JSON holds exactly)")
            if name == key and kind == "whole" and number != int(number):
                raise ConfigNumberError(f"{where}: {name}={number!r} is invalid: use a whole "
                                        "number (its config class declares an int)")


def check_param_count(params: int, where: str) -> None:
    """Refuse a parameter count above ``MAX_PARAMS`` (module docstring)."""
    if params > MAX_PARAMS:
        raise ConfigNumberError(f"{where}: the numbers describe {params:.3g} parameters, more "
                                f"than the planner takes ({MAX_PARAMS:.0e}); check the "
                                "sizes in the config")
