"""OffloadConfig: validated once, errors name the field and the fix."""

from __future__ import annotations

import json

import pytest

from superoffload.config import ConfigError, OffloadConfig


def test_defaults_validate_and_round_trip_through_json() -> None:
    cfg = OffloadConfig().validate()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert OffloadConfig.from_dict(data) == cfg


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("ratio", 1.5, "[0, 1]"),
        ("ratio", float("nan"), "[0, 1]"),
        ("ratio", True, "[0, 1]"),
        ("bucket_bytes", 100, ">= 4096"),
        ("bucket_bytes", 4096.5, ">= 4096"),
        ("max_grad_norm", -1.0, "positive"),
        ("speculation", "maybe", "'adaptive'"),
        ("rollback", "undo", "'snapshot'"),
        ("grad_cast", "gpu", "'device'"),
        ("device", "tpu", "cuda:N"),
        ("cpu_threads", 0, ">= 1"),
        ("cpu_cores_frac", 0.0, "(0, 1]"),
        ("grad_accum_steps", 0, ">= 1"),
        ("initial_scale_power", 100, "[0, 64]"),
        ("watchdog_s", 0, ">= 0.1"),
        ("watchdog_s", 1e-9, ">= 0.1"),
        ("weights", "sometimes", "'flow'"),
    ],
)
def test_invalid_field_is_named_with_a_fix(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**{field: value}).validate()  # type: ignore[arg-type]
    message = str(info.value)
    assert f"OffloadConfig.{field}=" in message
    assert words in message


def test_replace_validates_and_rejects_unknown_names() -> None:
    cfg = OffloadConfig()
    assert cfg.replace(ratio=0.5).ratio == 0.5
    assert cfg.ratio == 0.9  # the original is untouched
    with pytest.raises(ConfigError, match="ratio"):
        cfg.replace(ratio=-0.1)
    with pytest.raises(ConfigError, match="no field 'ration'"):
        cfg.replace(ration=0.5)


def test_from_dict_names_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="bucket_size"):
        OffloadConfig.from_dict({"bucket_size": 1 << 20})


def test_clipping_property() -> None:
    assert not OffloadConfig().clipping
    assert not OffloadConfig(max_grad_norm=0.0).clipping
    assert OffloadConfig(max_grad_norm=1.0).clipping


def _outside(bound, choices):
    """Values each declaration must refuse, derived from it (not a hand-kept list): the
    wrong kind, just outside each end of the range, NaN and inf for reals, None where None is
    not allowed, a non-member for a choice."""
    wrong_kind = {"int": [1.5, "1", True], "real": ["0.5", True, float("nan"), float("inf")],
                  "bool": [1, "yes"], "str": [3], "dict": [[]], "choice": ["no-such-choice", 1]}
    out = list(wrong_kind[bound.kind])
    step = 1 if bound.kind == "int" else 1e-9
    if bound.lo is not None:
        if bound.lo_open:
            out.append(bound.lo)
        elif bound.kind == "int":
            out.append(bound.lo - step)
        else:
            # a relative step: 1e-9 below a large bound would round back onto it
            out.append(bound.lo - max(step, abs(bound.lo) * 1e-9))
    if bound.hi is not None:
        out.append(bound.hi + step if bound.kind == "int" else bound.hi * (1 + 1e-9) + step)
    if not bound.none_ok:
        out.append(None)
    return out


def _fields():
    import dataclasses

    return [(f.name, f.metadata["bound"]) for f in dataclasses.fields(OffloadConfig)]


@pytest.mark.parametrize(("name", "bound"), _fields(), ids=[n for n, _ in _fields()])
def test_every_declared_bound_is_enforced_naming_the_field(name, bound):
    """Every field, every bound it declares (config.py): a value just outside is refused with
    ConfigError naming the field, and the default and the range's own ends are accepted."""
    from superoffload.config import CHOICES

    choices = CHOICES.get(name, ())
    assert (bound.kind == "choice") == bool(choices), name  # a Literal field is a choice
    for value in _outside(bound, choices):
        if name == "device" and isinstance(value, str):
            continue  # any str is "the wrong kind" only for other fields
        with pytest.raises(ConfigError, match=rf"OffloadConfig\.{name}="):
            OffloadConfig(**{name: value}).validate()
    OffloadConfig().validate()  # the defaults are inside every bound
    for end in (bound.lo, bound.hi):
        if end is not None and not (end == bound.lo and bound.lo_open):
            assert OffloadConfig(**{name: type(getattr(OffloadConfig(), name) or end)(end)}
                                 ).validate()
    for member in choices:
        assert getattr(OffloadConfig(**{name: member}).validate(), name) == member
