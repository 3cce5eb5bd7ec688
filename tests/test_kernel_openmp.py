"""The process's OpenMP wait policy (kernels/openmp.py; docs/kernel.md, "Threads, the work
split and the OpenMP wait policy"): importing superoffload, before or after torch, starts
no thread and writes no environment variable; the kernel's first call throttles libgomp's
spinning by a parked pool (measured here by the CPU time idle workers burn between
regions); the user's choice always wins; ``python -m superoffload`` owns its process and
sets a passive policy before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                                reason="reads /proc/self/maps (Linux)")
# source, OMP_WAIT_POLICY, and whether exactly one OpenMP runtime is mapped: the libgomp
# openmp_library() names (torch's copy, which our kernel binds to; never a second one)
PROBE = ("import os, sys; {first}; import superoffload.kernels as K, torch; "
         "K.grad_stats(torch.zeros(8)); "  # the first kernel call settles the policy
         "maps = {{l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}}; "
         "lib = K.openmp_library(); "
         "print(K.wait_policy().source, os.environ.get('OMP_WAIT_POLICY'), "
         "lib is not None and os.path.basename(lib).startswith('libgomp') and maps == {{lib}}, "
         "K.wait_policy().value.replace(' ', '_'))")
# CPU time (ms) the OpenMP workers use per 2-thread kernel region followed by a 20 ms
# pause: spinning workers burn the pause, sleeping ones almost nothing
IDLE = """
import time, torch
import superoffload.kernels as K
stats = K.prepare_grad_stats([torch.zeros(2 * 32768)])  # a team of 2 (32 Ki per thread)
for _ in range(5):
    stats(threads=2)
n = 40
cpu0, main0 = time.process_time(), time.thread_time()
for _ in range(n):
    stats(threads=2)
    time.sleep(0.02)
cpu1, main1 = time.process_time(), time.thread_time()
print(((cpu1 - cpu0) - (main1 - main0)) / n * 1e3)
"""


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SUPEROFFLOAD_OMP_THROTTLE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**clean, **env}, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _run(first: str, **env: str) -> list[str]:
    return _python(PROBE.format(first=first), **env).split()


# threads and environment before and after an import: what the import itself started
IMPORT = """
import os, sys, threading
{first}
threads, env = {{t.name for t in threading.enumerate()}}, dict(os.environ)
import {module}
print(sorted({{t.name for t in threading.enumerate()}} - threads),
      sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)))
"""


@pytest.mark.parametrize("module", ["superoffload", "superoffload.kernels"])
@pytest.mark.parametrize("first", ["pass", "import torch"])
def test_import_starts_no_thread_and_writes_no_environment(first, module):
    assert _python(IMPORT.format(first=first, module=module)).split("\n")[0] == "[] []"


def test_the_throttle_starts_at_the_first_kernel_call_and_not_before():
    code = ("import threading, torch, superoffload.kernels as K\n"
            "names = lambda: sorted(t.name for t in threading.enumerate())\n"
            "before, policy = names(), K.wait_policy().value\n"
            "K.grad_stats(torch.zeros(8)); first = names()\n"
            "K.grad_stats(torch.zeros(8))\n"
            "print('superoffload-omp-throttle' in before, policy == K.openmp.NOT_STARTED,\n"
            "      first.count('superoffload-omp-throttle'), names() == first)")
    assert _python(code).split() == ["False", "True", "1", "True"]


def test_superoffload_first_throttles_at_the_first_kernel_call():
    source, env, one_runtime, value = _run("pass")
    assert (source, env, one_runtime) == ("superoffload", "None", "True")
    assert value.startswith("libgomp_throttled"), value


# `python -m superoffload` itself (its __main__ runs the CLI; --help exits before any work)
CLI = """
import os, runpy, sys
torch_before = "torch" in sys.modules
sys.argv = ["superoffload", "--help"]
try:
    runpy.run_module("superoffload", run_name="__main__")
except SystemExit:
    pass
import superoffload.kernels as K, threading, torch
K.grad_stats(torch.zeros(8))
print(torch_before, os.environ.get("OMP_WAIT_POLICY"), K.wait_policy().source,
      K.wait_policy().value, "superoffload-omp-throttle" in {t.name for t in threading.enumerate()})
"""


def test_the_cli_sets_a_passive_policy_before_torch_unless_the_user_chose():
    assert _python(CLI).split("\n")[-2].split() == [
        "False", "PASSIVE", "superoffload", "OMP_WAIT_POLICY=PASSIVE", "False"]
    assert _python(CLI, OMP_WAIT_POLICY="ACTIVE").split("\n")[-2].split() == [
        "False", "ACTIVE", "user", "OMP_WAIT_POLICY=ACTIVE", "False"]
    assert _python(CLI, GOMP_SPINCOUNT="1000").split("\n")[-2].split() == [
        "False", "None", "user", "GOMP_SPINCOUNT=1000", "False"]


def test_the_users_choice_wins():
    assert _run("pass", OMP_WAIT_POLICY="ACTIVE")[:3] == ["user", "ACTIVE", "True"]
    assert _run("pass", GOMP_SPINCOUNT="1000")[:2] == ["user", "None"]
    # also after torch: the user's setting is never overridden by the throttle
    assert _run("import torch", OMP_WAIT_POLICY="ACTIVE")[:3] == ["user", "ACTIVE", "True"]


def test_torch_first_throttles_spinning_unless_opted_out():
    source, env, one_runtime, value = _run("import torch")
    assert (source, env, one_runtime) == ("superoffload", "None", "True")
    assert value.startswith("libgomp_throttled"), value
    assert _run("import torch", SUPEROFFLOAD_OMP_THROTTLE="0")[:3] == ["default", "None", "True"]


def test_idle_openmp_workers_sleep_even_when_torch_came_first():
    """Without the throttle libgomp's default (~300,000 spins) burns ~7 ms of a worker's CPU
    after every region here; throttled (<= 100 spins) it is ~0.04 ms, as with PASSIVE."""
    throttled = float(_python("import torch\n" + IDLE))
    spinning = float(_python("import torch\n" + IDLE, SUPEROFFLOAD_OMP_THROTTLE="0"))
    assert throttled < 1.0, f"idle workers used {throttled:.2f} ms of CPU per region"
    assert spinning > 3 * throttled, (spinning, throttled)  # the measurement can see spinning
