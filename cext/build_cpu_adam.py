"""CFFI build script of the CPU Adam kernel (API mode, out of line).

setup.py names this file in `cffi_modules`, so `pip install -e .` compiles cext/*.c into the
private extension `superoffload.kernels._cpu_adam_cffi`. The cdef is the CDEF block of
so_cpu_adam.h, so the declaration lives in one place (docs/conventions.md, "Kernel bindings
in three layers").

Compile flags (FACTS.md "Lessons"):
  -O3 -fno-math-errno   gcc vectorises sqrt only without errno;
  -fno-trapping-math    lets gcc if-convert the fp16 rounding selects (values unchanged);
  -ffp-contract=off     no FMA contraction, so every SIMD path gives the same bits;
  -fopenmp              one parallel region per call; never -march=native (run-time dispatch).
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

CEXT_DIR = Path(__file__).resolve().parent
HEADER = CEXT_DIR / "so_cpu_adam.h"
SOURCES = ["so_cpu_adam.c", "so_simd.c", "so_guard.c"]
COMPILE_FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp",
    "-std=c11",
]
LINK_FLAGS = ["-fopenmp"]


def cdef_text(header: Path = HEADER) -> str:
    """The declarations between CDEF-BEGIN and CDEF-END of the C header."""
    text = header.read_text()
    begin = text.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    end = text.index("/* CDEF-END */")
    return text[begin:end]


def _relative(path: Path) -> str:
    # setuptools wants source paths relative to the project root when building in place
    try:
        return os.path.relpath(path)
    except ValueError:
        # different drive (Windows)
        return str(path)


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "superoffload.kernels._cpu_adam_cffi",
    '#include "so_cpu_adam.h"\n',
    sources=[_relative(CEXT_DIR / name) for name in SOURCES],
    include_dirs=[_relative(CEXT_DIR)],
    extra_compile_args=COMPILE_FLAGS,
    extra_link_args=LINK_FLAGS,
    depends=[_relative(p) for p in sorted(CEXT_DIR.glob("*.h"))],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
