"""Old names a user may have typed keep working, warn, and reach the same object
(docs/engine.md, "Glossary"): ``engine.backend`` / ``backend=`` (now ``device_ops``),
``engine.worker`` (now ``cpu_worker``); the contract errors are importable from the package."""

from __future__ import annotations

import pytest
from _engine_ref import HYPER, cpu_config
from _tiny_models import make_model

import superoffload as so
from superoffload.runtime import contract
from superoffload.runtime.devices import CpuDeviceOps

pytestmark = pytest.mark.usefixtures("one_thread")


def test_old_attribute_names_warn_and_reach_the_new_ones():
    engine = so.initialize(make_model(), optimizer=HYPER, config=cpu_config())
    try:
        with pytest.warns(DeprecationWarning, match=r"OffloadEngine\.backend .* use \.device_ops"):
            assert engine.backend is engine.device_ops
        with pytest.warns(DeprecationWarning, match=r"OffloadEngine\.worker .* use \.cpu_worker"):
            assert engine.worker is engine.cpu_worker
    finally:
        engine.close()


def test_the_old_keyword_is_taken_with_a_warning_and_not_together_with_the_new():
    ops = CpuDeviceOps()
    with pytest.warns(DeprecationWarning, match="backend= is deprecated: use device_ops="):
        engine = so.initialize(make_model(), optimizer=HYPER, config=cpu_config(), backend=ops)
    try:
        assert engine.device_ops is ops
    finally:
        engine.close()
    with pytest.raises(TypeError, match="pass device_ops= only"):
        so.initialize(make_model(), optimizer=HYPER, config=cpu_config(), backend=ops,
                      device_ops=CpuDeviceOps())


CONTRACT_ERRORS = sorted(n for n, v in vars(contract).items()
                         if isinstance(v, type) and issubclass(v, contract.ContractError))


@pytest.mark.parametrize("name", CONTRACT_ERRORS)
def test_every_contract_error_is_importable_from_the_package(name):
    assert getattr(so, name) is getattr(contract, name)
    assert name in so.__all__
