"""The next turn of a thinking chat resumes after the answer it re-sends (app/api/resend.py): under Qwen3.5's
template the history form of an answer drops its reasoning, so the server stores a checkpoint where the next turn
leaves the prompt and, once the answer is known, warms the conversation as the next turn renders it. Served by
kda-tiny's weights under the synthetic Qwen3.5 tokenizer, scripted to think and answer (tests/api/common.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.api import resend
from app.api.routes import build_api
from tests.api.common import Scripted, client, openai_client
from tests.api.test_qwen3_5_chat import ASK, MESSAGES, SETTINGS, qwen  # noqa: F401 - the fixture

pytestmark = pytest.mark.anyio
LONG = " ".join(f"Day {d} will be dry, with wind from the west." for d in range(1, 8))  # > resend.MIN_WARM tokens
BIG = {**ASK, "max_tokens": 256}
THINKS = ("It is cold up north, so say so.\n</think>\n\nIt is ", " degrees in Oslo today. " + LONG)


async def _status(http) -> dict:
    return (await http.get("/status")).json()["replicas"]["local"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_next_turn_resumes_after_the_answer_it_resends(qwen, stream):  # noqa: F811
    tok = qwen.tokenizer
    app = build_api(Scripted(qwen, *THINKS), SETTINGS)
    salt = {"cache_salt": f"resend-{stream}"}
    async with client(app) as http:
        oai = openai_client(http)
        before = await _status(http)
        if stream:
            chunks = [c async for c in await oai.chat.completions.create(**BIG, extra_body=salt, stream=True)]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            content = (await oai.chat.completions.create(**BIG, extra_body=salt)).choices[0].message.content
        assert content.endswith(LONG)
        end = time.monotonic() + 120  # the warm request runs after the answer: a hang guard, not a timing check
        while (await _status(http))["warm_requests"] < before["warm_requests"] + 1:
            assert time.monotonic() < end, "no warm request"
            await asyncio.sleep(0.02)
        answer = {"role": "assistant", "content": content}
        resent = tok.encode_chat_continuation(MESSAGES, answer)
        prompt = tok.encode_chat(MESSAGES, True)
        shared = resend.shared_len(tok, prompt, MESSAGES, {})
        assert shared is not None and resent[:shared] == prompt[:shared] and len(resent) > len(prompt) - 3
        nxt = await oai.chat.completions.create(
            **{**ASK, "messages": [*MESSAGES, answer, {"role": "user", "content": "And tomorrow?"}]}, extra_body=salt)
        assert nxt.usage.prompt_tokens_details.cached_tokens >= len(resent) - 1
        after = await _status(http)
        assert after["requests_finished"] - before["requests_finished"] == 2  # the warm request is not counted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tool_result_resumes_after_the_call_re_sent_without_its_reasoning(qwen, stream):  # noqa: F811
    """An agent that re-sends the call without `reasoning_content` (as the openai client's message dump of a
    reply does unless it keeps the field): the template renders the call turn without its reasoning."""
    from tests.api.test_qwen3_5_chat import CALL, END_CALL
    from tests.api.test_tools import TOOLS

    tok = qwen.tokenizer
    app = build_api(Scripted(qwen, "Look it up.\n</think>\n\n" + LONG + "\n" + CALL, END_CALL), SETTINGS)
    salt = {"cache_salt": f"resend-tools-{stream}"}
    async with client(app) as http:
        oai = openai_client(http)
        before = await _status(http)
        if stream:
            async with oai.chat.completions.stream(**BIG, tools=TOOLS, extra_body=salt) as s:
                message = (await s.get_final_completion()).choices[0].message
        else:
            message = (await oai.chat.completions.create(**BIG, tools=TOOLS, extra_body=salt)).choices[0].message
        assert message.tool_calls
        end = time.monotonic() + 120
        while (await _status(http))["warm_requests"] < before["warm_requests"] + 1:
            assert time.monotonic() < end, "no warm request"
            await asyncio.sleep(0.02)
        call = {"role": "assistant", "content": message.content, "tool_calls": [  # as an agent re-sends it
            {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}
            for t in message.tool_calls]}
        resent = tok.encode_chat_continuation(MESSAGES, call, TOOLS)
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3 degrees"}
        nxt = await oai.chat.completions.create(**{**ASK, "messages": [*MESSAGES, call, result]}, tools=TOOLS,
                                                extra_body=salt)
        assert nxt.usage.prompt_tokens_details.cached_tokens >= len(resent) - 1


async def test_a_short_answer_warms_nothing_and_the_next_turn_resumes_where_the_prompts_part(qwen):  # noqa: F811
    """An answer of fewer than resend.MIN_WARM tokens is not worth a request: the next turn computes it itself,
    from the checkpoint stored where its prompt leaves this one."""
    tok = qwen.tokenizer
    app = build_api(Scripted(qwen, THINKS[0], " degrees."), SETTINGS)
    salt = {"cache_salt": "resend-short"}
    async with client(app) as http:
        oai = openai_client(http)
        before = (await _status(http))["warm_requests"]
        content = (await oai.chat.completions.create(**ASK, extra_body=salt)).choices[0].message.content
        answer = {"role": "assistant", "content": content}
        shared = resend.shared_len(tok, tok.encode_chat(MESSAGES, True), MESSAGES, {})
        nxt = await oai.chat.completions.create(
            **{**ASK, "messages": [*MESSAGES, answer, {"role": "user", "content": "And tomorrow?"}]}, extra_body=salt)
        assert shared <= nxt.usage.prompt_tokens_details.cached_tokens < len(tok.encode_chat_continuation(
            MESSAGES, answer)) - 1
        assert (await _status(http))["warm_requests"] == before
