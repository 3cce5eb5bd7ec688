"""Fixtures shared by the test files."""

from __future__ import annotations

import os

# libgomp reads its wait policy once, when torch loads it: set it before `import torch`.
# The default spins idle OpenMP threads, which on a busy 2-core machine makes OpenMP work
# 20-70x slower (docs/kernel.md, "OpenMP wait policy"); superoffload's CLI sets the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: on 2 shared cores torch's pool under contention is
    ~30x slower on the tiny tensors the engine tests use, and the engine has its own threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
