"""Forced tool calls (app/engine/tool_grammar.py): the literal wrapper is the tokenizer's ids of the template's
bytes (special tokens as their ids), the arguments follow each function's schema, and the engine generating at
temperature 1 beside plain requests, with n > 1, ends every forced output that says "stop" in calls that parse
and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.api.tool_calls import KIMI, QWEN, ToolOutput
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.grammar import JsonGrammars, for_tokenizer
from app.engine.request import SamplingParams
from app.engine.tool_grammar import ToolCallState
from app.models.tokenizer import Tokenizer
from loadtest.family_checkpoints import write_family_tokenizer
from tests.helpers import load_zoo

CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
FUNCTIONS = [("get_weather", json.dumps(CITY)), ("add", json.dumps(ADD))]
SCHEMAS = {"get_weather": CITY, "add": ADD}


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def _allowed(state, ids) -> set[int]:
    return set(state.allowed(ids).nonzero().flatten().tolist())


def test_the_wrapper_is_forced_in_the_template_s_ids_and_the_arguments_follow_the_schema(tmp_path):
    tok = Tokenizer.from_dir(write_family_tokenizer("kimi_linear", tmp_path))
    grammars = JsonGrammars(tok, tok.vocab_size)
    spec = KIMI.spec(FUNCTIONS, 3, 2).to_json()
    state = ToolCallState(grammars.tools(spec))
    assert _allowed(state, []) == {tok.token_id("<|tool_calls_section_begin|>")}
    head = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.")
    assert _allowed(state, head) == {tok.encode("functions.get")[-1], tok.encode("functions.add")[-1]}
    ids = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.add:3<|tool_call_argument_begin|>")
    assert tok.token_id("<|tool_call_argument_begin|>") in ids  # a special token is its id, never spelled out
    inside = _allowed(state, ids)
    assert inside and tok.encode("{")[0] in inside and not inside & set(tok.stop_token_ids)
    ids += tok.encode('{"a":1,"b":-2}')
    end = tok.encode("<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    after = _allowed(state, ids)  # the object closed: another call (index 4) or the end
    assert after == {tok.token_id("<|tool_call_end|>")}
    ids.append(tok.token_id("<|tool_call_end|>"))
    assert _allowed(state, ids) == {tok.token_id("<|tool_calls_section_end|>"), tok.token_id("<|tool_call_begin|>")}
    ids += tok.encode("<|tool_call_begin|>functions.get_weather:")
    assert _allowed(state, ids) == {tok.encode(":4")[-1]}
    state.sync(ids[:3])  # back into the first call's name
    assert _allowed(state, ids[:3]) == _allowed(ToolCallState(grammars.tools(spec)), ids[:3])
    full = tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.add:3<|tool_call_argument_begin|>"
                      '{"a":1,"b":-2}') + end
    state.sync(full)
    assert state.terminated
    parsed = ToolOutput(KIMI, forced=True)
    parsed.feed(tok.decode(full[:-1]), True)
    assert [(c.id, c.name, c.arguments) for c in parsed.calls] == [("functions.add:3", "add", '{"a":1,"b":-2}')]


def test_an_out_of_grammar_token_and_a_bad_spec_are_refused(zoo):
    _, tok = zoo
    grammars = for_tokenizer(tok)
    state = ToolCallState(grammars.tools(QWEN.spec(FUNCTIONS, 0, 1).to_json()))
    with pytest.raises(ValueError, match="outside"):
        state.sync(tok.encode("hello"))
    with pytest.raises(ValueError, match="end token"):
        grammars.tools(QWEN.spec(FUNCTIONS, 0, 1).__class__(functions=tuple(FUNCTIONS), head="{name}", tail="",
                                                              end="x").to_json())
    with pytest.raises(ValueError, match="cannot be compiled"):
        grammars.tools(QWEN.spec([("f", '{"type": "frobnicate"}')], 0, 1).to_json())


@pytest.mark.parametrize("functions, max_calls", [(FUNCTIONS, 2), (FUNCTIONS[1:], 1)])
def test_forced_outputs_parse_and_validate_beside_plain_requests(zoo, functions, max_calls):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(kv_slots=8192, checkpoint_budget_mb=8, max_running=6))
    prompt = tok.encode_chat([{"role": "user", "content": "Weather in Oslo, and 2+3?"}])
    spec = QWEN.spec(functions, 0, max_calls).to_json()
    requests = [SamplingParams(max_tokens=160, temperature=1.0, seed=10 * s, n=2, guided_tools=spec) for s in range(3)]
    requests.append(SamplingParams(max_tokens=24, temperature=1.0, seed=9))  # a plain request in the same steps
    ids = [engine.add_request(prompt, p) for p in requests]
    final = {}
    while engine.has_unfinished():
        final.update({(o.request_id, o.index): o for o in engine.step() if o.finished})
    stopped = 0
    for rid in ids[:3]:
        for out in (final[(rid, 0)], final[(rid, 1)]):
            if out.finish_reason != "stop":
                assert out.finish_reason == "length"
                continue
            stopped += 1
            assert out.output_ids[-1] == tok.token_id("<|im_end|>")
            parsed = ToolOutput(QWEN, forced=True)
            parsed.feed(out.text, True)
            assert 1 <= len(parsed.calls) <= max_calls
            for call in parsed.calls:
                assert call.name in dict(functions)
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert stopped >= 3


@pytest.mark.parametrize("family, fmt", [("qwen3_next", QWEN), ("kimi_linear", KIMI)])
def test_a_trigger_leaves_text_free_until_the_model_opens_a_call(tmp_path, family, fmt):
    """Strict tools under auto: any text (the end token included) until the output's ids end with the opener's;
    from there the call is forced as without a trigger."""
    tok = Tokenizer.from_dir(write_family_tokenizer(family, tmp_path))
    grammars = JsonGrammars(tok, tok.vocab_size)
    spec = fmt.spec(FUNCTIONS, 0, 1, trigger=fmt.opens).to_json()
    state = ToolCallState(grammars.tools(spec))
    text = tok.encode("Let me check.\n")
    assert state.allowed(text).all()
    opened = text + tok.encode(fmt.opens)
    forced = ToolCallState(grammars.tools(fmt.spec(FUNCTIONS, 0, 1).to_json()))
    literal = tok.encode(fmt.opens)
    assert _allowed(state, opened) == _allowed(forced, literal)  # the call goes on as a forced one
    call = (tok.encode(fmt.prefix + fmt.spec(FUNCTIONS, 0, 1).head_of("add", 0)) + tok.encode('{"a":1,"b":2}') +
            tok.encode(fmt.tail + fmt.suffix + fmt.end))  # each piece as the grammar writes it
    state.sync(text + call)
    assert state.terminated
    state.sync(text)  # back before the opener: free again
    assert state.allowed(text).all() and not state.terminated
