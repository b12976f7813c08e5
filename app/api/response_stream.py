"""A streamed Responses API answer: chat-style deltas (content, tool-call pieces) as OpenAI's Responses events.

Order, as OpenAI sends them: `response.created`, `response.in_progress`; per output item `output_item.added`,
for a message `content_part.added`, `output_text.delta`s, `output_text.done`, `content_part.done`, for a
function call `function_call_arguments.delta`s and `.done`; `output_item.done`; at the end
`response.completed` (or `response.incomplete` when cut off) with the whole response. Every event carries its
`sequence_number`.
"""

from __future__ import annotations


class ResponseEvents:
    def __init__(self, rid: str, shell: dict) -> None:
        self.rid, self.shell, self.seq = rid, shell, 0
        self.items: list[dict] = []  # output items so far
        self.open: dict | None = None  # the item being written

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        body = {**self.shell, "status": "in_progress", "output": [], "usage": None}
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, deltas: list[dict]) -> list[dict]:
        """Events for chat deltas: {"content": text} or {"tool_calls": [{index, id?, function: {name?, arguments}}]}."""
        out = []
        for delta in deltas:
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._close() + self._open_message()
                self.open["content"][0]["text"] += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=len(self.items), content_index=0, delta=delta["content"]))
            for call in delta.get("tool_calls", ()):
                if call.get("id"):
                    out += self._close()
                    self.open = {"type": "function_call", "id": f"fc_{self.rid[5:]}_{call['index']}",
                                 "call_id": call["id"], "name": call["function"]["name"], "arguments": "",
                                 "status": "in_progress"}
                    out.append(self._event("response.output_item.added", output_index=len(self.items),
                                           item=dict(self.open)))
                piece = call.get("function", {}).get("arguments", "")
                if piece and self.open is not None and self.open["type"] == "function_call":
                    self.open["arguments"] += piece
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                           output_index=len(self.items), delta=piece))
        return out

    def _open_message(self) -> list[dict]:
        self.open = {"type": "message", "id": "msg_" + self.rid[5:], "status": "in_progress", "role": "assistant",
                     "content": [{"type": "output_text", "text": "", "annotations": []}]}
        item = {**self.open, "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=len(self.items), item=item),
                self._event("response.content_part.added", item_id=self.open["id"], output_index=len(self.items),
                            content_index=0, part=part)]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        at, out = len(self.items), []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                part=part)]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                   arguments=item["arguments"]))
        self.items.append(item)
        return out + [self._event("response.output_item.done", output_index=at, item=item)]

    def finish(self, body: dict) -> list[dict]:
        """Close what is open, then the final event with the whole response (`body`, as a non-streamed answer)."""
        out = self._close()
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=body)]
