"""Tool calls in a model's output: each chat template's format, and the parser that turns output text, as it grows,
into OpenAI content and `tool_calls` deltas.

Formats (picked from the chat template's text, `format_of`):
- "qwen" (Qwen3-Next, and the zoo's ChatML): content, then for each call a block
  `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, blocks and content joined by "\\n";
  the server makes the call ids (`call_` and 24 random hex digits: unguessable).
- "kimi" (Kimi-Linear): content, then `<|tool_calls_section_begin|>`, for each call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`; the id is the text between the first two markers, which the template writes back
  into the prompt, so ids follow that format (INDEX counts the conversation's calls).
- "qwen_xml" (Qwen3.5, as Qwen3-Coder: vLLM's and SGLang's `qwen3_coder` parser): content, then for each call
  `<tool_call>\n<function=NAME>\n`, per argument `<parameter=KEY>\nVALUE\n</parameter>\n`, then
  `</function>\n</tool_call>`; calls joined by "\n", after the content and "\n\n"; server-made ids as Qwen's.
  VALUE is raw text with one whitespace character taken off each end (the template's newline, or whichever one
  the forced grammar let stand there); a parameter the function's schema types as a string (or does not know) is
  that text, any other the JSON it holds (Python's True, False and None, which the template writes for booleans
  and null, read as JSON's), else the text. ARGS is the JSON object of them.

"qwen" and "kimi" ARGS are returned verbatim: the templates write a string `arguments` back as it is, so the next
turn's prompt holds the very bytes the model generated. A call whose wrapper is written some other way but still
parses (another key order, other spacing) is accepted, its arguments re-serialised (that turn then does not
round-trip). "qwen_xml" ARGS round-trip where the template writes each value back as the model did (strings,
integers, objects in json.dumps' spacing).

`ToolOutput` reads one choice's text. With forced calls (`tool_choice` required or named) the grammar guarantees
the format, so each call streams as it is generated: the id and name once the wrapper has named the function,
then the arguments in fragments (an XML call's as each parameter closes). Under "auto" the model may write a call
badly, so the calls section is held until the output ends and streamed then if every call parses, else it comes
back as content (never an error).
Stop strings apply to the content only (agent frameworks send them), never inside a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from app.engine.tool_grammar import ToolSpec

NAME = r"[A-Za-z0-9_-]{1,64}"
FRAGMENT_CHARS = 32  # arguments held until the output ended are streamed in fragments of this size


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Piece:
    """One call in an output, as far as it is written: its id and name once the wrapper gave them (a Qwen id is
    the server's), its arguments so far (held back where the wrapper's tail may be starting), and the `Call`
    once it is complete and parses."""

    id: str | None
    name: str | None
    arguments: str
    call: Call | None = None


@dataclass(frozen=True)
class ToolFormat:
    """A chat template's tool-call format: the literals forced calls are made of (`ToolSpec`) and its parser."""

    name: str
    opens: str  # where the calls start in an output
    head: str  # one call's wrapper before its arguments ({name}, {index})
    tail: str  # after its arguments
    prefix: str = ""  # before the first call
    separator: str = ""  # between calls
    suffix: str = ""  # after the last call
    content_sep: str = ""  # between content and the first call
    end: str = "<|im_end|>"
    style: str = "json"  # how the arguments are written (app/engine/tool_grammar.py)

    def spec(self, functions: list[tuple[str, str]], index_base: int, max_calls: int, trigger: str = "",
             before: str = "", free_ends: bool = True) -> ToolSpec:
        """The forced calls' grammar; `before` goes ahead of the first call (a reasoning block's close)."""
        return ToolSpec(functions=tuple(functions), head=self.head, tail=self.tail, prefix=before + self.prefix,
                        separator=self.separator, suffix=self.suffix, end=self.end, index_base=index_base,
                        max_calls=max_calls, trigger=trigger, style=self.style, free_ends=free_ends)

    def calls(self, region: str, final: bool, schemas: dict | None = None) -> tuple[list[Piece], bool]:
        """The calls in `region` (the output from `opens` on), and whether everything in it parses as the
        format (every call complete). `schemas`: each function's parameters schema (an XML call's types)."""
        if self.name == "kimi":
            return _kimi_calls(self, region, final)
        if self.name == "qwen_xml":
            return _xml_calls(region, schemas or {})
        return _qwen_calls(self, region, final)


QWEN = ToolFormat("qwen", opens="<tool_call>", head='<tool_call>\n{"name": "{name}", "arguments": ',
                  tail="}\n</tool_call>", separator="\n", content_sep="\n")
KIMI = ToolFormat("kimi", opens="<|tool_calls_section_begin|>",
                  head="<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
                  tail="<|tool_call_end|>", prefix="<|tool_calls_section_begin|>", suffix="<|tool_calls_section_end|>")
# The XML arguments' grammar writes the whitespace between the tags (one character at most; the template's is a
# newline each), so the call's literals stop at the tags.
QWEN_XML = ToolFormat("qwen_xml", opens="<tool_call>", head="<tool_call>\n<function={name}>",
                      tail="</function>\n</tool_call>", separator="\n", content_sep="\n\n", style="qwen_xml")


def format_of(chat_template: str) -> ToolFormat | None:
    """The tool format a chat template renders, or None if it renders no tool calls."""
    if "<|tool_call_begin|>" in chat_template:
        return KIMI
    if "<tool_call>" in chat_template and "<function=" in chat_template:
        return QWEN_XML
    if "<tool_call>" in chat_template:
        return QWEN
    return None


def _held(text: str, ending: str) -> int:
    """How many characters at the end of `text` may be the start of `ending`."""
    for k in range(min(len(text), len(ending)), 0, -1):
        if ending.startswith(text[-k:]):
            return k
    return 0


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


QWEN_HEAD = re.compile(r'\n\{"name": "(' + NAME + r')", "arguments": ')


def _tagged_calls(region: str, parse):
    """The `<tool_call>` blocks of `region` through `parse(inner, closed) -> Piece | None` (None: not a call) ->
    (pieces, whether the region is calls only, each closed and parsed). An unclosed block ends the scan."""
    out, ok, pos = [], True, 0
    while (i := region.find("<tool_call>", pos)) >= 0:
        ok &= not region[pos:i].strip()
        j = region.find("</tool_call>", i)
        piece = parse(region[i + len("<tool_call>"): j if j >= 0 else len(region)], j >= 0)
        if j < 0:
            out.append(piece)
            return out, False
        ok &= piece is not None
        out.append(piece or Piece(None, None, ""))
        pos = j + len("</tool_call>")
    ok &= not region[pos:].strip() and bool(out)
    return out, ok


def _qwen_calls(fmt: ToolFormat, region: str, final: bool):
    def parse(inner: str, closed: bool) -> Piece | None:
        m = QWEN_HEAD.match(inner)
        raw = inner[m.end():] if m else ""
        if not closed:  # still open (or cut off): the name once the head is written, the arguments so far
            return Piece(None, m[1] if m else None, raw[: len(raw) - _held(raw, fmt.tail)])
        if m and raw.endswith("}\n") and _json_object(raw[:-2]):
            return Piece(None, m[1], raw[:-2], Call("", m[1], raw[:-2]))
        if (call := _lenient(inner)) is not None:
            return Piece(None, call.name, call.arguments, call)
        return None

    return _tagged_calls(region, parse)


def _lenient(inner: str) -> Call | None:
    """A Qwen call written some other way that still parses: a JSON object with a name and object arguments."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not re.fullmatch(NAME, obj["name"]):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str) and _json_object(args):
        return Call("", obj["name"], args)
    return Call("", obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


KIMI_ID = re.compile(r"\s*((?:functions\.)?(" + NAME + r")(?::\d+)?)\s*")


def _kimi_calls(fmt: ToolFormat, region: str, final: bool):
    body = region[len(fmt.prefix):]
    end = body.find(fmt.suffix)
    closed = end >= 0
    body = body[:end] if closed else body
    out, ok, pos = [], True, 0
    while (i := body.find("<|tool_call_begin|>", pos)) >= 0:
        ok &= not body[pos:i].strip()
        a = body.find("<|tool_call_argument_begin|>", i)
        j = body.find("<|tool_call_end|>", i)
        m = KIMI_ID.fullmatch(body[i + len("<|tool_call_begin|>"): a]) if a >= 0 and (j < 0 or a < j) else None
        if j < 0:
            args = body[a + len("<|tool_call_argument_begin|>"):] if m else ""
            args = args[: len(args) - _held(args, fmt.tail)]
            out.append(Piece(m[1] if m else None, m[2] if m else None, args))
            return out, False
        args = body[a + len("<|tool_call_argument_begin|>"): j] if m else ""
        if m and _json_object(args):
            out.append(Piece(m[1], m[2], args, Call(m[1], m[2], args)))
        else:
            ok = False
            out.append(Piece(None, None, ""))
        pos = j + len("<|tool_call_end|>")
    ok &= closed and not body[pos:].strip() and not region[len(fmt.prefix) + end + len(fmt.suffix):].strip()
    return out, ok and bool(out)


XML_FUNCTION = re.compile(r"\s*<function=(" + NAME + r")>")
XML_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]{1,256})>")
PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # what the template writes for JSON's


def _xml_calls(region: str, schemas: dict):
    def parse(inner: str, closed: bool) -> Piece | None:
        m = XML_FUNCTION.match(inner)
        params, rest = _xml_parameters(inner[m.end():], schemas.get(m[1])) if m else ({}, "")
        if not closed:  # still open: the name once written, the parameters closed so far
            return Piece(None, m[1] if m else None, _json_prefix(params) if m else "")
        if m and rest.strip() == "</function>":
            args = _json_prefix(params) + "}"
            return Piece(None, m[1], args, Call("", m[1], args))
        return None

    return _tagged_calls(region, parse)


def _xml_parameters(body: str, schema) -> tuple[dict, str]:
    """The parameters closed in `body` (a call's text after `<function=NAME>`), as values, and the text after."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    params, pos = {}, 0
    while m := XML_PARAMETER.match(body, pos):
        end = body.find("</parameter>", m.end())
        if end < 0:
            break
        raw = body[m.end(): end]
        raw = raw[1:] if raw[:1].isspace() else raw
        raw = raw[:-1] if raw[-1:].isspace() else raw
        params[m[1]] = _xml_value(raw, props.get(m[1]) if isinstance(props, dict) else None)
        pos = end + len("</parameter>")
    return params, body[pos:]


def _xml_value(raw: str, prop) -> object:
    """One parameter's value: its text where the schema types it as a string (or says nothing), else its JSON."""
    types = _types(prop)
    if "null" in types and raw in ("null", "None"):
        return None
    if not types or "string" in types:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return PYTHON_LITERALS.get(raw, raw)


def _types(prop) -> set[str]:
    """The JSON types a property schema allows, as far as it says (type, anyOf/oneOf members, enum values)."""
    if not isinstance(prop, dict):
        return set()
    if "type" in prop:
        t = prop["type"]
        return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    if isinstance(prop.get("anyOf", prop.get("oneOf")), list):
        return set().union(*(_types(p) for p in prop.get("anyOf", prop.get("oneOf"))))
    if isinstance(prop.get("enum"), list):
        return {"string" if isinstance(v, str) else "json" for v in prop["enum"]}
    return {"object"} if "properties" in prop else set()


def _json_prefix(params: dict) -> str:
    """`json.dumps(params)` less its closing brace: what an open call's arguments are known to start with."""
    return json.dumps(params, ensure_ascii=False)[:-1]


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolOutput:
    """One choice's output text, read as it grows (`feed`), as content and tool-call deltas (module docstring).
    `forced`: the grammar writes calls from the first token; `max_calls` 1 keeps the first call only; `schemas`:
    each function's parameters schema, by name (how an XML call's values are typed)."""

    fmt: ToolFormat
    forced: bool
    stops: tuple[str, ...] = ()
    max_calls: int = 1 << 30
    schemas: dict = field(default_factory=dict)
    text: str = ""
    content: str = ""  # sent so far
    stopped: bool = False  # a stop string ended the content
    sent_calls: list[list] = field(default_factory=list)  # per call started: [id, name, arguments sent]
    calls: list[Call] = field(default_factory=list)  # the calls of the answer, once it ended

    def feed(self, delta: str, final: bool) -> list[dict]:
        """Take the next text of the output; -> the chat deltas to send (content and tool-call pieces). Once
        `stopped` or final, the answer is in `content` and `calls`."""
        if self.stopped:
            return []
        self.text += delta
        opens = 0 if self.forced else self.text.find(self.fmt.opens)
        if opens < 0:
            return self._content(self.text, final)
        deltas = self._content(self.text[:opens].removesuffix(self.fmt.content_sep), True)
        if self.stopped:  # a stop string in the content: what follows it is not part of the answer
            return deltas
        parsed, ok = self.fmt.calls(self.text[opens:], final, self.schemas)
        if not self.forced and not final:
            return deltas
        if not self.forced and not ok:  # under auto, a call written badly is content
            return deltas + self._content(self.text, True, keep_stops=False)
        for k, piece in enumerate(parsed[: self.max_calls]):
            deltas += self._call(k, piece, final or piece.call is not None)
        return deltas

    def _content(self, text: str, final: bool, keep_stops: bool = True) -> list[dict]:
        if keep_stops and self.stops:
            hits = [i for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                text, final, self.stopped = text[: min(hits)], True, True
        if not final:
            ends = (self.fmt.content_sep + self.fmt.opens, self.fmt.opens, *self.stops)
            hold = max(_held(text, e) for e in ends)
            text = text[: len(text) - hold]
        if len(text) <= len(self.content) or not text.startswith(self.content):
            return []
        piece, self.content = text[len(self.content):], text
        return [{"content": piece}]

    def _call(self, k: int, piece: Piece, done: bool) -> list[dict]:
        if piece.name is None or k > len(self.sent_calls):
            return []
        out = []
        if k == len(self.sent_calls):
            cid = piece.id or _call_id()  # a Kimi id is the call's own text; a Qwen one the server's
            self.sent_calls.append([cid, piece.name, ""])
            out.append({"tool_calls": [{"index": k, "id": cid, "type": "function",
                                        "function": {"name": piece.name, "arguments": ""}}]})
        sent = self.sent_calls[k]
        args = piece.call.arguments if piece.call is not None else piece.arguments
        if args.startswith(sent[2]) and len(args) > len(sent[2]):
            rest, sent[2] = args[len(sent[2]):], args
            step = len(rest) if self.forced and not done else FRAGMENT_CHARS
            out += [{"tool_calls": [{"index": k, "function": {"arguments": rest[i: i + step]}}]}
                    for i in range(0, len(rest), step)]
        if done and len(self.calls) == k:
            self.calls.append(Call(sent[0], sent[1], sent[2]))
        return out
