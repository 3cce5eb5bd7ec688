"""Thin wrapper over the compiled I/O engine `superoffload.storage._aio_cffi`.

Three layers (docs/conventions.md, "Kernel bindings in three layers"): cext/so_aio.h
declares, the private compiled module implements (io_uring and/or Linux AIO, whichever
cext/build_aio.py found), this file checks arguments and turns every return code into an
exception. Importing it fails with ImportError when the compiled module is missing or was
built from another version of cext/ (a stale build must be rebuilt, not bypassed).
"""

from __future__ import annotations

import os
from typing import Any

from superoffload.storage.ring import BackendUnavailable, RingCompletion, RingOp

try:
    from superoffload.storage._aio_cffi import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:
    # missing build: the engine falls back to threads
    raise ImportError(f"superoffload's C I/O engine is not built ({exc}); build it with "
                      "`pip install -e .` (or `make install`)") from exc

# Must equal SO_AIO_ABI_VERSION in cext/so_aio.h.
EXPECTED_AIO_ABI_VERSION = 1


class StaleBuildError(ImportError):
    """The compiled module was built from a different cext/ than this wrapper expects."""


if lib.so_aio_abi_version() != EXPECTED_AIO_ABI_VERSION:
    raise StaleBuildError(
        f"superoffload.storage._aio_cffi has ABI version {lib.so_aio_abi_version()}, the "
        f"wrapper expects {EXPECTED_AIO_ABI_VERSION}: the build is stale. Rebuild it with "
        "`pip install -e .` (or `make install`).")

_CODES = {"io_uring": lib.SO_AIO_IO_URING, "libaio": lib.SO_AIO_LIBAIO}
_SHORT = {lib.SO_AIO_ERR_EOF, lib.SO_AIO_ERR_ZERO_WRITE}
_PACKAGES = {"io_uring": "liburing-dev", "libaio": "libaio-dev"}


def backends_built() -> tuple[str, ...]:
    """The kernel interfaces compiled into this build, fastest first."""
    mask = lib.so_aio_backends_built()
    return tuple(name for name, code in _CODES.items() if mask & code)


def _raise_for(rc: int, what: str) -> None:
    if rc == 0:
        return
    if rc == lib.SO_AIO_ERR_ARG:
        raise ValueError(f"{what}: an argument is out of range (the wrapper should have "
                         "refused it first)")
    if rc == lib.SO_AIO_ERR_FULL:
        raise RuntimeError(f"{what}: every request slot of the ring is taken")
    if rc == lib.SO_AIO_ERR_BACKEND:
        raise BackendUnavailable(f"{what}: the backend is not compiled in")
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    raise RuntimeError(f"{what}: unexpected return code {rc}")


class CRing:
    """One io_uring or Linux AIO context (storage/ring.py ``Ring``); the thread that made
    it calls it, except ``wake``."""

    def __init__(self, backend: str, *, queue_depth: int, max_requests: int,
                 block_bytes: int, align_bytes: int) -> None:
        if backend not in _CODES:
            raise ValueError(f"backend={backend!r}: the C engine has {sorted(_CODES)}")
        if backend not in backends_built():
            raise BackendUnavailable(
                f"this build has no {backend} (install Debian's {_PACKAGES[backend]} and "
                "reinstall: `pip install -e .`)")
        self.backend = backend
        self.max_requests = max_requests
        out = ffi.new("so_aio_ctx **")
        rc = lib.so_aio_create(_CODES[backend], queue_depth, max_requests, block_bytes,
                               align_bytes, out)
        if rc < 0 and rc > lib.SO_AIO_ERR_ARG:
            # the kernel refused (io_uring disabled, a seccomp filter, a memlock limit)
            raise BackendUnavailable(f"the kernel refused {backend}: {os.strerror(-rc)}")
        _raise_for(rc, f"creating a {backend} ring")
        self._ctx: Any = out[0]
        self._request = ffi.new("so_aio_request *")
        self._out = ffi.new("so_aio_completion[]", max_requests)

    def submit(self, op: RingOp) -> None:
        req = self._request
        req.fd_direct = op.fd_direct
        req.fd_buffered = op.fd_buffered
        req.is_write = int(op.is_write)
        req.buf = ffi.cast("void *", op.addr)
        req.offset = op.offset_bytes
        req.nbytes = op.nbytes
        req.tag = op.tag
        _raise_for(lib.so_aio_submit(self._ctx, req), f"{self.backend} submit")

    def run(self, timeout_ms: int = -1) -> list[RingCompletion]:
        n = lib.so_aio_run(self._ctx, timeout_ms, self._out, self.max_requests)
        if n < 0:
            _raise_for(n, f"{self.backend} ring")
        out = []
        for c in self._out[0:n]:
            error = int(c.error)
            out.append(RingCompletion(
                tag=int(c.tag), done_bytes=int(c.done_bytes),
                errno=-error if error < 0 and error not in _SHORT else 0,
                end_of_file=error in _SHORT, error_offset=int(c.error_offset)))
        return out

    def wake(self) -> None:
        _raise_for(lib.so_aio_wake(self._ctx), f"{self.backend} wake")

    def close(self) -> None:
        ctx, self._ctx = self._ctx, ffi.NULL
        # waits for the blocks in flight; NULL is a no-op
        lib.so_aio_destroy(ctx)
