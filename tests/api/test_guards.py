"""The layer in front of the routes, in-process over a real kda-tiny engine: the body limit for bodies without
Content-Length, a bad Content-Length, the key compared in constant time, admission (429 with Retry-After
beyond `max_in_flight`), CORS off by default, the OpenAPI schema's error statuses, and /health."""

from __future__ import annotations

import asyncio
import hmac
import json

import pytest

from app.api.local import LocalBackend
from app.api.routes import ApiSettings, build_api
from app.engine.engine import Engine
from tests.api.common import AUTH, KEY, RawCall, client, raw_call
from tests.api.conftest import CONFIG
from tests.helpers import load_zoo

pytestmark = pytest.mark.anyio
LIMIT = 64 << 10
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_body_bytes=LIMIT)
STREAM = {"prompt": "def add(a, b):", "max_tokens": 512, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


async def test_a_chunked_body_over_the_limit_is_413_without_reading_the_rest(app):
    chunk = b" " * (8 << 10)
    body = [b'{"prompt": "x", "max_tokens": 1', *[chunk] * 64, b"}"]  # 512 KiB, eight times the limit
    call = await raw_call(app, RawCall(), "/v1/completions", body, AUTH)
    assert call.status == 413 and call.headers["content-type"] == "application/json"
    assert "bytes" in call.json()["error"]["message"]
    assert call.chunks_read <= LIMIT // len(chunk) + 2  # stopped at the limit: the rest was never pulled
    small = await raw_call(app, RawCall(), "/v1/completions", [b'{"prompt": "x",', b' "max_tokens": 1}'], AUTH)
    assert small.status == 200 and small.json()["usage"]["completion_tokens"] == 1


async def test_a_bad_content_length_is_400(app):
    for value in ("abc", "-1", "1e3"):
        call = await raw_call(app, RawCall(), "/v1/completions", [b'{"prompt": "x"}'],
                              {**AUTH, "Content-Length": value})
        assert call.status == 400 and "Content-Length" in call.json()["error"]["message"], value


async def test_the_key_is_compared_in_constant_time(app, monkeypatch):
    seen = []

    def spy(a, b):
        seen.append((type(a), type(b)))
        return hmac_compare(a, b)

    hmac_compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", spy)
    async with client(app) as http:
        good = await http.get("/v1/models", headers=AUTH)
        bad = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}x"})
        odd = await http.get("/v1/models", headers={"Authorization": "Bearer t\u00e9st".encode()})
    assert (good.status_code, bad.status_code, odd.status_code) == (200, 401, 401)
    assert seen == [(bytes, bytes)] * 3


async def test_requests_beyond_max_in_flight_get_429_with_retry_after(backend):
    app = build_api(backend, ApiSettings(model_name="kda-tiny", max_in_flight=2))
    body = json.dumps(STREAM).encode()
    held = [RawCall(), RawCall()]  # two streams whose client stops reading: they stay open
    tasks = [asyncio.create_task(raw_call(app, c, "/v1/completions", [body], stall_body=True)) for c in held]
    try:
        for c in held:
            await asyncio.wait_for(c.started.wait(), 120)
            assert c.status == 200
        async with client(app) as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            models = await http.get("/v1/models")
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert models.status_code == 200  # only generation requests are counted
    finally:
        for c, t in zip(held, tasks):
            c.disconnect.set()
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    async with client(app) as http:
        again = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert again.status_code == 200


async def test_cors_is_off_by_default_and_configurable(backend):
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    on = build_api(backend, ApiSettings(model_name="kda-tiny", api_key=KEY, cors_origins=(origin,)))
    off = build_api(backend, ApiSettings(model_name="kda-tiny", api_key=KEY))
    async with client(on) as http:
        r = await http.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = await http.get("/v1/models", headers={**AUTH, "Origin": origin})
        assert r.headers["access-control-allow-origin"] == origin
        r = await http.get("/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    async with client(off) as http:
        r = await http.get("/v1/models", headers={**AUTH, "Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await http.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers


async def test_openapi_documents_the_error_statuses_and_no_422(app):
    async with client(app) as http:
        schema = (await http.get("/openapi.json")).json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    error_ref = "#/components/schemas/ErrorResponse"
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"] == error_ref, (path, status)
    assert schema["paths"]["/health"]["get"]["responses"]["503"]["content"]["application/json"]["schema"][
        "$ref"] == error_ref
    detail = schema["components"]["schemas"]["ErrorDetail"]["properties"]
    assert set(detail) == {"message", "type", "param", "code"}


async def test_health_is_503_when_the_engine_cannot_step():
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, CONFIG), health_timeout_s=30.0)
    app = build_api(local, ApiSettings(model_name="kda-tiny"))
    try:
        async with client(app) as http:
            ok = await http.get("/health")
            local.engine.shutdown()
            down = await http.get("/health")
    finally:
        local.engine.shutdown()
    assert ok.status_code == 200 and ok.json() == {"status": "ok"}
    assert down.status_code == 503 and down.json()["error"]["type"] == "server_error", down.text
    assert "shut down" in down.json()["error"]["message"] and down.headers["retry-after"]


async def test_a_trailing_slash_is_a_json_404_not_a_redirect(app):
    """FastAPI answered 307 with an empty body (not JSON) to POST /v1/completions/."""
    async with client(app) as http:
        r = await http.post("/v1/completions/", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"], r.text
