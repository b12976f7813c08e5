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
THINKS = ("It is cold up north, so say so.\n</think>\n\nIt is ", " degrees in Oslo today.")


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
            chunks = [c async for c in await oai.chat.completions.create(**ASK, extra_body=salt, stream=True)]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            content = (await oai.chat.completions.create(**ASK, extra_body=salt)).choices[0].message.content
        assert content.endswith("degrees in Oslo today.")
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


async def test_a_tool_result_resumes_after_the_call_re_sent_without_its_reasoning(qwen):  # noqa: F811
    """An agent that re-sends the call without `reasoning_content` (as the openai client's message dump of a
    reply does unless it keeps the field): the template renders the call turn without its reasoning."""
    from tests.api.test_qwen3_5_chat import CALL, END_CALL
    from tests.api.test_tools import TOOLS

    tok = qwen.tokenizer
    app = build_api(Scripted(qwen, "Look it up.\n</think>\n\n" + CALL, END_CALL), SETTINGS)
    salt = {"cache_salt": "resend-tools"}
    async with client(app) as http:
        oai = openai_client(http)
        before = await _status(http)
        r = await oai.chat.completions.create(**ASK, tools=TOOLS, extra_body=salt)
        message = r.choices[0].message
        assert message.tool_calls and message.reasoning_content == "Look it up.\n"
        end = time.monotonic() + 120
        while (await _status(http))["warm_requests"] < before["warm_requests"] + 1:
            assert time.monotonic() < end, "no warm request"
            await asyncio.sleep(0.02)
        call = message.model_dump(exclude_none=True, exclude={"reasoning_content"})
        resent = tok.encode_chat_continuation(MESSAGES, call, TOOLS)
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3 degrees"}
        nxt = await oai.chat.completions.create(**{**ASK, "messages": [*MESSAGES, call, result]}, tools=TOOLS,
                                                extra_body=salt)
        assert nxt.usage.prompt_tokens_details.cached_tokens >= len(resent) - 1
