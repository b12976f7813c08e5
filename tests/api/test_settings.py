"""`ApiArgs` (the serve config's `api:` block) mirrors `ApiSettings`: the same fields with the same defaults, so
every API limit can be set from the config and none drifts. Two differ by design: the config's
`served_model_name` is `ApiSettings.model_name` (unset: the model), and `request_id_header` is the deployment's
choice (Serve's proxy echoes X-Request-Id itself)."""

from __future__ import annotations

import dataclasses

import pytest

from app.api.routes import ApiSettings


def test_api_args_mirror_api_settings():
    builder = pytest.importorskip("deployments.builder")  # imports ray
    args = builder.ApiArgs().model_dump()
    assert args.pop("served_model_name") is None
    settings = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ApiSettings) if f.name not in ("model_name", "request_id_header")}
    assert set(args) == set(settings)
    assert {k: list(v) if k == "cors_origins" else v for k, v in settings.items()} == args
    assert ApiSettings(model_name="m", **args).max_in_flight == args["max_in_flight"]
