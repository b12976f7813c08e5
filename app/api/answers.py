"""How answers leave the API: collected whole (`collect`), or streamed (`first_output`, then `sse` over the chunks of
completions, chat completions and tool-reading chat completions). The Responses API streams its own events through
`sse` too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from app.api import tool_answers
from app.api.errors import from_backend
from app.api.logprobs import CompletionLogprobs, chat_logprobs
from app.api.schemas import error_body, now, usage
from app.api.streams import Outputs
from app.engine.request import RequestOutput


def fingerprint(out: RequestOutput) -> str:
    """`system_fingerprint` names the engine replica that served the request ("dasc-<replica>")."""
    return f"dasc-{out.replica or 'local'}"


async def collect(outputs: Outputs, logprobs: bool = False) -> tuple[dict[tuple[int, int], RequestOutput], dict,
                                                                       dict[int, list]]:
    """The final output of each sequence, keyed by (prompt index, sequence index); with `logprobs`, also each
    sequence's (token id, logprobs entry) pairs in order, under the same keys, and each prompt's entries (when
    the request asked for them) by prompt index."""
    final, entries, prompt_entries = {}, {}, {}
    try:
        async for i, out in outputs:
            if logprobs:
                entries.setdefault((i, out.index), []).extend(zip(out.new_token_ids, out.new_logprobs or ()))
                if out.prompt_logprobs is not None:
                    prompt_entries[i] = out.prompt_logprobs
            if out.finished:
                final[(i, out.index)] = out
    except Exception as e:
        raise from_backend(e) from e
    return final, entries, prompt_entries


async def first_output(outputs: Outputs) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs, with the first one already awaited: a request refused or failed before its first token
    gets its HTTP status (429, 503, ...) instead of a 200 stream holding an error event."""
    rest = aiter(outputs)
    try:
        head = await anext(rest)
    except Exception as e:
        raise from_backend(e) from e

    async def chained():
        yield head
        async with aclosing(rest):
            async for item in rest:
                yield item

    return chained()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async with aclosing(chunks):  # leaving early (client gone) closes the chain down to the engine
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # the stream has started: an error event, then [DONE]
            err = from_backend(e)
            yield f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def completion_chunks(outputs, prompts, params, body, rid, settings, tok) -> AsyncIterator[dict]:
    created, prompt_t, comp_t, cached, seen, lps, prompt_lps, compressed = now(), 0, 0, 0, set(), {}, {}, False
    first = None
    late_echo = body.echo and params.logprobs is not None  # the echo chunk waits for the prompt's logprobs
    if body.echo and not late_echo:
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                yield text_chunk(rid, created, settings, i * params.n + j, tok.decode(prompt), None)
    async with aclosing(outputs):
        async for i, out in outputs:
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            if late_echo and (i, out.index) not in lps:
                lp = lps.setdefault((i, out.index), CompletionLogprobs(tok)).chunk(prompts[i], prompt_lps[i])
                yield text_chunk(rid, created, settings, i * params.n + out.index, tok.decode(prompts[i]), None, lp)
            compressed, first = compressed or out.compressed_hit, first or out
            if i not in seen:
                seen.add(i)
                prompt_t, cached = prompt_t + out.prompt_tokens, cached + out.cached_tokens
            comp_t += len(out.new_token_ids)
            lp = None
            if out.new_logprobs:  # a chunk per token: one whose text is held back still reports its logprobs
                lp = lps.setdefault((i, out.index), CompletionLogprobs(tok)).chunk(out.new_token_ids,
                                                                                   out.new_logprobs)
            if out.new_text or out.finished or lp:
                yield text_chunk(rid, created, settings, i * params.n + out.index, out.new_text, out.finish_reason,
                                  lp)
    if body.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
               "choices": [], "usage": usage(prompt_t, comp_t, cached, compressed),
               **({"system_fingerprint": fingerprint(first)} if first is not None else {})}


async def chat_chunks(outputs, body, rid, settings, tok, remember, split=None) -> AsyncIterator[dict]:
    """A plain chat's chunks; with `split` (a `Reasoning` factory, app/api/reasoning.py) each choice's text comes
    as `reasoning_content` and `content` deltas."""
    created, comp_t, started, head, compressed, ids, parts = now(), 0, set(), None, False, {}, {}
    async with aclosing(outputs):
        async for _, out in outputs:
            head, compressed = head or out, compressed or out.compressed_hit
            comp_t += len(out.new_token_ids)
            ids.setdefault(out.index, []).extend(out.new_token_ids)
            delta = {} if out.index in started else {"role": "assistant"}
            started.add(out.index)
            if split is None:
                said = out.new_text
            else:
                thought, said = parts.setdefault(out.index, split()).feed(out.new_text, out.finished)
                if thought:
                    delta["reasoning_content"] = thought
            if said:
                delta["content"] = said
            lp = chat_logprobs(tok, out.new_token_ids, out.new_logprobs) if out.new_logprobs else None
            if delta or out.finished or lp:
                choice = {"index": out.index, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}
                yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": settings.model_name, "choices": [choice]}
    remember([v for _, v in sorted(ids.items())])
    if body.include_usage and head is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name,
               "system_fingerprint": fingerprint(head), "choices": [],
               "usage": usage(head.prompt_tokens, comp_t, head.cached_tokens, compressed)}


async def chat_tool_chunks(outputs, body, plan, stops, params, rid, settings, tok, remember,
                           split=None) -> AsyncIterator[dict]:
    """A tool-reading chat's chunks: per choice, the role first, then its reasoning (with `split`), content and
    tool-call deltas; the finish_reason (and logprobs) on the chunk of the output that carried them. At the end
    `remember(ids, messages)` gets each choice's output ids and assembled message."""
    created, choices, heads = now(), {}, []

    def chunk(index: int, delta: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    started = set()
    async for j, deltas, finish, lp in tool_answers.events(outputs, plan, stops, params.n, tok, choices, heads,
                                                            split):
        if j not in started:
            started.add(j)
            yield chunk(j, {"role": "assistant", "content": ""})
        for k, delta in enumerate(deltas):
            yield chunk(j, delta, None, lp if k == 0 else None)
        if finish is not None or (lp and not deltas):
            yield chunk(j, {}, finish, None if deltas else lp)
    ordered = [c for _, c in sorted(choices.items())]
    remember([c.ids for c in ordered], [c.message() for c in ordered])
    if body.include_usage and heads:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name,
               "system_fingerprint": fingerprint(heads[0]), "choices": [],
               "usage": usage(heads[0].prompt_tokens, sum(len(c.ids) for c in choices.values()),
                              heads[0].cached_tokens, any(h.compressed_hit for h in heads))}


def text_chunk(rid, created, settings, index, text, finish_reason, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
