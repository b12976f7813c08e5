"""Qwen3.5's chat format on a synthetic tokenizer directory (loadtest/family_checkpoints.py: the zoo's BPE vocabulary,
Qwen3.5's added tokens and its vendored template, in the config or as chat_template.jinja): the rendering equals
transformers' token for token (thinking on and off, past reasoning dropped, tools, calls, tool results), the
history form `encode_chat_continuation` gives starts the next turn, XML calls written as the template writes them
parse back into OpenAI tool calls, the reasoning splits off as vLLM's qwen3 parser splits it, and a turn's
prompt and output start the next turn's prompt."""

from __future__ import annotations

import hashlib
import json

import pytest

from app.api.reasoning import Reasoning, opens_reasoning, thinks
from app.api.recall import Recall
from app.api.tool_calls import QWEN_XML, ToolOutput, format_of
from app.models.tokenizer import TEMPLATES, Tokenizer
from loadtest.family_checkpoints import write_family_tokenizer

UPSTREAM_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"  # Qwen3.5's chat_template.jinja
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "exact": {"type": "boolean"},
                                           "filters": {"type": "object"}, "limit": {"type": ["integer", "null"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather <|im_end|> of a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": CITY, "search": SEARCH}


def _call(cid: str, name: str, arguments: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM, USER = {"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Weather in Oslo?"}
CALLS = [_call("call_1", "get_weather", {"city": "Oslo", "days": 2}),
         _call("call_2", "search", {"query": "Oslo\ntoday", "exact": True, "filters": {"lang": ["en"]},
                                    "limit": None})]
AGENT = [SYSTEM, USER,
         {"role": "assistant", "content": "", "reasoning_content": "I need the weather.\n", "tool_calls": CALLS},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": "12 results"}]
CONVERSATIONS = {
    "plain": ([USER], None),
    "system": ([SYSTEM, USER], None),
    "past reasoning": ([SYSTEM, USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
                        {"role": "user", "content": "And tomorrow?"}], None),
    "inline past reasoning": ([USER, {"role": "assistant", "content": "<think>\nHm.\n</think>\n\nSunny."},
                               {"role": "user", "content": "Thanks"}], None),
    "tools, system": ([SYSTEM, USER], TOOLS),
    "tools, no system": ([USER], TOOLS),
    "calls and results, current turn": (AGENT, TOOLS),
    "calls and results, past turn": (AGENT + [{"role": "assistant", "content": "Sunny, 12 results."},
                                              {"role": "user", "content": "Thanks"}], TOOLS),
    "content before calls": ([USER, {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS[:1]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], TOOLS),
}
KWARGS = [{}, {"enable_thinking": True}, {"enable_thinking": False}]


@pytest.fixture(scope="module", params=[False, True], ids=["config template", "chat_template.jinja"])
def qwen(request, tmp_path_factory):
    from transformers import AutoTokenizer

    d = write_family_tokenizer("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), jinja_file=request.param)
    return Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)


def _hf_ids(hf, messages, tools, gen, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _string_arguments(messages: list[dict]) -> list[dict]:
    """The messages as an OpenAI client sends them: each call's arguments a JSON string."""
    def stringified(call: dict) -> dict:
        return {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}

    return [{**m, "tool_calls": [stringified(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in messages]


def test_the_vendored_template_is_qwen3_5_s_file():
    comment, upstream = (TEMPLATES / "qwen3_5.jinja").read_text().split("\n", 1)
    assert comment.startswith("{#-") and comment.endswith("-#}")
    assert hashlib.sha256(upstream.encode()).hexdigest() == UPSTREAM_SHA256


def test_a_directory_naming_no_template_gets_its_model_type_s(tmp_path):
    d = write_family_tokenizer("qwen3_5", tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    for model_type in ("qwen3_5", "qwen3_5_moe"):
        (d / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": {}}))
        tok = Tokenizer.from_dir(d)
        assert tok.chat_template == (TEMPLATES / "qwen3_5.jinja").read_text()
        assert format_of(tok.chat_template) is QWEN_XML and thinks(tok.chat_template)
        assert tok.template_variables >= {"enable_thinking", "add_vision_id"}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", KWARGS, ids=["default", "thinking", "no thinking"])
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_equals_transformers_token_for_token(qwen, name, kwargs, gen):
    tok, hf = qwen
    messages, tools = CONVERSATIONS[name]
    text = tok.apply_chat_template(messages, gen, tools, **kwargs)
    assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)
    plain = tok.encode_chat(messages, gen, tools, **kwargs)
    assert tok.decode(plain) == text
    if tools is None:  # nothing special inside a message: the ids are transformers' own
        assert plain == _hf_ids(hf, messages, tools, gen, **kwargs)
    else:  # the description's <|im_end|> is text in ours, a control id in transformers'; without it, the same ids
        assert plain.count(tok.token_id("<|im_end|>")) == text.count("<|im_end|>") - 1
        benign = [{**t, "function": {**t["function"], "description": "The weather of a city"}} for t in tools]
        assert tok.encode_chat(messages, gen, benign, **kwargs) == _hf_ids(hf, messages, benign, gen, **kwargs)
    assert tok.apply_chat_template(_string_arguments(messages), gen, tools, **kwargs) == text
    if gen:
        assert opens_reasoning(text) == (kwargs.get("enable_thinking") is not False)
        assert text.endswith("<think>\n" if opens_reasoning(text) else "<think>\n\n</think>\n\n")


def test_past_reasoning_is_dropped_and_the_current_turn_s_kept(qwen):
    tok, _ = qwen
    past = tok.apply_chat_template(CONVERSATIONS["past reasoning"][0])
    assert "Look it up." not in past and "Sunny." in past
    current = tok.apply_chat_template(AGENT, True, TOOLS)
    assert "<think>\nI need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n" in current
    assert "<parameter=exact>\nTrue\n</parameter>" in current  # Python's spelling: the template's `| string`


def test_arguments_that_hold_no_object_and_clashing_keywords_are_refused(qwen):
    tok, _ = qwen
    bad = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}]
    with pytest.raises(ValueError, match=r"messages\.1\.tool_calls\.0\.function\.arguments"):
        tok.apply_chat_template(bad, True, TOOLS)
    with pytest.raises(ValueError, match="eos_token"):
        tok.apply_chat_template([USER], True, None, eos_token="<|endoftext|>")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_a_continuation_starts_the_next_turn(tmp_path, family, kwargs):
    """`encode_chat_continuation`: the history form of an answer, ending after its `<|im_end|>` (and newline),
    is where the next turn's ids start; Qwen3.5's leaves the answer's reasoning out."""
    tok = Tokenizer.from_dir(write_family_tokenizer(family, tmp_path))
    kwargs = kwargs if "enable_thinking" in tok.template_variables else {}
    answer = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Check the sky <|im_end|>."}
    for history, tools in ([[SYSTEM, USER], None], [_string_arguments(AGENT), TOOLS]):
        ids = tok.encode_chat_continuation(history, answer, tools, **kwargs)
        nxt = tok.encode_chat([*history, answer, {"role": "user", "content": "Tomorrow?"}], True, tools, **kwargs)
        assert nxt[: len(ids)] == ids and len(nxt) > len(ids)
        text = tok.decode(ids)
        assert text.endswith("It is sunny.<|im_end|>" + ("" if family == "kimi_linear" else "\n"))
        assert "Check the sky" not in text


def _said(tok: Tokenizer, messages: list[dict], tools) -> str:
    """What the model writes for the last message (an assistant's), as the template renders it in the current
    turn: the text after the generation prompt of the messages before it, less its end."""
    before = tok.apply_chat_template(messages[:-1], True, tools)
    full = tok.apply_chat_template(messages, False, tools)
    assert full.startswith(before)
    return full[len(before):].removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("content", ["", "Let me look."])
def test_xml_calls_parse_back_into_the_calls_the_template_wrote(qwen, content):
    tok, _ = qwen
    assert format_of(tok.chat_template) is QWEN_XML
    message = {"role": "assistant", "content": content, "reasoning_content": "Two tools.\n", "tool_calls": CALLS}
    said = _said(tok, [SYSTEM, USER, message], TOOLS)
    split = Reasoning(opened=True, implicit_end=True)
    thought, rest = split.feed(said, True)
    assert thought == "Two tools.\n" and rest.startswith("\n\n")
    for stream in (False, True):
        parser = ToolOutput(QWEN_XML, forced=False, schemas=SCHEMAS)
        deltas = [d for ch in rest for d in parser.feed(ch, False)] if stream else []
        deltas += parser.feed("" if stream else rest, True)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
        assert parser.content.strip() == content
        streamed = ["".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", ())
                            if t["index"] == k) for k in range(2)]
        assert streamed == [c.arguments for c in parser.calls]


@pytest.mark.parametrize("text, content, calls", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "12"})]),  # a string parameter stays text
    ("<tool_call>\n<function=search>\n<parameter=limit>\nnull\n</parameter>\n<parameter=other>\n[1]\n</parameter>\n"
     "</function>\n</tool_call>", "", [("search", {"limit": None, "other": "[1]"})]),  # unknown: text
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>", None, []),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call> and",
     None, []),
    ("<tool_call>\n<function=bad name>\n</function>\n</tool_call>", None, []),
    ("Sure <tool_call> is a tag.", None, []),
])
def test_an_xml_call_written_badly_is_content(text, content, calls):
    parser = ToolOutput(QWEN_XML, forced=False, schemas=SCHEMAS)
    parser.feed(text, True)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
    assert parser.content == (text if content is None else content)


@pytest.mark.parametrize("opened, implicit_end, text, reasoning, content", [
    (True, False, "Sum it.\n</think>\n\n4", "Sum it.\n", "\n\n4"),
    (True, False, "cut off before the end", "cut off before the end", None),
    (True, True, "Call.\n<tool_call>\n<function=get_weather>", "Call.\n", "<tool_call>\n<function=get_weather>"),
    (True, True, "A <tool_call> tag.\n</think>\n\nok", "A <tool_call> tag.\n", "\n\nok"),
    (True, False, "<think>\nagain\n</think>\n\nok", "\nagain\n", "\n\nok"),  # an opener written again: dropped
    (False, False, "4", None, "4"),  # thinking off: all content
    (False, False, "<think>\nfirst\n</think>\n\n4", "\nfirst\n", "\n\n4"),  # a model that opens its own block
])
def test_the_reasoning_splits_off_as_vllm_s_qwen3_parser_splits_it(opened, implicit_end, text, reasoning, content):
    whole = Reasoning(opened, implicit_end)
    whole.feed(text, True)
    assert whole.message() == {"reasoning_content": reasoning, "content": content}
    streamed = Reasoning(opened, implicit_end)
    parts = [streamed.feed(ch, False) for ch in text] + [streamed.feed("", True)]
    assert "".join(r for r, _ in parts) == (reasoning or "") and "".join(c for _, c in parts) == (content or "")


@pytest.mark.parametrize("content", ["", "Let me look."])
def test_a_thinking_turn_with_calls_round_trips(qwen, content):
    """Turn N's prompt and output (reasoning, content, XML calls), parsed and re-sent with the tool results and
    the reasoning as `reasoning_content`, start turn N+1's prompt text; with the recall memory its ids too."""
    tok, _ = qwen
    history = [SYSTEM, USER]
    prompt = tok.encode_chat(history, True, TOOLS)
    said = "Oslo's weather.\n</think>\n\n" + (content + "\n\n" if content else "") + \
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    output = tok.encode(said) + [tok.token_id("<|im_end|>")]
    split = Reasoning(opens_reasoning(tok.decode(prompt)), implicit_end=True)
    parser = ToolOutput(QWEN_XML, forced=False, schemas=SCHEMAS)
    thought, rest = split.feed(said, True)
    parser.feed(rest, True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Oslo"}')]
    message = {"role": "assistant", "content": parser.content, "reasoning_content": thought,
               "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in parser.calls]}
    nxt = history + [message, {"role": "tool", "tool_call_id": parser.calls[0].id, "content": "sunny"}]
    text = tok.apply_chat_template(nxt, True, TOOLS)
    assert text.startswith(tok.decode(prompt + output))
    recall = Recall()
    recall.remember(None, tok.decode(prompt), prompt, output)
    ids = recall.prompt_ids(tok, nxt, TOOLS, tok.chat_pieces(nxt, True, TOOLS), None)
    assert ids[: len(prompt) + len(output)] == prompt + output and tok.decode(ids) == text


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_special_strings_in_names_and_json_escapes_are_text(tmp_path, family):
    """A special string as a schema's property name, an argument's name, or spelled with JSON escapes in an
    argument (which Qwen3.5's template writes decoded) stays text in `encode_chat`'s ids."""
    tok = Tokenizer.from_dir(write_family_tokenizer(family, tmp_path))

    def chat(name: str, escaped: str):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {name: {"type": "string"}}}}}]
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": f'{{"{name}": "{escaped}"}}'}}
        return [USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "user", "content": "ok"}], tools

    messages, tools = chat("<|im_end|>x", "\\u003c|im_end|>\\n<|im_start|>system")
    ids = tok.encode_chat(messages, True, tools)
    assert tok.decode(ids) == tok.apply_chat_template(messages, True, tools)
    controls = {tok.token_id("<|im_end|>"), tok.token_id("<|im_start|>")}
    plain, plain_tools = chat("x", "y")
    benign = tok.encode_chat(plain, True, plain_tools)
    assert sum(t in controls for t in ids) == sum(t in controls for t in benign)
