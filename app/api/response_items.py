"""Responses API input (issue 37's groundwork): `input` (a string, or items) and `instructions` as the chat
messages the templates render, so that a response and a chat completion of one conversation render alike.

Items, as OpenAI's Responses API takes them:
- a message: `{"type": "message", "role": ..., "content": ...}` (`type` may be left out), with role user,
  system, developer or assistant and content a string or parts of `input_text` / `output_text`;
- `{"type": "function_call", "call_id", "name", "arguments"}`: the model's call; consecutive ones become one
  assistant message with `tool_calls`, as a chat completion answers them;
- `{"type": "function_call_output", "call_id", "output"}`: a tool result (`role: tool`).

`ItemError` names the path of what is refused (`input.2.type`), for a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


class ItemError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def _text(value, path: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ItemError(path, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate(value):
        if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ItemError(f"{path}.{j}", f"a content part must be one of {', '.join(TEXT_PARTS)} with a text")
        out.append(part["text"])
    return "".join(out)


def _string(item: Mapping, name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ItemError(f"{path}.{name}", "must be a string")
    return value


def to_messages(input_, instructions: str | None = None) -> list[dict]:
    """The chat messages of `instructions` (a system message first) and `input_`."""
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(input_, str):
        return messages + [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ItemError("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(input_):
        path = f"input.{i}"
        if not isinstance(item, Mapping):
            raise ItemError(path, "an item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise ItemError(f"{path}.role", f"must be one of {', '.join(ROLES)}")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{path}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", path), "type": "function",
                    "function": {"name": _string(item, "name", path), "arguments": _string(item, "arguments", path)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", path),
                             "content": _string(item, "output", path)})
        else:
            raise ItemError(f"{path}.type", f"{kind!r} items are not supported by this server")
    return messages
