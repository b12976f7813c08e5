"""`ApiArgs` (the serve config's `api:` block) mirrors `ApiSettings`: the same fields with the same defaults, so
every API limit can be set from the config and none drifts."""

from __future__ import annotations

import dataclasses

import pytest

from app.api.routes import ApiSettings


def test_api_args_mirror_api_settings():
    builder = pytest.importorskip("deployments.builder")  # imports ray
    args = builder.ApiArgs().model_dump()
    settings = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ApiSettings) if f.name != "model_name"}
    assert set(args) == set(settings)
    assert {k: list(v) if k == "cors_origins" else v for k, v in settings.items()} == args
    assert ApiSettings(model_name="m", **args).max_in_flight == args["max_in_flight"]
