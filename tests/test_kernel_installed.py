"""An installed checkout runs the compiled kernel: without this test, deleting
superoffload/kernels/_cpu_adam_cffi*.so left the whole suite green, because the package
falls back to the pure-torch kernel with one warning and every kernel test passes on it.

The compiled module is required when the package is installed from this checkout (pip
compiles cext/ at install, so a missing module means a broken build) or when
SUPEROFFLOAD_REQUIRE_KERNEL=1 (.ci/run sets it: CI installs the package with `make test`).
Elsewhere (the sources on sys.path, nothing installed) it skips and says why.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

import superoffload.kernels as K

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "SUPEROFFLOAD_REQUIRE_KERNEL"
MODULE = "superoffload.kernels._cpu_adam_cffi"


def installed_from_here() -> str | None:
    """How this checkout is installed ("editable" / "installed"), or None when it is not.
    Install records are pip's: a dist-info whose direct_url.json names this checkout, or a
    plain install (no direct_url.json) that holds the imported package. An egg-info that a
    build left inside the checkout is no install record."""
    import superoffload

    package = Path(superoffload.__file__).resolve().parent
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"] != "superoffload":
            continue
        raw = dist.read_text("direct_url.json")
        if raw is not None:
            info = json.loads(raw)
            url = urlparse(info.get("url", ""))
            if url.scheme == "file" and Path(unquote(url.path)).resolve() == ROOT:
                return "editable" if info.get("dir_info", {}).get("editable") else "installed"
            continue
        base = Path(str(dist.locate_file(""))).resolve()
        if base != ROOT and package.is_relative_to(base):
            return "installed"  # a wheel/sdist install: it was compiled then
    return None


def test_the_compiled_kernel_is_present_when_installed():
    how = installed_from_here()
    required = os.environ.get(REQUIRE_ENV) == "1"
    if how is None and not required:
        pytest.skip(f"superoffload is not installed from {ROOT} and {REQUIRE_ENV} is unset")
    why = f"({REQUIRE_ENV}=1)" if required else f"(installed from this checkout: {how})"
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None, (f"{MODULE} is missing {why}: the C kernel was not built; rebuild "
                              "with `pip install -e .` (or `make install`)")
    # importing the wrapper checks the ABI version baked into the library
    from superoffload.kernels import cpu_adam

    assert cpu_adam.lib.so_kernel_abi_version() == cpu_adam.EXPECTED_ABI_VERSION
    if os.environ.get(K.KERNEL_ENV, "").strip().lower() != "torch":  # the user's choice
        assert K.backend() == "cffi", f"the kernel fell back to {K.backend()!r} {why}"
        assert K.simd_path() != "torch"
