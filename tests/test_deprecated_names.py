"""The contract errors are importable from the package (the engine's old names went in 0.2:
CHANGELOG.md)."""

from __future__ import annotations

import pytest

import superoffload as so
from superoffload.runtime import contract

CONTRACT_ERRORS = sorted(n for n, v in vars(contract).items()
                         if isinstance(v, type) and issubclass(v, contract.ContractError))


@pytest.mark.parametrize("name", CONTRACT_ERRORS)
def test_every_contract_error_is_importable_from_the_package(name):
    assert getattr(so, name) is getattr(contract, name)
    assert name in so.__all__
