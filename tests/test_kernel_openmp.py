"""The process's OpenMP wait policy (kernels/openmp.py, issue 11 §4): passive when
superoffload is imported before torch and the user chose nothing; the user's choice always
wins; nothing can change once torch (which loads libgomp) was imported first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import os, sys; {first}; import superoffload.kernels as K; "
         "print(K.wait_policy().source, os.environ.get('OMP_WAIT_POLICY'), "
         "K.openmp_library() is None or 'gomp' in K.openmp_library())")


def _run(first: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True,
                         text=True, env={**clean, **env}, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_passive_when_superoffload_comes_first():
    assert _run("pass") == ["superoffload", "PASSIVE", "True"]


def test_the_users_choice_wins():
    assert _run("pass", OMP_WAIT_POLICY="ACTIVE") == ["user", "ACTIVE", "True"]
    assert _run("pass", GOMP_SPINCOUNT="1000")[:2] == ["user", "None"]


def test_nothing_is_changed_after_torch_loaded_libgomp():
    assert _run("import torch") == ["default", "None", "True"]
