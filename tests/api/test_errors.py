"""The API's error paths in-process over real kda-tiny engines: OpenAI-style 400 / 401 / 404 / 413 bodies, a
request the engine rejects, 503 when an engine step fails, and the `error` event that ends a stream which
had already started when its step failed."""

from __future__ import annotations

import pytest
from openai import BadRequestError

from app.api.routes import ApiSettings, build_api
from tests.api.common import AUTH, KEY, client, openai_client, sse_events

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_prompt_tokens=2048, max_tokens_limit=64)
CHAT = {"messages": [{"role": "user", "content": "tell me about the sea"}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}
COMPLETION = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


async def test_bad_inputs_get_openai_errors(app):
    url = "/v1/completions"
    cases = [({"prompt": "x", "max_tokens": -1}, 400), ({"prompt": "x", "temperature": 9}, 400),
             ({"prompt": ""}, 400), ({"prompt": "x", "max_tokens": 65}, 400), ({"max_tokens": 3}, 400),
             ({"prompt": "x " * 2100}, 413), ({"prompt": "x", "top_p": 0}, 400), ({"prompt": [[]]}, 400),
             ({"prompt": [5, 4096]}, 400), ({"prompt": "x", "n": 17}, 400), ({"prompt": "x", "stop": [""]}, 400),
             ({"prompt": "x", "logprobs": 21}, 400), ({"prompt": "x", "presence_penalty": 2.5}, 400)]
    async with client(app) as http:
        for body, status in cases:
            r = await http.post(url, json=body, headers=AUTH)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", body
        r = await http.post(url, json={"prompt": "x", "max_tokens": 65}, headers=AUTH)
        assert r.json()["error"]["param"] == "max_tokens"
        r = await http.post(url, content=b"{oops", headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]},
                            headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
        with pytest.raises(BadRequestError):
            await openai_client(http).chat.completions.create(model="kda-tiny", messages=[], max_tokens=4)


async def test_api_key_and_body_size_are_checked_first(app):
    url = "/v1/completions"
    async with client(app) as http:
        assert (await http.post(url, json={"prompt": "x"})).status_code == 401
        wrong = await http.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert (await http.get("/v1/models")).status_code == 401
        unchecked = await http.post(url, content=b"{oops", headers={"content-type": "application/json"})
        assert unchecked.status_code == 401  # the key before the body
        big = await http.post(url, content=b"x" * (2 << 20), headers={**AUTH, "content-type": "application/json"})
        assert big.status_code == 413 and "bytes" in big.json()["error"]["message"]
        missing = await http.get("/v1/nothing-here", headers=AUTH)
        assert missing.status_code == 404 and missing.json()["error"]["message"]


async def test_a_request_the_engine_rejects_is_a_400_before_any_stream(backend):
    """Over the model's context length (4096) but under the API's prompt limit: the engine's validate says no."""
    app = build_api(backend, ApiSettings(model_name="kda-tiny", max_prompt_tokens=4096, max_tokens_limit=1024))
    prompt = [7] * 4000
    async with client(app) as http:
        for stream in (False, True):
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200, "stream": stream})
            assert r.status_code == 400, stream
            assert "context length 4096" in r.json()["error"]["message"]
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 3500}],
                                                              "max_tokens": 1024, "stream": stream})
            assert r.status_code == 400 and "context length 4096" in r.json()["error"]["message"], stream
        fits = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 4000


async def test_a_failed_engine_step_is_a_503_and_the_engine_serves_on(faulty):
    local, fault = faulty
    app = build_api(local, ApiSettings(model_name="kda-tiny"))
    async with client(app) as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for after in (0, 3):  # the prefill step fails, or the third decode step
                fault.arm(after)
                r = await http.post(path, json=body)
                assert r.status_code == 503, (path, after, r.text)
                error = r.json()["error"]
                assert error["type"] == "server_error", path
                assert error["message"].startswith("generation failed: ") and "injected device fault" in \
                    error["message"], path
            ok = await http.post(path, json=body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, path
    snap = local.engine.snapshot()
    assert snap["running"] == 0 and snap["waiting"] == 0


async def test_a_failed_engine_step_leaks_no_cache_slot(faulty):
    local, fault = faulty
    app = build_api(local, ApiSettings(model_name="kda-tiny"))
    async with client(app) as http:
        fault.arm(2)
        assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 503
    local.engine.call(lambda engine: engine.check_integrity())


async def test_a_stream_whose_step_fails_ends_with_an_error_event(faulty):
    local, fault = faulty
    app = build_api(local, ApiSettings(model_name="kda-tiny"))
    async with client(app) as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            fault.arm(3)  # prefill and two decode steps give three tokens, the next step fails
            r = await http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), path
            events = sse_events(r.text)
            assert events[-1] == "[DONE]", path
            error = events[-2]["error"]
            assert error["type"] == "server_error" and "injected device fault" in error["message"], path
            chunks = events[:-2]
            assert len(chunks) == 3 and all(len(c["choices"]) == 1 for c in chunks), path  # no usage chunk
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks), path
            ok = await http.post(path, json={**body, "stream": True})
            assert sse_events(ok.text)[-2]["choices"][0]["finish_reason"] == "length", path
