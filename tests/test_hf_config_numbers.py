"""Every number the planner reads from a Hugging Face config is checked once, where it is read
(plan/config_numbers.py), naming the key: 2.5 layers is not 2, 1e9 layers does not hang,
Infinity is no raw OverflowError, NaN names its key. The keys tried are the keys each config
is read by (``hf_config.config_keys``), not a list kept here."""

from __future__ import annotations

import json
import math
import tracemalloc

import pytest

from superoffload.cli import main
from superoffload.plan import ModelShape, hf_config
from superoffload.plan.config_numbers import (
    MAX_WHOLE,
    ConfigNumberError,
    ConfigReader,
    check_numbers,
)
from superoffload.plan.size_limit import SimulationTooLarge

FORMULA = [n for n in hf_config.shipped()
           if hf_config.load_config(n).get("model_type") in hf_config.FAMILIES]
META = [n for n in hf_config.shipped() if n not in FORMULA]
BAD = [2.5, math.inf, -math.inf, math.nan]
"""Invalid for every key read: no whole number, flag, probability or list of names."""


def _planted(name: str, key: str, value: object) -> dict:
    return {**hf_config.load_config(name), key: value}


def _cases(names: list[str]) -> list[tuple[str, str]]:
    return [(n, k) for n in names for k in hf_config.config_keys(n)[0]]


@pytest.mark.parametrize("name, key", _cases(FORMULA))
def test_every_key_read_by_formula_is_checked(name: str, key: str) -> None:
    for value in BAD:
        with pytest.raises(ValueError, match=rf"\b{key}=") as info:
            ModelShape.from_hf_config(_planted(name, key, value))
        assert "is invalid" in str(info.value), (key, value)


@pytest.mark.parametrize("name", FORMULA)
def test_the_layer_count_is_whole_and_a_number(name: str) -> None:
    key = "n_layer" if hf_config.load_config(name)["model_type"] == "gpt2" else "num_hidden_layers"
    for value in (2.5, "32", True, 0, -3):
        with pytest.raises(ConfigNumberError, match=rf"{key}=.* is invalid: use a whole number"):
            ModelShape.from_hf_config(_planted(name, key, value))
    # a float with no fraction is the whole number JSON writes it as
    assert ModelShape.from_hf_config(_planted(name, key, 3.0)).layers == 3


@pytest.mark.parametrize("name", FORMULA)
def test_a_billion_layers_is_refused_before_anything_is_listed(name: str) -> None:
    key = "n_layer" if hf_config.load_config(name)["model_type"] == "gpt2" else "num_hidden_layers"
    for value in (1e9, 10**9):
        tracemalloc.start()
        try:
            with pytest.raises(SimulationTooLarge, match=rf"{key}=1,000,000,000"):
                ModelShape.from_hf_config(_planted(name, key, value))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 50e6  # nothing per layer was built


def test_a_parameter_count_past_the_bound_is_refused() -> None:
    with pytest.raises(ConfigNumberError, match="parameters, more than the planner takes"):
        ModelShape.from_hf_config(_planted("llama-2-7b", "vocab_size", 2**50))


def test_the_reader_checks_each_kind() -> None:
    r = ConfigReader({"a": 1e3, "b": 2**53 + 2, "p": 0.1, "f": 1, "n": ["X"]}, "cfg")
    assert r.whole("a") == 1000 and isinstance(r.whole("a"), int)
    with pytest.raises(ConfigNumberError, match=r"cfg: b=9007199254740994 is invalid"):
        r.whole("b")
    assert r.fraction("p") == 0.1
    with pytest.raises(ConfigNumberError, match="f=1 is invalid: use true or false"):
        r.flag("f")
    assert r.names("n") == ["X"]
    with pytest.raises(ConfigNumberError, match="cfg: missing 'zz'"):
        r.whole("zz")
    assert r.whole("zz", 4) == 4 and r.looked_up == {"a", "b", "p", "f", "n", "zz"}


def test_nested_numbers_name_their_path() -> None:
    data = {"rope_scaling": {"factor": math.nan}, "x": [1, math.inf], "w": 2.5, "ok": 2.5}
    kinds = {"w": "whole", "ok": "number"}
    with pytest.raises(ConfigNumberError, match=r"rope_scaling\.factor=NaN"):
        check_numbers(data, ("rope_scaling",), "cfg", kinds)
    with pytest.raises(ConfigNumberError, match=r"x\[1\]=Infinity"):
        check_numbers(data, ("x",), "cfg", kinds)
    with pytest.raises(ConfigNumberError, match="w=2.5 is invalid: use a whole number"):
        check_numbers(data, ("w",), "cfg", kinds)
    check_numbers(data, ("ok",), "cfg", kinds)  # a float where the class takes one
    with pytest.raises(ConfigNumberError, match="at most 2"):
        check_numbers({"ok": float(MAX_WHOLE) * 4}, ("ok",), "cfg", kinds)


@pytest.mark.parametrize("name", META)
def test_every_number_read_on_the_meta_device_is_checked(name: str) -> None:
    pytest.importorskip("transformers", reason="needs the 'hf' extra")
    from superoffload.plan import hf_meta

    raw = hf_config.load_config(name)
    kinds = hf_meta.key_kinds(raw["model_type"])
    read = hf_config.config_keys(name)[0]
    numeric = [k for k in read if isinstance(raw[k], (int, float))
               and not isinstance(raw[k], bool)]
    assert numeric  # the check is derived from the keys read: there are some
    for key in numeric:
        for value in (math.inf, math.nan):
            with pytest.raises(ValueError, match=rf"\b{key}=.* is invalid: use a finite"):
                ModelShape.from_hf_config(_planted(name, key, value))
        if kinds.get(key) == "whole":
            with pytest.raises(ValueError, match=rf"\b{key}=2.5 is invalid: use a whole"):
                ModelShape.from_hf_config(_planted(name, key, 2.5))
    with pytest.raises(SimulationTooLarge, match="num_hidden_layers=1,000,000,000"):
        ModelShape.from_hf_config(_planted(name, "num_hidden_layers", 1e9))


@pytest.mark.parametrize("value", ["2.5", "Infinity", "NaN", "1e9"])
def test_the_command_names_the_key(tmp_path, capsys, value: str) -> None:
    text = json.dumps(hf_config.load_config("llama-2-7b")).replace(
        '"num_hidden_layers": 32', f'"num_hidden_layers": {value}')
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["plan", "--hf-config", str(path), "--profile", "gh200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: HF config (llama): num_hidden_layers=")
    assert "Traceback" not in err
    assert main(["plan", "--hf-config", str(path), "--json"]) == 2
    assert "num_hidden_layers=" in json.loads(capsys.readouterr().out)["error"]
