"""Fixtures of the in-process API tests: `LocalBackend`s over real kda-tiny engines, shared by tests/api and shut
down after it. The engines hold 16k KV tokens (the model's context is 4096) and a 16 MB checkpoint pool."""

from __future__ import annotations

import pytest

from app.api.local import LocalBackend
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from tests.api.common import StepFault
from tests.helpers import load_zoo

CONFIG = EngineConfig(kv_slots=16384, checkpoint_budget_mb=16)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="package")
def backend():
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, CONFIG))
    yield local
    local.engine.shutdown()


@pytest.fixture(scope="package")
def faulty():
    """(a LocalBackend, the StepFault hooked into its model): arm the fault to make a step fail."""
    model, tok = load_zoo("kda-tiny")
    fault = StepFault()
    model.register_forward_pre_hook(fault)
    local = LocalBackend(Engine(model, tok, CONFIG))
    yield local, fault
    local.engine.shutdown()
