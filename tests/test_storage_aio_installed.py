"""An installed checkout has the compiled I/O engine, and CI runs it on io_uring or Linux
AIO: without this test a build that lost liburing-dev and libaio-dev would leave every
storage test green on the torch-only fallback (docs/storage.md, "I/O engine").

The compiled module is required when the package is installed from this checkout (pip
compiles cext/ at install) or when SUPEROFFLOAD_REQUIRE_AIO=1; a kernel interface (not the
fallback) is required when SUPEROFFLOAD_REQUIRE_AIO=1 (.ci/run sets it after installing
Debian's liburing-dev and libaio-dev). A build with no interface still works: the last test
builds one (cext/build_aio.py with SUPEROFFLOAD_AIO_BACKENDS=none) and runs it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_kernel_installed import installed_from_here

from superoffload.storage import AioEngine, StorageWarning
from superoffload.storage.ring import available_backends

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "SUPEROFFLOAD_REQUIRE_AIO"
MODULE = "superoffload.storage._aio_cffi"


def test_the_compiled_io_engine_runs_a_kernel_interface_when_required() -> None:
    how = installed_from_here()
    required = os.environ.get(REQUIRE_ENV) == "1"
    if how is None and not required:
        pytest.skip(f"superoffload is not installed from {ROOT} and {REQUIRE_ENV} is unset")
    why = f"({REQUIRE_ENV}=1)" if required else f"(installed from this checkout: {how})"
    assert importlib.util.find_spec(MODULE) is not None, (
        f"{MODULE} is missing {why}: rebuild with `pip install -e .` (or `make install`)")
    from superoffload.storage import aio_c  # checks the ABI version baked into the library

    assert aio_c.lib.so_aio_abi_version() == aio_c.EXPECTED_AIO_ABI_VERSION
    if not required:
        return
    assert aio_c.backends_built(), (
        "the I/O engine was built without io_uring or Linux AIO: install Debian's "
        "liburing-dev (or libaio-dev) and rebuild")
    with AioEngine() as engine:
        assert engine.backend in ("io_uring", "libaio"), (
            f"AioEngine fell back to {engine.backend!r} {why}; the kernel interfaces built "
            f"are {aio_c.backends_built()}, those that run here {available_backends()}")


PROBE = r"""
import importlib.util, sys, warnings
spec = importlib.util.spec_from_file_location("superoffload.storage._aio_cffi", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.modules["superoffload.storage._aio_cffi"] = module
from superoffload.storage import AioEngine, StorageWarning, aio_c
from superoffload.storage.ring import BackendUnavailable
assert aio_c.backends_built() == (), aio_c.backends_built()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = AioEngine()
assert engine.backend == "threads", engine.backend
assert any(issubclass(w.category, StorageWarning) and "no io_uring" in str(w.message)
           for w in caught), [str(w.message) for w in caught]
engine.close()
try:
    AioEngine(backend="io_uring")
except BackendUnavailable as exc:
    assert "liburing-dev" in str(exc), exc
else:
    raise AssertionError("backend='io_uring' ran without io_uring in the build")
print("ok")
"""


def test_a_build_without_kernel_interfaces_falls_back_to_threads(tmp_path: Path) -> None:
    """cext/build_aio.py with SUPEROFFLOAD_AIO_BACKENDS=none: the module builds, the engine
    says it uses the fallback, a backend asked for by name is refused naming the package."""
    (tmp_path / "cext").mkdir()
    for source in (ROOT / "cext").glob("*"):
        if source.is_file():
            (tmp_path / "cext" / source.name).write_bytes(source.read_bytes())
    env = {**os.environ, "SUPEROFFLOAD_AIO_BACKENDS": "none"}
    build = ("import runpy; runpy.run_path('cext/build_aio.py')['ffibuilder']"
             ".compile(tmpdir='.', verbose=False)")
    done = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backends none" in done.stdout
    built = next((tmp_path / "superoffload" / "storage").glob("_aio_cffi*.so"))
    done = subprocess.run([sys.executable, "-c", PROBE, str(built)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        done.stdout[-2000:] + done.stderr[-3000:]


def test_asking_for_the_threads_warns_nothing() -> None:
    """The warning is for a fallback the caller did not ask for."""
    assert issubclass(StorageWarning, RuntimeWarning)  # what callers filter on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AioEngine(backend="threads").close()  # asked for: no warning


STALE = r"""
import sys, types
from superoffload.storage import _aio_cffi as real
class Lib:  # the real library, one ABI version older
    def __getattr__(self, name):
        return getattr(real.lib, name)
    def so_aio_abi_version(self):
        return real.lib.so_aio_abi_version() - 1
sys.modules["superoffload.storage._aio_cffi"] = types.SimpleNamespace(ffi=real.ffi, lib=Lib())
from superoffload.storage import AioEngine
try:
    AioEngine()
except ImportError as exc:
    assert "the build is stale" in str(exc), exc
    print("ok")
"""


def test_a_stale_build_fails_loudly_instead_of_falling_back() -> None:
    """A compiled module of another ABI version is an ImportError telling to rebuild, not a
    quiet switch to the threads (storage/ring.py ``c_engine``)."""
    if importlib.util.find_spec(MODULE) is None:
        pytest.skip(f"{MODULE} is not built here")
    done = subprocess.run([sys.executable, "-c", STALE], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", \
        done.stdout[-2000:] + done.stderr[-3000:]
