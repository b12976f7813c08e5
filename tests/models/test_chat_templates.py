"""The vendored chat templates (Qwen3-Next's, Kimi-Linear's; the zoo uses Qwen3-Next's) against transformers'
rendering on synthetic tokenizers with each family's special tokens, and the round trip every agent turn needs:
the prompt of turn N+1 starts with turn N's prompt and the output that made its tool calls. Qwen3.5's template
(thinking, XML calls) has its own tests: tests/models/test_qwen3_5_chat.py."""

from __future__ import annotations

import json

import pytest

from app.api.recall import Recall
from app.api.tool_calls import KIMI, QWEN, ToolOutput, format_of
from app.models.loader import ZOO_DIR
from app.models.tokenizer import TEMPLATES, Tokenizer
from loadtest.family_checkpoints import FAMILIES, write_family_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather <|im_end|> of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _call(cid: str, name: str, arguments: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


CHAT = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris and 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("functions.get_weather:0", "get_weather",
                                                              '{"city": "Paris"}'),
                                                        _call("functions.add:1", "add", '{"a":2,"b":3}')]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "functions.add:1", "content": "5"},
    {"role": "assistant", "content": "Sunny; 5.", "tool_calls": [_call("functions.add:2", "add", '{"a":5}')]},
    {"role": "tool", "tool_call_id": "functions.add:2", "content": "5"},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": "Thanks <|im_start|>"},
]


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - {"qwen3_5"}))
def family(request, tmp_path_factory):
    from transformers import AutoTokenizer

    d = write_family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("gen", [True, False])
def test_templates_render_as_transformers_renders_them(family, tools, gen):
    _, tok, hf = family
    for n in range(1, len(CHAT) + 1):
        chat = CHAT[:n]
        ours = tok.apply_chat_template(chat, gen, tools)
        assert ours == hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert "<|im_end|>" in ours  # and the special strings inside messages and tools are plain text in the ids:
    plain = tok.encode_chat(CHAT, gen, tools)
    assert tok.decode(plain) == ours
    assert plain.count(tok.token_id("<|im_end|>")) == ours.count("<|im_end|>") - bool(tools)  # the description's


def test_the_zoo_renders_qwen3_next_s_format():
    zoo = Tokenizer.from_dir(ZOO_DIR / "kda-tiny")
    assert zoo.chat_template == (TEMPLATES / "qwen3_next.jinja").read_text()
    assert format_of(zoo.chat_template) is QWEN
    assert zoo.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n" \
                                                                          "<|im_start|>assistant\n"


def _output_text(fmt, content: str, calls: list[tuple[str, str]], base: int) -> str:
    """What the model writes for `calls` (name, arguments) after `content`, as the format's template renders it."""
    text = content + (fmt.content_sep if content else "") + fmt.prefix
    for k, (name, args) in enumerate(calls):
        text += (fmt.tail + fmt.separator if k else "") + fmt.spec([], base, 1).head_of(name, base + k) + args
    return text + fmt.tail + fmt.suffix


@pytest.mark.parametrize("content", ["", "Let me look."])
def test_a_turn_with_calls_round_trips(family, content):
    """The output of a turn that calls tools, parsed into OpenAI tool_calls and re-sent with the tool results,
    renders to a prompt whose text starts with the previous prompt and output; with the recall memory its ids
    start with the very ids."""
    _, tok, _ = family
    fmt = format_of(tok.chat_template)
    history = CHAT[:2]
    prompt = tok.encode_chat(history, True, TOOLS)
    calls = [("get_weather", '{"city":"Oslo"}'), ("add", '{"a": 1, "b": [2, {"c": "x}"}]}')]
    said = _output_text(fmt, content, calls, 0)
    output = tok.encode(said) + [tok.token_id("<|im_end|>")]
    parser = ToolOutput(fmt, forced=not content)
    deltas = [d for ch in said for d in parser.feed(ch, False)] + parser.feed("", True)
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    assert parser.content == content
    assert "".join(d.get("content", "") for d in deltas) == content
    streamed = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", ()))
    assert streamed == "".join(a for _, a in calls)
    if fmt is KIMI:
        assert [c.id for c in parser.calls] == ["functions.get_weather:0", "functions.add:1"]
    message = {"role": "assistant", "content": parser.content or None,
               "tool_calls": [_call(c.id, c.name, c.arguments) for c in parser.calls]}
    nxt = history + [message] + [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in parser.calls]
    text = tok.apply_chat_template(nxt, True, TOOLS)
    assert text.startswith(tok.decode(prompt + output))
    recall = Recall()
    recall.remember(None, tok.decode(prompt), prompt, output)
    pieces = tok.chat_pieces([dict(m) for m in nxt], True, TOOLS)
    ids = recall.prompt_ids(tok, nxt, TOOLS, pieces, None)
    assert ids[: len(prompt) + len(output)] == prompt + output and tok.decode(ids) == text
    assert recall.prompt_ids(tok, nxt, TOOLS, pieces, "another tenant") is None


def test_tool_json_is_rendered_as_transformers_dumps_it(family):
    _, tok, _ = family
    text = tok.apply_chat_template(CHAT[:2], True, TOOLS)
    compact = json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False)
    assert compact in text if format_of(tok.chat_template) is KIMI else json.dumps(TOOLS[0]) in text
