"""What clients send beyond the fields a completion uses: fields the API does not support are refused naming
them (not silently ignored), fields that change nothing are accepted, an unknown `model` is a 404, /tokenize and
/detokenize answer as vLLM's do, and X-Request-Id is echoed without ever making two responses share an id."""

from __future__ import annotations

import json

import openai
import pytest

from app.api.guards import MAX_REQUEST_ID_CHARS
from app.api.routes import ApiSettings, build_api
from app.api.schemas import IGNORED_FIELDS
from tests.api.common import AUTH, KEY, client, openai_client

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=64)
COMPLETION = {"model": "kda-tiny", "prompt": "x = 1", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "kda-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


async def _post(app, path: str, body: dict, headers: dict | None = None):
    async with client(app) as http:
        return await http.post(path, content=json.dumps(body).encode(),
                               headers={**AUTH, "content-type": "application/json", **(headers or {})})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
COMPLETION_ONLY = [("tools", TOOLS), ("tool_choice", "auto"), ("parallel_tool_calls", "yes")]  # chat has them
UNSUPPORTED = [
    ("functions", [{"name": "f", "parameters": {}}]),  # the legacy form of tools
    ("function_call", "auto"),
    ("best_of", 3),
    ("suffix", "end"),
    ("guided_json", {"type": "object"}),
    ("no_such_field", 1),
]


@pytest.mark.parametrize(("path", "field", "value"), [("/v1/completions", *f) for f in UNSUPPORTED + COMPLETION_ONLY] +
                         [("/v1/chat/completions", *f) for f in UNSUPPORTED])
async def test_an_unsupported_field_is_refused_by_name(app, path, field, value):
    body = COMPLETION if path == "/v1/completions" else CHAT
    r = await _post(app, path, {**body, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


NEUTRAL = [{name: "x" if name in ("user", "service_tier", "safety_identifier", "prompt_cache_key") else
            ({"k": "v"} if name == "metadata" else True)} for name in sorted(IGNORED_FIELDS)] + [
    {"tools": None, "logit_bias": None, "no_such_field": None},  # a null is a field not set
    {"tools": [], "tool_choice": "none", "logit_bias": {}, "response_format": {"type": "text"},
     "parallel_tool_calls": False},
    {"best_of": 1},  # = n
    {"n": 2, "best_of": 2},
]


@pytest.mark.parametrize("extra", NEUTRAL, ids=lambda e: ",".join(e))
async def test_fields_that_change_nothing_are_accepted(app, extra):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = await _post(app, path, {**body, **extra})
        assert r.status_code == 200, (path, r.text)


MESSAGE_REFUSALS = [
    ({"role": "user", "content": "hi", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}, "messages.0"),
    ({"role": "tool", "content": "42"}, "messages.0"),  # no tool_call_id
    ({"role": "user", "content": "hi", "audio": {"id": "a"}}, "messages.0.audio"),
    ({"role": "user", "content": [{"type": "text", "text": "what is this"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
     "messages.0.content.1.type"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
     "messages.0.content.0.cache_control"),
]


@pytest.mark.parametrize(("message", "param"), MESSAGE_REFUSALS, ids=[p for _, p in MESSAGE_REFUSALS])
async def test_what_a_message_carries_beyond_text_is_refused_by_its_path(app, message, param):
    """An image part would otherwise be dropped from the prompt without a word; tool calls belong to an assistant,
    and a tool result names the call it answers."""
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {})):
        r = await _post(app, path, {**body, "messages": [message]})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


async def test_message_fields_that_change_nothing_are_accepted(app):
    messages = [{"role": "system", "content": "be brief", "name": "rules"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann", "refusal": None},
                {"role": "assistant", "content": "hello", "tool_calls": [], "function_call": None},
                {"role": "user", "content": "again"}]
    r = await _post(app, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


async def test_an_unknown_model_is_404_and_the_served_name_or_none_is_served(app):
    async with client(app) as http:
        oai = openai_client(http)
        with pytest.raises(openai.NotFoundError) as e:
            await oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            await oai.chat.completions.create(model="kda", messages=[{"role": "user", "content": "hi"}])
        out = await oai.completions.create(model="kda-tiny", prompt="x", max_tokens=1)
        assert out.model == "kda-tiny"
    r = await _post(app, "/v1/completions", {k: v for k, v in COMPLETION.items() if k != "model"})
    assert r.status_code == 200


async def test_a_served_model_name_replaces_the_model_name(backend):
    app = build_api(backend, ApiSettings(model_name="my-coder", api_key=KEY))
    assert (await _post(app, "/v1/completions", COMPLETION)).status_code == 404
    r = await _post(app, "/v1/completions", {**COMPLETION, "model": "my-coder"})
    assert r.status_code == 200 and r.json()["model"] == "my-coder"


async def test_tokenize_and_detokenize_round_trip(app, backend):
    tok = backend.tokenizer
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    r = await _post(app, "/tokenize", {"model": "kda-tiny", "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(tok.encode(text)), "max_model_len": backend.max_model_len,
                        "tokens": tok.encode(text)}
    back = await _post(app, "/detokenize", {"model": "kda-tiny", "tokens": r.json()["tokens"]})
    assert back.json() == {"prompt": text}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<|im_end|> hi"}]
    for gen in (True, False):
        r = await _post(app, "/tokenize", {"messages": messages, "add_generation_prompt": gen})
        assert r.json()["tokens"] == tok.encode_chat(messages, add_generation_prompt=gen)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "a", "tools": [1]}, "tools.0"),
    ("/tokenize", {"prompt": "a", "no_such_field": 1}, "no_such_field"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
async def test_tokenize_refuses_bad_input(app, path, body, param):
    r = await _post(app, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


async def test_tokenize_needs_the_key(app):
    async with client(app) as http:
        r = await http.post("/tokenize", json={"prompt": "a"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


async def test_x_request_id_is_echoed_or_made_and_never_shared(app):
    same = {"X-Request-Id": "client-id-7"}
    a, b = [await _post(app, "/v1/completions", COMPLETION, same) for _ in range(2)]
    assert a.headers["x-request-id"] == b.headers["x-request-id"] == "client-id-7"
    assert a.json()["id"] != b.json()["id"]  # the response ids are the server's own
    made = await _post(app, "/v1/completions", COMPLETION)
    assert len(made.headers["x-request-id"]) == 32
    refused = await _post(app, "/v1/completions", {**COMPLETION, "tools": [1]}, same)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "client-id-7"


@pytest.mark.parametrize("bad", ["a" * (MAX_REQUEST_ID_CHARS + 1), "tab\there", "é"])
async def test_a_bad_x_request_id_is_refused(app, bad):
    r = await _post(app, "/v1/completions", COMPLETION, {"X-Request-Id": bad.encode("utf-8")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


async def test_stop_token_ids_end_generation_after_the_id(app, backend):
    """vLLM's `stop_token_ids`: the output ends with the id (counted, not in the text), finish_reason "stop"."""
    tok = backend.tokenizer
    plain = (await _post(app, "/v1/completions", {**COMPLETION, "max_tokens": 6, "ignore_eos": True,
                                                  "logprobs": 0})).json()
    ids = [tok.token_id(t) for t in plain["choices"][0]["logprobs"]["tokens"]]
    stopped = (await _post(app, "/v1/completions", {**COMPLETION, "max_tokens": 6, "ignore_eos": True,
                                                    "stop_token_ids": [ids[2]]})).json()
    first = ids.index(ids[2])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == backend.tokenizer.decode(ids[:first])
    assert stopped["usage"]["completion_tokens"] == first + 1


@pytest.mark.parametrize("value", [[-1], [10**9], list(range(65)), "5", [1.5]])
async def test_bad_stop_token_ids_are_refused(app, value):
    r = await _post(app, "/v1/completions", {**COMPLETION, "stop_token_ids": value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop_token_ids"), r.text


async def test_logit_bias_and_penalties_reach_the_engine(app):
    """A +100 bias makes the biased id every greedy token (completions and chat); penalties and min_p are taken
    (their effect on the distribution is checked against a reference in tests/engine/test_logits.py)."""
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = await _post(app, path, {**body, "max_tokens": 4, "logit_bias": {"42": 100}, "ignore_eos": True,
                                    "logprobs": 0 if path == "/v1/completions" else True})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        tokens = lp["tokens"] if path == "/v1/completions" else [e["bytes"] for e in lp["content"]]
        assert len(tokens) == 4 and len(set(map(str, tokens))) == 1
    r = await _post(app, "/v1/completions", {**COMPLETION, "presence_penalty": 1.0, "frequency_penalty": -0.5,
                                             "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
                                             "temperature": 0.8, "seed": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(10**9): 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"min_tokens": 3}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"presence_penalty": -2.5}, "presence_penalty"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.1}, "min_p"),
])
async def test_bad_processing_settings_are_refused(app, extra, param):
    r = await _post(app, "/v1/completions", {**COMPLETION, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def lossy_app():
    """The API over an engine that stores dasc nr checkpoints at W_max 16 (lossy)."""
    from app.api.local import LocalBackend
    from app.engine.config import EngineConfig
    from app.engine.engine import Engine
    from tests.helpers import load_zoo

    model, tok = load_zoo("kda-tiny")
    config = EngineConfig(kv_slots=16384, checkpoint_budget_mb=16, w_max=16, recompute_tail=0)  # short prompts hit
    local = LocalBackend(Engine(model, tok, config))
    yield build_api(local, SETTINGS)
    local.engine.shutdown()


async def test_cache_lossless_never_resumes_from_a_compressed_checkpoint(lossy_app):
    """usage.prompt_tokens_details.compressed_checkpoint says when a lossy checkpoint served the request;
    `cache_lossless` (an extension) keeps a request off them: it recomputes and answers as the cold run did."""
    body = {**COMPLETION, "prompt": "def mean(xs):\n    return sum(xs) / len(xs)\n", "max_tokens": 8,
            "ignore_eos": True}
    cold = (await _post(lossy_app, "/v1/completions", body)).json()
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "compressed_checkpoint": False}
    hit = (await _post(lossy_app, "/v1/completions", body)).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert hit["usage"]["prompt_tokens_details"]["compressed_checkpoint"] is True
    for stream in (False, True):
        r = await _post(lossy_app, "/v1/completions", {**body, "cache_lossless": True, "stream": stream,
                                                       "stream_options": {"include_usage": True} if stream else None})
        if stream:
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            text, used = "".join(c["choices"][0]["text"] for c in events if c["choices"]), events[-1]["usage"]
        else:
            text, used = r.json()["choices"][0]["text"], r.json()["usage"]
        assert used["prompt_tokens_details"] == {"cached_tokens": 0, "compressed_checkpoint": False}
        assert text == cold["choices"][0]["text"]


async def test_chat_defaults_to_the_rest_of_the_context_within_the_limit(backend):
    app = build_api(backend, ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=20))
    r = (await _post(app, "/v1/chat/completions", {**CHAT, "max_tokens": None, "ignore_eos": True})).json()
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["finish_reason"] == "length"
    r = (await _post(app, "/v1/completions", {**COMPLETION, "max_tokens": None, "ignore_eos": True})).json()
    assert r["usage"]["completion_tokens"] == SETTINGS.default_max_tokens  # completions keep their default
