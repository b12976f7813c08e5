"""Byte-level BPE tokenizer: the serving-side wrapper (training it: `app.training.tokenizer`).

Files in a tokenizer directory (what `transformers.AutoTokenizer.from_pretrained` reads):
    tokenizer.json           the `tokenizers` model: digits split one by one, then GPT-2 ByteLevel
    tokenizer_config.json    special tokens, the `chat_template` (templates/qwen3_next.jinja: ChatML turns, Qwen-style
                             tools), `clean_up_tokenization_spaces: false`
    special_tokens_map.json  bos/eos/pad and the two chat markers
    chat_template.jinja      a checkpoint's template as newer hub repositories ship it (wins over the config's)

Chat templates (templates/, picked by config.json's model_type when the directory names none):
    model_type                       template             tool calls                  thinking
    qwen3_next (and the zoo)         qwen3_next.jinja     `<tool_call>` JSON blocks   none
    kimi_linear                      kimi_linear.jinja    Kimi's tool-call sections   none
    qwen3_5, qwen3_5_moe (+ _text)   qwen3_5.jinja        Qwen3-Coder XML calls       `<think>` opened in the prompt
A template's own variables beyond messages, tools and add_generation_prompt (Qwen3.5's `enable_thinking`) are
`template_kwargs`, as transformers' `apply_chat_template(**kwargs)` passes them. A template that iterates a call's
`arguments` (`arguments|items`: Qwen3.5's, Qwen3-Coder's) gets a JSON-string `arguments` as the object it holds, as
vLLM and SGLang hand it over; the others get the string, which they write back verbatim.

Special ids: 0 `<|endoftext|>` (bos, eos and pad for plain completion), 1 `<|im_start|>`, 2 `<|im_end|>`.
No normalizer and no added bos/eos, so `decode(encode(s)) == s` for every string `s`.
`encode` turns special-token strings in its text into their ids (a raw completion prompt may format its own
chat); `encode_chat` gives control ids only where the chat template itself writes them, so a message cannot
forge a turn by containing `<|im_end|>`.
The wrapper imports `tokenizers` and `jinja2` only, never `transformers`.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as Backend

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)
TEMPLATES = Path(__file__).parent / "templates"
# The zoo's chat format: Qwen3-Next's (ChatML turns, and a Qwen-style tools section when tools are given); it is
# also the template of a tokenizer directory that names none and whose model_type has no template of its own.
CHAT_TEMPLATE = (TEMPLATES / "qwen3_next.jinja").read_text()
FAMILY_TEMPLATES = {"kimi_linear": "kimi_linear.jinja",
                    **{t: "qwen3_5.jinja" for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")}}
RENDER_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token"})
OBJECT_ARGUMENTS = re.compile(r"arguments\s*\|\s*items")


class Tokenizer:
    """Encode, decode and chat-format text with a trained tokenizer directory (see module docstring)."""

    def __init__(self, backend: Backend, config: Mapping[str, object], chat_template: str) -> None:
        self._backend = backend
        self.config = dict(config)
        self.chat_template = chat_template
        self._template = _compile_template(chat_template)
        self.template_variables = _template_variables(chat_template)
        self._object_arguments = bool(OBJECT_ARGUMENTS.search(chat_template))
        self.eos_token_id = self._config_token("eos_token")
        if self.eos_token_id is None:
            raise ValueError("tokenizer_config.json names no eos_token")
        self.bos_token_id = self._config_token("bos_token")  # None where the model has none (Qwen)
        self.pad_token_id = self._config_token("pad_token")
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # Generation ends at the eos token, end-of-text or the end of a chat turn (those the vocabulary has).
        ends = (self.eos_token_id, backend.token_to_id(EOT), backend.token_to_id(IM_END))
        self.stop_token_ids = tuple(dict.fromkeys(t for t in ends if t is not None))
        added = backend.get_added_tokens_decoder()
        self.added_token_ids = frozenset(added)  # special or not (Qwen's `<tool_call>` is not)
        self._special_ids = frozenset({i for i, t in added.items() if t.special} |
                                      {i for i in map(backend.token_to_id, SPECIAL_TOKENS) if i is not None})
        self._bytes = _token_bytes(backend, frozenset(added))
        self._special_text = {t.content: i for i, t in added.items() if t.special}
        self._special_of = {i: t for t, i in self._special_text.items()}
        self._plain = Backend.from_str(backend.to_str())  # the same vocabulary, special strings read as text
        self._plain.encode_special_tokens = True

    def _config_token(self, key: str) -> int | None:
        """The id of a special token named in tokenizer_config.json (a string or an AddedToken dict), or None."""
        value = self.config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        return None if value is None else self.token_id(str(value))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` (a `chat_template.jinja` file wins; with neither naming
        a template, the model family's from templates/)."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: dasc-serve reads `tokenizers` JSON tokenizers "
                                    "(a tiktoken or sentencepiece tokenizer needs converting with transformers first)")
        config = json.loads((path / "tokenizer_config.json").read_text())
        jinja_file = path / "chat_template.jinja"
        template = (jinja_file.read_text() if jinja_file.exists() else
                    config.get("chat_template") or _family_template(path))
        return cls(Backend.from_file(str(path / "tokenizer.json")), config, template)

    def token_id(self, token: str) -> int:
        """The id of one vocabulary entry; KeyError if absent."""
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise KeyError(token)
        return token_id

    def vocab(self) -> list[str]:
        """Every token string of the vocabulary (byte-level forms, special tokens included)."""
        return list(self._backend.get_vocab(with_added_tokens=True))

    def token_string(self, token_id: int) -> str:
        """The vocabulary entry of one id, in its byte-level form (unique per id)."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Ids for `text`; special-token strings in it become their ids, nothing is added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts, in parallel threads."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The raw bytes one id stands for (a special token: its UTF-8 text, or b"" when skipped)."""
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        return self._bytes[token_id]

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None, **template_kwargs: object) -> str:
        """Render `messages` (OpenAI-shaped dicts: role, content, reasoning_content, tool_calls, tool_call_id) and
        `tools` exactly as transformers renders the template; `template_kwargs` are the template's own variables
        (module docstring). ValueError for a call's `arguments` that is not a JSON object where the template needs
        one, and for a keyword that is a rendering argument itself."""
        if clash := RENDER_ARGS & set(template_kwargs):
            raise ValueError(f"{sorted(clash)[0]} is not a template keyword")
        specials = {k: self.config[k] for k in ("bos_token", "eos_token", "pad_token") if k in self.config}
        return self._template.render(messages=self._chat(messages), tools=list(tools) if tools else None,
                                     add_generation_prompt=add_generation_prompt, **specials, **template_kwargs)

    def _chat(self, messages: Sequence[Mapping[str, object]]) -> list[dict]:
        """The messages as the template takes them (JSON-string arguments as objects where it iterates them)."""
        if not self._object_arguments:
            return [dict(m) for m in messages]
        return [_object_arguments(dict(m), i) for i, m in enumerate(messages)]

    def encode_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, object]] | None = None, **template_kwargs: object) -> list[int]:
        """Ids of the rendered chat where only the template's own special tokens are control ids; a special-token
        string inside a message or a tool (content, arguments, a description, ...) is encoded as plain text."""
        return self.encode_pieces(self.chat_pieces(messages, add_generation_prompt, tools, **template_kwargs))

    def encode_chat_continuation(self, messages: Sequence[Mapping[str, object]],
                                 assistant_message: Mapping[str, object],
                                 tools: Sequence[Mapping[str, object]] | None = None,
                                 **template_kwargs: object) -> list[int]:
        """The ids of `messages + [assistant_message]` as the next turn re-sends them: the assistant turn in the
        form the template gives it then (Qwen3.5's drops the reasoning of a turn a user message follows), up to and
        including the `<|im_end|>` that closes it and the whitespace the template writes after it. These ids start
        the `encode_chat` of the conversation with any user message after it or, when the assistant message holds
        tool calls, with the tool results after it.

        How: the conversation is rendered with a probe message after the answer (a user message, or the first
        call's tool result; no generation prompt), and cut where the text between the answer's `<|im_end|>` and
        the probe's turn ends; ValueError if the template closes the answer with no `<|im_end|>`."""
        probe = _unused_char(list(_strings([messages, assistant_message, tools])))
        calls = assistant_message.get("tool_calls") or ()
        after = {"role": "tool", "tool_call_id": calls[0].get("id", ""), "content": probe} if calls else \
            {"role": "user", "content": probe}
        pieces = self.chat_pieces([*messages, assistant_message, after], False, tools, **template_kwargs)
        at = next(i for i, p in enumerate(pieces) if isinstance(p, str) and probe in p)
        end = self._backend.token_to_id(IM_END)
        closes = [i for i in range(at) if pieces[i] == end]
        if not closes:
            raise ValueError("the chat template closes the assistant turn without <|im_end|>")
        cut = closes[-1] + 1
        after = pieces[cut] if cut < at and isinstance(pieces[cut], str) else ""
        gap = after[: len(after) - len(after.lstrip())]
        return self.encode_pieces([*pieces[:cut], *([gap] if gap else [])])

    def chat_pieces(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, object]] | None = None,
                    **template_kwargs: object) -> list[str | int]:
        """The rendered chat as pieces: the ids of the template's own special tokens, and the text between them.

        How: each special-token string inside any string of the messages and tools (keys included) is broken by a marker
        character that occurs in none of them (a private-use code point), the template is rendered, the result
        is split at the special tokens left (the template's), and the markers are removed from the text between.
        Joined (ids as their strings) the pieces are `apply_chat_template`'s text."""
        if not self._special_text:
            return [self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)]
        messages = self._chat(messages)  # arguments parsed first, so that what their JSON escapes spells is marked
        marker = _unused_char(list(_strings([messages, tools])))
        special = re.compile("(" + "|".join(map(re.escape, sorted(self._special_text, key=len, reverse=True))) + ")")

        def escape(text: str) -> str:
            return special.sub(lambda s: s[0][0] + marker + s[0][1:], text)

        rendered = self.apply_chat_template(_map_strings(messages, escape), add_generation_prompt,
                                            _map_strings(tools, escape) if tools else None, **template_kwargs)
        pieces: list[str | int] = []
        for i, piece in enumerate(special.split(rendered)):
            if i % 2:  # split() puts each separator (a template's special token) at an odd index
                pieces.append(self._special_text[piece])
            elif piece:
                pieces.append(piece.replace(marker, ""))
        return pieces

    def piece_text(self, piece: str | int) -> str:
        """The text of one of `chat_pieces`' pieces."""
        return piece if isinstance(piece, str) else self._special_of[piece]

    def encode_pieces(self, pieces: Iterable[str | int]) -> list[int]:
        """Ids of `chat_pieces`: special ids as they are, text read with special strings as plain text. For text
        without special strings the ids equal `encode`'s, which also splits at special tokens first."""
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend((self._plain if self._special_text else self._backend).encode(
                    piece, add_special_tokens=False).ids)
        return ids

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A fresh streaming decoder over this vocabulary."""
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns ids arriving one or a few at a time into text deltas for streaming.

    Bytes of a character split across tokens are held back until the character is complete, so no
    delta ends in half a character. Invariant: the concatenation of all deltas plus `flush()` equals
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        """Feed new ids; returns the text they complete (possibly "")."""
        if isinstance(ids, int):  # one token a step: no list, no join
            return self._utf8.decode(self._tokenizer.token_bytes(ids, self._skip))
        data = b"".join(self._tokenizer.token_bytes(i, self._skip) for i in ids)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """End of stream: an incomplete trailing character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def decode_stream(tokenizer: Tokenizer, ids: Iterable[int], skip_special_tokens: bool = False) -> Iterator[str]:
    """Yield the non-empty text delta of each id in `ids` (and a final flush if any)."""
    decoder = tokenizer.incremental_decoder(skip_special_tokens)
    for token_id in ids:
        if delta := decoder.push(token_id):
            yield delta
    if tail := decoder.flush():
        yield tail


def _family_template(path: Path) -> str:
    """The template of a tokenizer directory that names none: its model family's (config.json's model_type)."""
    model = path / "config.json"
    family = json.loads(model.read_text()).get("model_type") if model.exists() else None
    return (TEMPLATES / FAMILY_TEMPLATES[family]).read_text() if family in FAMILY_TEMPLATES else CHAT_TEMPLATE


def _object_arguments(message: dict, index: int) -> dict:
    """`message` with each call's JSON-string `arguments` as the object it holds ("" as {}), for templates that
    iterate them; ValueError naming the call when it holds no object."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        args = fn.get("arguments") if isinstance(fn, Mapping) else None
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ValueError(f"messages.{index}.tool_calls.{j}.function.arguments: not a JSON object, which "
                                 "this chat template needs")
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return {**message, "tool_calls": out}


def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads and never sets itself (messages, tools, enable_thinking, ...); its
    functions (raise_exception) left out."""
    import jinja2.meta

    tree = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    stored = {n.name for n in tree.find_all(jinja2.nodes.Name) if n.ctx in ("store", "param")}
    return frozenset(jinja2.meta.find_undeclared_variables(tree) - stored - {"raise_exception"})


def _strings(x: object) -> Iterator[str]:
    """Every string inside nested dicts and lists (keys too)."""
    if isinstance(x, str):
        yield x
    elif isinstance(x, Mapping):
        for k, v in x.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _strings(v)


def _map_strings(x, f):
    """`x` with `f` applied to every string inside nested dicts and lists, keys too (templates render some: a
    schema's property names, Qwen3.5's argument names)."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, Mapping):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_map_strings(v, f) for v in x]
    return x


def _unused_char(texts: Sequence[str]) -> str:
    """A private-use code point that occurs in none of `texts` (ValueError in the absurd case that all do)."""
    used = set().union(*map(set, texts)) if texts else set()
    for code in (*range(0xE000, 0xF900), *range(0xF0000, 0xFFFFE)):
        if chr(code) not in used:
            return chr(code)
    raise ValueError("the messages use every private-use character; cannot mark their special-token strings")


def _compile_template(template: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim/lstrip blocks, loop controls, raise_exception, tojson."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _token_bytes(backend: Backend, added_ids: frozenset[int]) -> list[bytes]:
    """Per-id raw bytes: ByteLevel tokens map each char back to one byte (GPT-2's table); added tokens are
    their UTF-8 text; ids the vocabulary skips are empty."""
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    table = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id)
        if token is None:
            table.append(b"")
        elif token_id in added_ids:
            table.append(token.encode())
        else:
            table.append(bytes(byte_of[c] for c in token))
    return table


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code_points = list(byte_values)  # printable bytes stand for themselves
    shifted = [b for b in range(256) if b not in byte_values]  # the rest map to chr(256), chr(257), ...
    byte_values += shifted
    code_points += range(256, 256 + len(shifted))
    return {b: chr(c) for b, c in zip(byte_values, code_points)}
