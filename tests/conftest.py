"""Fixtures shared by the test files."""

from __future__ import annotations

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
