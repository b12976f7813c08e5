"""`POST /v1/responses` (streamed as OpenAI's events, app/api/response_stream.py, or not), `GET` and
`DELETE /v1/responses/{id}`: OpenAI's Responses API over the chat machinery.

A request's `input` and `instructions` become chat messages (app/api/response_items.py) and its function tools
chat tools, so a response renders, calls tools and round-trips exactly as a chat completion does. A stored
response (`store`, default true; app/api/response_store.py) keeps the conversation's exact ids: a continuation
by `previous_response_id` starts with them, the new items rendered after them by the template, and inherits the
stored `cache_salt`, so it resumes from that response's generation-end checkpoint with nothing re-tokenized.
If the text does not line up (a template that rewrites earlier turns), the prompt is encoded afresh: slower,
never an error. A response is visible only to the API key that made it (with no key configured, the id is the
capability); another key, an unknown, expired or deleted id are all the same 404.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError

from app.api import limits, tool_answers, tools
from app.api.answers import collect, first_output, sse
from app.api.errors import REQUEST_ID, ApiError, openapi_responses
from app.api.hints import RouteHint
from app.api.recall import continue_ids
from app.api.response_items import ItemError, to_messages
from app.api.response_store import (
    LocalResponses,
    Responses,
    ResponseStore,
    StoredResponse,
    TimedResponses,
    key_digest,
)
from app.api.response_stream import ResponseEvents
from app.api.schemas import FORBID, TOP_LEVEL, ChatCompletionRequest, FunctionName, Text, now, register_fields

RESPONSES = openapi_responses(400, 401, 404, 413, 429, 500, 503)


class ResponseTool(BaseModel):
    """A Responses function tool (flat, unlike chat's). Built-in tools (web search, file search, ...) are
    refused by their type."""

    model_config = FORBID

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedResponseTool(BaseModel):
    model_config = FORBID

    type: Literal["function"]
    name: Text


class TextFormat(BaseModel):
    model_config = FORBID

    type: Literal["text"]


class TextOptions(BaseModel):
    model_config = FORBID

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = TOP_LEVEL  # undeclared fields (include, reasoning, ...) are refused by name

    model: Text | None = None
    input: Text | list[dict]
    instructions: Text | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedResponseTool | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    truncation: Literal["disabled"] | None = None
    text: TextOptions | None = None
    cache_salt: Text | None = None
    metadata: dict | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None

    def chat(self, messages: list[dict], salt: str | None) -> ChatCompletionRequest:
        """The chat completion this response is made as."""
        choice = self.tool_choice
        if isinstance(choice, NamedResponseTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        chat_tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                      for t in self.tools or ()]
        try:
            return ChatCompletionRequest.model_validate({
                "model": self.model, "messages": messages, "tools": chat_tools or None, "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls, "max_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "cache_salt": salt})
        except ValidationError as e:
            raise limits.from_validation(e.errors()) from e


register_fields(ResponsesRequest, ResponseTool, NamedResponseTool, TextOptions, TextFormat)


def register(app: FastAPI, backend, settings, recall, routes) -> Responses:
    """Add the Responses routes to `app`; `routes` holds app.api.routes' `_validate` and `_start`. The store is the
    backend's `responses` where it has one (Serve's: a named actor), else one in this process."""
    store = getattr(backend, "responses", None) or LocalResponses(ResponseStore(
        settings.max_stored_responses, settings.max_stored_response_bytes, settings.stored_response_age_s))
    metrics = getattr(backend, "metrics", None)
    if metrics is not None:
        store = TimedResponses(store, metrics.response_store)
    tok = backend.tokenizer

    @app.post("/v1/responses", responses=RESPONSES)
    async def create(body: ResponsesRequest, request: Request):
        limits.check_request(body, settings)
        owner = key_digest(_key_of(request, settings))
        previous = None
        if body.previous_response_id is not None:
            previous = await store.get(body.previous_response_id, owner)
            if previous is None:
                raise ApiError(404, f"no response {body.previous_response_id!r}", param="previous_response_id",
                               code="not_found")
        try:
            new = to_messages(body.input, body.instructions)
        except ItemError as e:
            raise ApiError(400, str(e), param=e.path) from e
        messages = (previous.messages if previous else []) + new
        salt = previous.cache_salt if previous else body.cache_salt
        chat = body.chat(messages, salt)
        plan = await tools.plan(chat, tok, settings)
        prompt, continued = _prompt(chat, plan, previous, tok, settings, recall)
        hint = RouteHint(body.prompt_cache_key)
        if continued:  # the prompt starts with the stored ids: where they were served, their checkpoint is
            hint = RouteHint(body.prompt_cache_key, previous.replica, len(previous.prompt_ids),
                             len(previous.prompt_ids) + len(previous.output_ids), previous.created)
        limits.check_prompt(prompt, settings, tok)
        asked = body.max_output_tokens or max(1, min(settings.max_tokens_limit, backend.max_model_len - len(prompt)))
        reads_calls = plan is not None and plan.reads_calls
        params = limits.sampling_params(chat, asked, settings, 1, tok.vocab_size, None,
                                        guided_tools=plan and plan.guided, engine_stops=not reads_calls,
                                        output_resumed=True)
        routes._validate(backend, prompt, params)
        rid = ResponseStore.new_id()
        REQUEST_ID.set(rid)
        outputs = routes._start(backend, [prompt], params, settings, True, hint)

        async def conclude(content: str, calls, reason: str | None, head, output_ids: list[int]) -> dict:
            """The response object; the answer remembered, and stored when `store` asks."""
            out = _body(rid, body, content, calls, reason, head, len(output_ids), settings.model_name)
            recall.remember(salt, tok.decode(prompt), prompt, output_ids)
            if body.store:
                said = {"role": "assistant", "content": content or None,
                        **({"tool_calls": [{"id": c.id, "type": "function", "function": {
                            "name": c.name, "arguments": c.arguments}} for c in calls]} if calls else {})}
                await store.put(StoredResponse(rid, owner, list(prompt), list(output_ids), messages + [said],
                                         out, head.replica, salt))
            return out

        if body.stream:
            shell = _body(rid, body, "", [], None, None, 0, settings.model_name)
            return sse(_stream(await first_output(outputs), plan if reads_calls else None, tok, rid, shell,
                                       conclude))
        if reads_calls:
            choices, head = await tool_answers.collect(aiter(outputs), plan, (), 1, tok)
            answer = choices[0]
            return await conclude(answer.parser.content, answer.parser.calls, answer.finish_reason, head,
                                  answer.ids)
        final, _, _ = await collect(outputs)
        head = final[(0, 0)]
        return await conclude(head.text, [], head.finish_reason, head, head.output_ids)

    @app.get("/v1/responses/{response_id}", responses=openapi_responses(401, 404))
    async def get(response_id: str, request: Request):
        stored = await store.get(response_id, key_digest(_key_of(request, settings)))
        if stored is None:
            raise ApiError(404, f"no response {response_id!r}", code="not_found")
        return stored.body

    @app.delete("/v1/responses/{response_id}", responses=openapi_responses(401, 404))
    async def delete(response_id: str, request: Request):
        if not await store.delete(response_id, key_digest(_key_of(request, settings))):
            raise ApiError(404, f"no response {response_id!r}", code="not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    return store


async def _stream(outputs, plan, tok, rid: str, shell: dict, conclude) -> AsyncIterator[dict]:
    """The events of a streamed response (app/api/response_stream.py), its text or tool calls as they come."""
    events = ResponseEvents(rid, shell)
    for event in events.start():
        yield event
    if plan is not None:
        choices, heads = {}, []
        async for _, deltas, _, _ in tool_answers.events(outputs, plan, (), 1, tok, choices, heads):
            for event in events.feed(deltas):
                yield event
        answer = choices[0]
        final = await conclude(answer.parser.content, answer.parser.calls, answer.finish_reason, heads[0],
                               answer.ids)
    else:
        head, content, ids, reason = None, "", [], None
        async with aclosing(outputs):
            async for _, out in outputs:
                head, reason = head or out, out.finish_reason or reason
                ids += out.new_token_ids
                content += out.new_text
                for event in events.feed([{"content": out.new_text}]):
                    yield event
        final = await conclude(content, [], reason, head, ids)
    for event in events.finish(final):
        yield event


def _key_of(request: Request, settings) -> str | None:
    """The key a stored response is looked up with: the request's, or None with no key configured."""
    return request.headers.get("authorization", "").removeprefix("Bearer ") if settings.api_key else None


def _prompt(chat: ChatCompletionRequest, plan, previous: StoredResponse | None, tok, settings,
            recall) -> tuple[list[int], bool]:
    """The stored conversation's exact ids and the new turns rendered after them, True; else the chat encoding,
    False."""
    if previous is not None:
        messages = [m.template_dict() for m in chat.messages]
        pieces = tok.chat_pieces(messages, True, plan and plan.tools)
        ids = continue_ids(tok, pieces, previous.prompt_ids + previous.output_ids)
        if ids is not None:
            return ids, True
    return limits.chat_prompt(chat, tok, settings, tools=plan and plan.tools, recall=recall), False


def _body(rid: str, req: ResponsesRequest, content: str, calls, reason: str | None, head, output_tokens: int,
          model: str) -> dict:
    """OpenAI's response object."""
    output = []
    if content:
        output.append({"type": "message", "id": "msg_" + rid[5:], "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for i, c in enumerate(calls):
        output.append({"type": "function_call", "id": f"fc_{rid[5:]}_{i}", "call_id": c.id, "name": c.name,
                       "arguments": c.arguments, "status": "completed"})
    cut = reason == "length"
    return {"id": rid, "object": "response", "created_at": now(), "model": model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else
            (req.tool_choice or ("auto" if req.tools else "none")),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "store": req.store, "truncation": "disabled", "text": {"format": {"type": "text"}},
            "metadata": req.metadata or {},
            "usage": None if head is None else {
                "input_tokens": head.prompt_tokens, "input_tokens_details": {"cached_tokens": head.cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": head.prompt_tokens + output_tokens}}
