"""The agentic workload is sized for the zoo (4096-token context, 3072-token prompt cap): a shared system prompt
of about 800 tokens with six tool schemas, tool results of 100-300 tokens, and histories that stay under the cap
at the most turns; `resumed` counts what the issue asks."""

from __future__ import annotations

import random

from app.models.loader import ZOO_DIR
from app.models.tokenizer import Tokenizer
from loadtest.workloads import AGENT_TOOLS, agent_system, resumed, text_block


def test_the_agentic_prompts_fit_the_zoo():
    tok = Tokenizer.from_dir(ZOO_DIR / "kda-tiny")
    assert len(AGENT_TOOLS) == 6
    system = [{"role": "system", "content": agent_system(3)}]
    assert 700 <= len(tok.encode_chat(system, False, AGENT_TOOLS)) <= 900
    rng = random.Random(0)
    sizes = [len(tok.encode(text_block(rng, "r1", n))) for n in (8, 15) for _ in range(5)]
    assert 90 <= min(sizes) and max(sizes) <= 300
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_" + "0" * 24, "type": "function",
            "function": {"name": "search_code", "arguments": '{"query":"aaaaaaaaaaaaaaaa","limit":9}'}}]}
    messages = system + [{"role": "user", "content": "Task 11: find why value_999 is wrong."}]
    for _ in range(6):  # the most turns, each with a call, the longest result and a full answer
        messages += [call, {"role": "tool", "tool_call_id": "call_" + "0" * 24, "content": text_block(rng, "r11", 15)},
                     {"role": "assistant", "content": "x = 1\n" * 3}, {"role": "user", "content": "And value_999?"}]
    assert len(tok.encode_chat(messages, True, AGENT_TOOLS)) + 96 <= 3072


def test_resumed_counts_requests_that_reach_the_previous_prompt_and_output():
    rows = [{"ok": True, "previous": None, "cached_tokens": 0}, {"ok": True, "previous": 100, "cached_tokens": 99},
            {"ok": True, "previous": 200, "cached_tokens": 150}, {"ok": False}]
    assert resumed(rows) == 0.5 and resumed(rows, tail=60) == 1.0 and resumed(rows[:1]) is None
