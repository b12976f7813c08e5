"""What a client sends that the API must refuse with a 400 naming the field, never a plain-text 500 or a
coerced value: wrong JSON types, lone surrogates, non-string text parts, seeds out of range, and requests
over the operator's caps. Also: `cache_salt` and the queue deadline reach the backend, and an unexpected
exception is a JSON 500."""

from __future__ import annotations

import json
import time

import pytest

from app.api.routes import ApiSettings, build_api
from tests.api.common import AUTH, KEY, Recording, client

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=64)
BASE = {"prompt": "x = 1", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


async def _post(http, body: dict | bytes, path: str = "/v1/completions"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await http.post(path, content=content, headers={**AUTH, "content-type": "application/json"})


def _is_400_naming(r, param: str) -> bool:
    assert r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return r.status_code == 400 and error["param"] == param


async def test_wrong_json_types_are_not_coerced(app):
    wrong = [("n", "2", "n"), ("stream", "yes", "stream"), ("max_tokens", "5", "max_tokens"),
             ("temperature", "0", "temperature"), ("n", True, "n"), ("max_tokens", 5.0, "max_tokens"),
             ("top_k", "1", "top_k"), ("echo", "true", "echo"), ("ignore_eos", 1, "ignore_eos"),
             ("seed", "7", "seed"), ("top_p", False, "top_p"), ("stop", 5, "stop"), ("cache_salt", 5, "cache_salt"),
             ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage"), ("prompt", 5, "prompt"),
             ("seed", 2**64, "seed"), ("seed", 2**63, "seed"), ("seed", -(2**63) - 1, "seed")]
    async with client(app) as http:
        for key, value, param in wrong:
            r = await _post(http, {**BASE, key: value})
            assert _is_400_naming(r, param), (key, value, r.text)
        for literal in (b"NaN", b"Infinity"):
            r = await _post(http, b'{"prompt": "x", "max_tokens": 1, "temperature": ' + literal + b"}")
            assert _is_400_naming(r, "temperature"), literal
        r = await _post(http, {**CHAT, "max_completion_tokens": "2"}, "/v1/chat/completions")
        assert _is_400_naming(r, "max_completion_tokens"), r.text
        ok = [{"temperature": 0, "top_p": 1}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 0, "n": 2}]
        for extra in ok:  # a float field takes an integer; seeds at both ends of the range are served
            r = await _post(http, {**BASE, **extra})
            assert r.status_code == 200, (extra, r.text)


async def test_lone_surrogates_and_bad_text_parts_are_400s(app):
    surrogate = '"\\ud800"'  # valid JSON, but no UTF-8 string: the tokenizer cannot take it
    cases = [
        ("/v1/completions", f'{{"prompt": {surrogate}}}', "prompt"),
        ("/v1/completions", f'{{"prompt": ["ok", {surrogate}]}}', "prompt.1"),
        ("/v1/completions", '{"prompt": [1, "a"]}', "prompt.1"),
        ("/v1/completions", f'{{"prompt": "x", "stop": [{surrogate}]}}', "stop.0"),
        ("/v1/completions", f'{{"prompt": "x", "cache_salt": {surrogate}}}', "cache_salt"),
        ("/v1/completions", f'{{"prompt": "x", "model": {surrogate}}}', "model"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {surrogate}}}]}}',
         "messages.0.content"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": '
                                 f'{surrogate}}}]}}]}}', "messages.0.content.0.text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
         "messages.0.content.0.text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}',
         "messages.0.content.0.text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [5]}]}', "messages.0.content.0"),
        ("/v1/chat/completions", '{"messages": [{"role": 5, "content": "x"}]}', "messages.0.role"),
    ]
    async with client(app) as http:
        for path, body, param in cases:
            r = await _post(http, body.encode(), path)
            assert _is_400_naming(r, param), (body, r.text)
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                           {"type": "text", "text": " there"}]}], "max_tokens": 1}
        assert (await _post(http, parts, "/v1/chat/completions")).status_code == 200


async def test_requests_over_the_caps_are_400s_naming_the_field(backend):
    settings = ApiSettings(model_name="kda-tiny", max_prompts=3, max_sequences=8, max_stops=2, max_stop_chars=5,
                           max_messages=3, max_cache_salt_chars=4)
    app = build_api(backend, settings)
    message = {"role": "user", "content": "hi"}
    cases = [("/v1/completions", {"prompt": ["a"] * 4}, "prompt"),
             ("/v1/completions", {"prompt": [[5]] * 4}, "prompt"),
             ("/v1/completions", {"prompt": ["a", "b"], "n": 5}, "n"),
             ("/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
             ("/v1/completions", {"prompt": "a", "stop": "abcdef"}, "stop"),
             ("/v1/completions", {"prompt": "a", "cache_salt": "tenant"}, "cache_salt"),
             ("/v1/chat/completions", {"messages": [message] * 4}, "messages"),
             ("/v1/chat/completions", {"messages": [message], "n": 9}, "n")]
    async with client(app) as http:
        for path, body, param in cases:
            r = await _post(http, {**body, "max_tokens": 1}, path)
            assert _is_400_naming(r, param), (body, r.text)
        at_caps = [("/v1/completions", {"prompt": ["a", "b"], "n": 4, "stop": ["x", "abcde"], "cache_salt": "t1"}),
                   ("/v1/completions", {"prompt": [5, 6, 7, 8, 9]}),  # one prompt of ids, not five prompts
                   ("/v1/chat/completions", {"messages": [message] * 3, "n": 8})]
        for path, body in at_caps:
            r = await _post(http, {**body, "max_tokens": 1}, path)
            assert r.status_code == 200, (body, r.text)


async def test_cache_salt_and_the_queue_deadline_reach_the_backend(backend):
    recording = Recording(backend)
    app = build_api(recording, ApiSettings(model_name="kda-tiny", queue_timeout_s=30.0))
    async with client(app) as http:
        before = time.time()
        r = await _post(http, {**BASE, "cache_salt": "tenant-a"})
        c = await _post(http, {**CHAT, "cache_salt": "tenant-b", "stream": True}, "/v1/chat/completions")
        plain = await _post(http, BASE)
        after = time.time()
    assert r.status_code == c.status_code == plain.status_code == 200
    assert [params.cache_salt for _, params, _ in recording.calls] == ["tenant-a", "tenant-b", None]
    assert all(before + 30.0 <= deadline <= after + 30.0 for _, _, deadline in recording.calls)


class _BrokenStatus:
    """A real backend whose `status` raises what no handler knows, as a bug would."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    async def status(self) -> dict:
        raise KeyError("a bug")


async def test_an_unexpected_exception_is_a_json_500(backend):
    app = build_api(_BrokenStatus(backend), ApiSettings(model_name="kda-tiny"))
    async with client(app) as http:
        r = await http.get("/status")
        ok = await http.get("/v1/models")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["type"] == "server_error" and "KeyError" in r.json()["error"]["message"]
    assert ok.status_code == 200
