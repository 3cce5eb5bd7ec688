"""CFFI build script of the asynchronous I/O engine (API mode, out of line).

setup.py names this file in `cffi_modules`, so `pip install -e .` compiles cext/so_aio*.c
into the private extension `superoffload.storage._aio_cffi`. The cdef is the CDEF block of
so_aio.h, so the declaration lives in one place (docs/conventions.md, "Kernel bindings in
three layers").

Which kernel interfaces go in is decided here, by compiling and linking a few lines against
each library: io_uring (Debian `liburing-dev`) and Linux AIO (`libaio-dev`). A machine
without either still builds the module, with no backend in it; the wrapper then uses the
torch-only fallback (superoffload/storage/aio_threads.py), and the test
tests/test_storage_aio_installed.py fails when SUPEROFFLOAD_REQUIRE_AIO=1 (CI sets it).

SUPEROFFLOAD_AIO_BACKENDS=io_uring,libaio|io_uring|libaio|none narrows the search (to test
the build without a library; default: every one found).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from cffi import FFI

CEXT_DIR = Path(__file__).resolve().parent
HEADER = CEXT_DIR / "so_aio.h"
SOURCES = ["so_aio.c", "so_aio_backends.c"]
COMPILE_FLAGS = ["-O2", "-std=gnu11", "-Wall"]
BACKENDS_ENV = "SUPEROFFLOAD_AIO_BACKENDS"

# backend -> (macro, library, a program that needs both the header and the library)
PROBES = {
    "io_uring": ("SO_AIO_HAVE_URING", "uring",
                 "#include <liburing.h>\n"
                 "int main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n"),
    "libaio": ("SO_AIO_HAVE_LIBAIO", "aio",
               "#include <libaio.h>\n"
               "int main(void) { io_context_t c = 0; return io_setup(1, &c); }\n"),
}


def cdef_text(header: Path = HEADER) -> str:
    """The declarations between CDEF-BEGIN and CDEF-END of the C header."""
    text = header.read_text()
    begin = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    end = text.index("/* CDEF-END */")
    return text[begin:end]


def wanted_backends() -> list[str]:
    raw = os.environ.get(BACKENDS_ENV, "").strip().lower()
    if not raw:
        return list(PROBES)
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        raise SystemExit(f"{BACKENDS_ENV}={raw!r}: {unknown} unknown; use a comma list of "
                         f"{sorted(PROBES)} or 'none'")
    return names


def links(program: str, library: str) -> bool:
    """True when `program` compiles and links against -l`library` with the build's C
    compiler (the header and the library are both installed)."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory(prefix="superoffload-aio-probe-") as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text(program)
        try:
            done = subprocess.run([*compiler, str(source), "-o", str(Path(tmp) / "probe"),
                                   f"-l{library}"], capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


def found_backends() -> list[str]:
    return [name for name in wanted_backends() if links(PROBES[name][2], PROBES[name][1])]


def _relative(path: Path) -> str:
    # setuptools wants source paths relative to the project root when building in place
    try:
        return os.path.relpath(path)
    except ValueError:
        # different drive (Windows)
        return str(path)


BACKENDS = found_backends()
print(f"superoffload: building the I/O engine with backends {BACKENDS or 'none'} "
      f"({BACKENDS_ENV} narrows the search)")

ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "superoffload.storage._aio_cffi",
    '#include "so_aio.h"\n',
    sources=[_relative(CEXT_DIR / name) for name in SOURCES],
    include_dirs=[_relative(CEXT_DIR)],
    define_macros=[(PROBES[name][0], "1") for name in BACKENDS],
    libraries=[PROBES[name][1] for name in BACKENDS],
    extra_compile_args=COMPILE_FLAGS,
    depends=[_relative(p) for p in sorted(CEXT_DIR.glob("so_aio*.h"))],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
