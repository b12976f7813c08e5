"""Tool calls on chat completions through the official `openai` client, in process over a real kda-tiny engine:
forced choices (required, a named function) and none on the model's own output, auto on a scripted engine
(`Scripted`: the zoo never writes a call by itself), streaming assembled by the SDK's helpers, the refusals, and
the next turn resuming from the previous turn's prompt and output."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from app.api.routes import ApiSettings, build_api
from tests.api.common import KEY, Scripted, client, openai_client

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=256, max_tools=4, max_tools_chars=6000)
CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "description": "Add two digits", "parameters": ADD}}]
SCHEMAS = {"get_weather": CITY, "add": ADD}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Oslo?"}]
ASK = {"model": "kda-tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


def _check_calls(choice, names=("get_weather", "add"), most: int = 16) -> list:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and 1 <= len(calls) <= most, choice
    for call in calls:
        assert call.type == "function" and call.function.name in names
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


async def test_required_named_and_none(app):
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**ASK, tool_choice="required", parallel_tool_calls=False)
        _check_calls(r.choices[0], most=1)
        named = await oai.chat.completions.create(**ASK, tool_choice={"type": "function", "function": {"name": "add"}},
                                                  parallel_tool_calls=False)
        _check_calls(named.choices[0], names=("add",), most=1)
        none = await oai.chat.completions.create(**{**ASK, "max_tokens": 8}, tool_choice="none")
        bare = await oai.chat.completions.create(**{**ASK, "tools": None, "max_tokens": 8})
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
        assert none.usage.prompt_tokens > bare.usage.prompt_tokens + 100  # the tools stay in the prompt


async def test_n_and_logprobs_with_forced_calls_and_a_stream_assembled_by_the_sdk(app):
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**{**ASK, "temperature": 1.0, "max_tokens": 200}, tool_choice="required",
                                              parallel_tool_calls=False, n=2, seed=3, logprobs=True, top_logprobs=2)
        for choice in r.choices:
            _check_calls(choice, most=1)
            assert len(choice.logprobs.content) >= 20  # every token of the wrapper and the arguments
        plain = await oai.chat.completions.create(**ASK, tool_choice="required", parallel_tool_calls=False)
        async with oai.chat.completions.stream(**ASK, tool_choice="required", parallel_tool_calls=False,
                                               stream_options={"include_usage": True}) as stream:
            names = [e.name async for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = await stream.get_final_completion()
        calls = _check_calls(final.choices[0])
        assert final.usage.completion_tokens == plain.usage.completion_tokens > 10
        assert names == [c.function.name for c in calls]
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]


async def test_the_next_turn_resumes_from_the_previous_prompt_and_output(app):
    async with client(app) as http:
        oai = openai_client(http)
        messages, previous = list(MESSAGES), None
        for turn in range(3):
            r = await oai.chat.completions.create(**{**ASK, "messages": messages}, tool_choice="required",
                                                  parallel_tool_calls=False, extra_body={"cache_salt": "resume-test"})
            if previous is not None:  # the whole previous prompt and output, less the last token (dense cache)
                assert r.usage.prompt_tokens_details.cached_tokens >= previous - 1
            previous = r.usage.prompt_tokens + r.usage.completion_tokens
            message = r.choices[0].message
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"{turn} degrees"}]
        status = (await http.get("/status")).json()["recall"]
        assert status["spliced"] >= 2


CALL = '<tool_call>\n{"name": "get_weather", "arguments": '


@pytest.mark.parametrize("before, after, content, calls", [
    (CALL, "}\n</tool_call>", None, ["{}"]),
    ("Let me look.\n" + CALL, "}\n</tool_call>\n" + CALL + '{"city": "x"}}\n</tool_call>', "Let me look.",
     ["{}", '{"city": "x"}']),
    (CALL, "\n</tool_call>", CALL + "{}\n</tool_call>", []),  # the wrapper's brace is missing: content
    ('<tool_call>\n{"arguments": ', ', "name": "add"}\n</tool_call>', None, ["{}"]),  # another key order
    ("Sure", "", "Sure{}", []),
])
async def test_auto_reads_the_calls_a_model_writes_and_a_bad_one_is_content(backend, before, after, content, calls):
    app = build_api(Scripted(backend, before, after), SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        for stream in (False, True):
            if stream:
                async with oai.chat.completions.stream(**ASK) as s:
                    r = await s.get_final_completion()
            else:
                r = await oai.chat.completions.create(**ASK)
            choice = r.choices[0]
            assert choice.message.content == content or (content is None and choice.message.content in (None, ""))
            got = [c.function.arguments for c in choice.message.tool_calls or ()]
            assert got == calls
            assert choice.finish_reason == ("tool_calls" if calls else "stop")
        one = await oai.chat.completions.create(**ASK, parallel_tool_calls=False)
        assert len(one.choices[0].message.tool_calls or ()) == min(1, len(calls))


async def test_stop_strings_end_the_content_but_never_a_call(backend):
    script = Scripted(backend, 'Thinking.\nAction: <tool_call>\n{"name": "get_weather", "arguments": ',
                      '}\n</tool_call>')
    app = build_api(script, SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**ASK, stop=["Action:"])
        assert r.choices[0].message.content == "Thinking.\n" and r.choices[0].finish_reason == "stop"
        r = await oai.chat.completions.create(**ASK, stop=['"name"', "weather"])  # inside the call: not applied
        assert r.choices[0].message.content == "Thinking.\nAction: " and r.choices[0].finish_reason == "tool_calls"


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


@pytest.mark.parametrize("extra, status, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]}, 400,
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 5, "maxLength": 2}}}}}]}, 400, "tools.0.function.parameters"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"tools": _tools(5)}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 7000}}]}, 413, "tools"),
    ({"tools": _tools(1) * 2}, 400, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "unknown": 1}}]}, 400, "tools.0.function"),
    ({"tools": [{"type": "retrieval"}]}, 400, "tools.0.type"),
    ({"tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, 400, "tool_choice"),
    ({"tool_choice": "required", "stop_token_ids": [5]}, 400, "stop_token_ids"),
    ({"tool_choice": "required", "min_tokens": 3}, 400, "min_tokens"),
    ({"parallel_tool_calls": "no"}, 400, "parallel_tool_calls"),
])
async def test_refusals_name_the_field(app, extra, status, param):
    async with client(app) as http:
        r = await http.post("/v1/chat/completions", json={**ASK, **extra}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


async def test_the_sdk_raises_a_bad_request_for_a_missing_function(app):
    async with client(app) as http:
        oai = openai_client(http)
        with pytest.raises(openai.BadRequestError, match="nope"):
            await oai.chat.completions.create(**ASK, tool_choice={"type": "function", "function": {"name": "nope"}})


async def test_strict_auto_writes_the_call_a_model_opens_whole(tmp_path):
    """Qwen's format with its one-token `<tool_call>` (kda-tiny's weights under a synthetic tokenizer); a bias on
    the opener makes the model open a call. Strict: the grammar writes it whole. Not strict: what the model
    writes after it is no call, and comes back as content."""
    from app.api.local import LocalBackend
    from app.engine.config import EngineConfig
    from app.engine.engine import Engine
    from app.models.loader import load_model
    from app.models.tokenizer import Tokenizer
    from loadtest.family_checkpoints import write_family_checkpoint

    d = write_family_checkpoint("qwen3_next", tmp_path)
    local = LocalBackend(Engine(load_model(d), Tokenizer.from_dir(d), EngineConfig(kv_slots=4096)))
    app = build_api(local, SETTINGS)
    try:
        async with client(app) as http:
            oai = openai_client(http)
            ask = {**ASK, "max_tokens": 48, "logit_bias": {str(local.tokenizer.token_id("<tool_call>")): 100},
                   "parallel_tool_calls": False}
            strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
            r = await oai.chat.completions.create(**{**ask, "tools": strict})
            _check_calls(r.choices[0], most=1)
            loose = await oai.chat.completions.create(**ask)
            assert loose.choices[0].message.tool_calls is None
            assert loose.choices[0].message.content.startswith("<tool_call>")
    finally:
        local.engine.shutdown()
