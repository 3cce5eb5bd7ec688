"""pyproject.toml and environment.yml list the same dependencies with the same pins
(environment.yml is not exercised in CI: conda cannot be installed there, so this test is
what keeps it honest)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
# extras that environment.yml mirrors (hf is an optional integration, not part of the env)
MIRRORED_EXTRAS = ("notebooks", "test")
# conda-only entries with no PyPI counterpart in pyproject
CONDA_ONLY = {"python", "pip", "c-compiler"}


def _norm(req: str) -> tuple[str, str]:
    req = req.split("#")[0].strip().strip('"').strip("'")
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    assert m, req
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def _pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(data["dependencies"])
    for extra in MIRRORED_EXTRAS:
        reqs += data["optional-dependencies"][extra]
    return dict(_norm(r) for r in reqs)


def _environment() -> dict[str, str]:
    """The entries under `dependencies:` (conda and its `pip:` list), minus `-e .`."""
    out: dict[str, str] = {}
    in_deps = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if re.match(r"^\S", line):  # a top-level key
            in_deps = line.startswith("dependencies:")
            continue
        m = re.match(r"^\s*-\s+(\S.*)$", line)
        if not in_deps or not m or m.group(1) in ("pip:", "-e .") or m.group(1).startswith("-e "):
            continue
        name, spec = _norm(m.group(1))
        if name not in CONDA_ONLY:
            out[name] = spec
    return out


def test_environment_yml_mirrors_pyproject():
    py, env = _pyproject(), _environment()
    assert set(py) == set(env), (f"only in pyproject: {set(py) - set(env)}; "
                                 f"only in environment.yml: {set(env) - set(py)}")
    for name in py:
        assert py[name] == env[name], (
            f"{name}: pyproject '{py[name]}' vs environment.yml '{env[name]}'")


def test_torch_is_pinned_exactly():
    assert _pyproject()["torch"] == "==2.13.0"
