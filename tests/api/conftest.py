"""Fixtures of the in-process API tests: `LocalBackend`s over real kda-tiny engines, shared by the session."""

from __future__ import annotations

import pytest

from app.api.local import LocalBackend
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from tests.api.common import StepFault
from tests.helpers import load_zoo


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def backend():
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, EngineConfig()))
    yield local
    local.engine.shutdown()


@pytest.fixture(scope="session")
def faulty():
    """(a LocalBackend, the StepFault hooked into its model): arm the fault to make a step fail."""
    model, tok = load_zoo("kda-tiny")
    fault = StepFault()
    model.register_forward_pre_hook(fault)
    local = LocalBackend(Engine(model, tok, EngineConfig()))
    yield local, fault
    local.engine.shutdown()
