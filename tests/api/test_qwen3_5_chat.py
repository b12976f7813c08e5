"""Qwen3.5's chat format served: kda-tiny's weights under the synthetic Qwen3.5 tokenizer
(loadtest/family_checkpoints.py),
through the official `openai` client and raw SSE. The reasoning comes back as `reasoning_content` (streamed or
not, with and without tools), `chat_template_kwargs.enable_thinking` turns it off, forced XML calls follow the
grammar (after the reasoning when the prompt opened it), calls the model writes parse, and an agent's next turn
resumes from the ids of the last one. `Scripted` (tests/api/common.py) makes the engine write a given text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.api.local import LocalBackend
from app.api.routes import ApiSettings, build_api
from app.api.tool_calls import QWEN_XML, ToolOutput
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.grammar import JsonGrammars
from app.engine.tool_grammar import ToolCallState
from app.models.loader import load_model
from app.models.tokenizer import Tokenizer
from loadtest.family_checkpoints import write_family_checkpoint
from tests.api.common import AUTH, KEY, Scripted, client, openai_client, sse_events
from tests.api.test_tools import MESSAGES, SCHEMAS, TOOLS

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=256, max_tools=4)
FUNCTIONS = [(name, json.dumps(schema)) for name, schema in SCHEMAS.items()]
ASK = {"model": "kda-tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 64}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
END_CALL = "\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = write_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    local = LocalBackend(Engine(load_model(d), Tokenizer.from_dir(d), EngineConfig(kv_slots=8192)))
    yield local
    local.engine.shutdown()


def _allowed(state, ids) -> set[int]:
    return set(state.allowed(ids).nonzero().flatten().tolist())


def test_forced_xml_calls_are_the_template_s_ids_and_the_schema_s_values(qwen):
    tok = qwen.tokenizer
    grammars = JsonGrammars(tok, tok.vocab_size)
    state = ToolCallState(grammars.tools(QWEN_XML.spec(FUNCTIONS, 0, 2).to_json()))
    assert _allowed(state, []) == {tok.token_id("<tool_call>")}
    text = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
            "</function>\n</tool_call>")
    ids = tok.encode(text)
    assert ids[-1] == tok.token_id("</tool_call>")  # the tail's added token is its id
    state.sync(ids[:-1])
    assert _allowed(state, ids[:-1]) == {tok.token_id("</tool_call>")}
    head = tok.encode("<tool_call>\n<function=add>\n<parameter=a>\n")
    digits = _allowed(state, head)
    assert tok.encode("7")[0] in digits and tok.encode("x")[0] not in digits  # an integer of the schema
    assert _allowed(state, ids) == {tok.encode("\n<tool_call>")[0], tok.token_id("<|im_end|>")}
    state.sync(ids + tok.encode("<|im_end|>"))
    assert state.terminated
    parsed = ToolOutput(QWEN_XML, forced=True, schemas=SCHEMAS)
    parsed.feed(text, True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", '{"a": 1, "b": 2}')]


def test_a_forced_call_after_reasoning_waits_for_the_block_s_close(qwen):
    from app.api.reasoning import AFTER_THINK, END_THINK

    tok = qwen.tokenizer
    grammars = JsonGrammars(tok, tok.vocab_size)
    spec = QWEN_XML.spec(FUNCTIONS, 0, 1, trigger=END_THINK, before=END_THINK + AFTER_THINK, free_ends=False)
    state = ToolCallState(grammars.tools(spec.to_json()))
    thought = tok.encode("Which tool?\n")
    free = _allowed(state, thought)
    assert tok.token_id("</think>") in free and not free & set(tok.stop_token_ids)  # cannot end in the reasoning
    closed = thought + [tok.token_id("</think>")]
    assert _allowed(state, closed) == {tok.encode(AFTER_THINK + "<tool_call>")[0]}


async def test_reasoning_comes_back_as_reasoning_content(qwen):
    app = build_api(Scripted(qwen, "Oslo is north.\n</think>\n\nIt is ", " degrees."), SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**ASK)
        message = r.choices[0].message
        assert message.reasoning_content == "Oslo is north.\n"
        assert message.content == "\n\nIt is {} degrees." and r.choices[0].finish_reason == "stop"
        body = (await http.post("/v1/chat/completions", json={**ASK, "stream": True}, headers=AUTH)).text
        deltas = [e["choices"][0]["delta"] for e in sse_events(body)[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Oslo is north.\n"
        assert "".join(d.get("content", "") for d in deltas) == "\n\nIt is {} degrees."
        assert not any("</think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


async def test_enable_thinking_false_closes_the_block_in_the_prompt(qwen):
    app = build_api(Scripted(qwen, "It is ", "."), SETTINGS)
    async with client(app) as http:
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        ids = (await http.post("/tokenize", json={"messages": MESSAGES, **off}, headers=AUTH)).json()["tokens"]
        assert qwen.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        on = (await http.post("/tokenize", json={"messages": MESSAGES}, headers=AUTH)).json()["tokens"]
        assert qwen.tokenizer.decode(on).endswith("<|im_start|>assistant\n<think>\n")
        r = await openai_client(http).chat.completions.create(**ASK, extra_body=off)
        assert r.choices[0].message.content == "It is {}." and r.choices[0].message.reasoning_content is None


@pytest.mark.parametrize("kwargs, param", [
    ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"documents": "x"}, "chat_template_kwargs.documents"),
    ({"enable_thinking": [True]}, "chat_template_kwargs"),
    ([True], "chat_template_kwargs"),
])
async def test_bad_chat_template_kwargs_are_refused_by_name(qwen, kwargs, param):
    app = build_api(qwen, SETTINGS)
    async with client(app) as http:
        for path, body in (("/v1/chat/completions", ASK), ("/tokenize", {"messages": MESSAGES})):
            r = await http.post(path, json={**body, "chat_template_kwargs": kwargs}, headers=AUTH)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param


async def test_a_call_the_model_writes_after_its_reasoning_is_read(qwen):
    app = build_api(Scripted(qwen, "Use the tool.\n</think>\n\n" + CALL, END_CALL), SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**ASK, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "Use the tool.\n"
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_weather", '{"city": "{}"}')]
        body = (await http.post("/v1/chat/completions", json={**ASK, "tools": TOOLS, "stream": True},
                                headers=AUTH)).text
        deltas = [e["choices"][0]["delta"] for e in sse_events(body)[:-1] if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Use the tool.\n"
        calls = [t for d in deltas for t in d.get("tool_calls", ())]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(t["function"].get("arguments", "") for t in calls) == '{"city": "{}"}'


async def test_forced_calls_come_after_the_reasoning_and_validate(qwen):
    """`required` on a thinking prompt: free reasoning until `</think>` (a bias makes kda-tiny close it), then
    the calls as the grammar forces them."""
    tok = qwen.tokenizer
    app = build_api(qwen, SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        bias = {str(tok.token_id("</think>")): 100}
        for kwargs in ({"logit_bias": bias}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
            r = await oai.chat.completions.create(**{**ASK, "max_tokens": 120}, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, **kwargs)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_the_next_turn_resumes_from_the_previous_prompt_and_output(qwen):
    """An agent loop in the current turn: the template keeps its reasoning, so re-sent with
    `reasoning_content` the answer renders as it was generated and the recall memory splices its ids."""
    app = build_api(Scripted(qwen, "Look it up.\n</think>\n\n" + CALL, END_CALL), SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        messages, previous = list(MESSAGES), None
        for turn in range(3):
            r = await oai.chat.completions.create(**{**ASK, "messages": messages}, tools=TOOLS,
                                                  extra_body={"cache_salt": "qwen3.5-resume"})
            if previous is not None:
                assert r.usage.prompt_tokens_details.cached_tokens >= previous - 1
            previous = r.usage.prompt_tokens + r.usage.completion_tokens
            message = r.choices[0].message
            assert message.reasoning_content == "Look it up.\n" and message.tool_calls
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"{turn} degrees"}]
        assert (await http.get("/status")).json()["recall"]["spliced"] >= 2


async def test_forced_outputs_sampled_at_temperature_one_parse_and_validate(qwen):
    app = build_api(qwen, SETTINGS)
    async with client(app) as http:
        r = await openai_client(http).chat.completions.create(
            **{**ASK, "temperature": 1.0, "max_tokens": 160}, tools=TOOLS, tool_choice="required", n=3, seed=5,
            parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        stopped = [c for c in r.choices if c.finish_reason == "tool_calls"]
        assert len(stopped) >= 2 and all(c.finish_reason in ("tool_calls", "length") for c in r.choices)
        for choice in stopped:
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
