"""The serving benchmarks' workloads, as deterministic text from a seed (no tokenizer needed), and their drivers.

- few-shot: `groups` long shared headers, each followed by different short queries; a warm-up pass, then a
  timed pass of new queries on the same headers (every hit comes from a header's checkpoint).
- chat: conversations whose history grows turn by turn; each turn re-sends the history with the model's answer
  and a new user line, and a generation-end checkpoint is what a next turn resumes from (unless the client
  trims the answer: `whole_lines`).
- reuse: the paper's reuse-distance replay (appendix C.2), scaled down: phases whose working sets shrink, each
  walked twice in a seeded shuffled order, one output token per request.

Each request's result: ok, ttft_s (first streamed chunk), prompt and cached tokens, and the replica that served
it (`system_fingerprint` of the last chunk).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise (Ray sets INFO)

NAMES = ("total", "count", "items", "value", "path", "config", "result", "index")


def text_block(rng: random.Random, tag: str, lines: int) -> str:
    return "\n".join(f"{rng.choice(NAMES)}_{tag}_{i} = {rng.randint(0, 9999)}" for i in range(lines))


def few_shot(seed: int, groups: int, per_group: int, header_lines: int = 40) -> tuple[list[str], list[str]]:
    """(warm-up prompts, timed prompts): the same headers, different queries, each list shuffled."""
    headers_rng = random.Random(seed)
    headers = [text_block(headers_rng, f"h{g}", header_lines) for g in range(groups)]
    passes = []
    for k in range(2):
        rng = random.Random(seed * 7919 + k)
        prompts = [f"{h}\nquery_{j} = {rng.randint(0, 999)}" for h in headers for j in range(per_group)]
        rng.shuffle(prompts)
        passes.append(prompts)
    return passes[0], passes[1]


def reuse_phases(seed: int, phases: tuple[int, ...], lines: int = 40) -> list[str]:
    """Each phase: its `size` distinct prompts, twice, shuffled; phases in order."""
    rng = random.Random(seed)
    out = []
    for p, size in enumerate(phases):
        prompts = [text_block(rng, f"s{seed}p{p}i{i}", lines) for i in range(size)] * 2
        rng.shuffle(prompts)
        out += prompts
    return out


def chat_openers(seed: int, conversations: int, system_lines: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [f"{text_block(rng, f'c{c}', system_lines)}\nuser: next value?\nassistant:" for c in range(conversations)]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, replica = None, "", None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "latency_s": time.perf_counter() - t0, "error": (await r.aread()).decode()}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    usage, replica = chunk["usage"], chunk.get("system_fingerprint")
    except httpx.HTTPError as e:
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": repr(e)}
    if usage is None:
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": "no usage chunk"}
    return {"ok": True, "latency_s": ttft if ttft is not None else time.perf_counter() - t0, "text": text,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "replica": replica}


async def _drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(p: str) -> dict:
            async with sem:
                return await _one(client, url, model, p, max_tokens)

        return await asyncio.gather(*(one(p) for p in prompts))


def drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int = 1) -> list[dict]:
    """Every prompt once, at most `concurrency` in flight; results in prompt order."""
    return asyncio.run(_drive(url, model, prompts, concurrency, max_tokens))


async def _chat(url: str, model: str, openers: list[str], turns: int, answer_tokens: int, concurrency: int,
                seed: int, whole_lines: bool) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def conversation(c: int, history: str) -> list[dict]:
            rng, out = random.Random(seed * 104729 + c), []
            for _ in range(turns):
                async with sem:
                    res = await _one(client, url, model, history, answer_tokens)
                out.append(res)
                if not res["ok"]:
                    break
                answer = res["text"][: res["text"].rfind("\n") + 1] if whole_lines else res["text"]
                history += f"{answer}\nuser: and value_{rng.randint(0, 999)}?\nassistant:"
            return out

        per = await asyncio.gather(*(conversation(c, h) for c, h in enumerate(openers)))
    return [r for conv in per for r in conv]


def chat(url: str, model: str, openers: list[str], turns: int, answer_tokens: int, concurrency: int,
         seed: int, whole_lines: bool = False) -> list[dict]:
    """Every conversation's turns in order (a turn waits for the previous answer), conversations side by side.
    whole_lines: the client keeps only the answer's complete lines in the history (as a tool that drops a cut-off
    line would), so the next turn's prompt leaves the generated tokens a few tokens before their end."""
    return asyncio.run(_chat(url, model, openers, turns, answer_tokens, concurrency, seed, whole_lines))
