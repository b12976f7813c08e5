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


# agentic: agents sharing one system prompt with six tool schemas, each running turns of tool call, tool result
# and answer, re-sending the whole history over Chat Completions (the zoo's 4096-token context, 3072-token cap)
AGENT_TOOLS = [{"type": "function", "function": {"name": name, "description": about, "parameters": {
    "type": "object", "properties": props, "required": list(props), "additionalProperties": False}}}
    for name, about, props in [
        ("read_file", "Read a file of the repository", {"path": {"type": "string", "maxLength": 24}}),
        ("search_code", "Search the repository for a name", {"query": {"type": "string", "maxLength": 16},
                                                             "limit": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}}),
        ("run_tests", "Run the tests of one module", {"module": {"type": "string", "maxLength": 20}}),
        ("list_dir", "List a directory", {"path": {"type": "string", "maxLength": 24}}),
        ("get_value", "Look up a configuration value", {"key": {"enum": list(NAMES)}}),
        ("write_note", "Keep a short note for later turns", {"text": {"type": "string", "maxLength": 24}}),
    ]]


def agent_system(seed: int, lines: int = 6) -> str:
    """The agents' shared system prompt (about 800 tokens of the zoo's with the six tools rendered)."""
    rng = random.Random(seed)
    return "You are a coding agent. Use the tools; answer briefly.\n" + text_block(rng, f"sys{seed}", lines)


async def _chat_turn(client, model: str, messages: list[dict], tool_choice: str, max_tokens: int,
                     salt: str) -> dict:
    """One streamed chat completion with the agent tools: ok, ttft (latency_s), usage, replica, and the answer
    (content and tool calls) assembled from the deltas."""
    t0 = time.perf_counter()
    ttft, content, calls, usage, replica = None, "", {}, None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=AGENT_TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt})
        async for chunk in stream:
            if chunk.choices:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for t in delta.tool_calls or ():
                    call = calls.setdefault(t.index, {"id": t.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += (t.function and t.function.name) or ""
                    call["function"]["arguments"] += (t.function and t.function.arguments) or ""
            if chunk.usage:
                usage, replica = chunk.usage, chunk.system_fingerprint
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": repr(e)}
    if usage is None:
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": "no usage chunk"}
    return {"ok": True, "latency_s": ttft if ttft is not None else time.perf_counter() - t0, "replica": replica,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "content": content,
            "tool_calls": [calls[k] for k in sorted(calls)]}


async def side_by_side(client, agent, agents: int) -> list[dict]:
    """`agent(a)` for each of `agents` agents at once, their results in agent order; `client` closed after."""
    try:
        per = await asyncio.gather(*(agent(a) for a in range(agents)))
    finally:
        await client.close()
    return [r for conv in per for r in conv]


async def _agents(url: str, model: str, seed: int, agents: int, turns: tuple[int, int], answer_tokens: int,
                  cold: bool, api_key: str) -> list[dict]:
    from openai import AsyncOpenAI

    system = agent_system(seed)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)

    async def agent(a: int) -> list[dict]:
        rng, out, previous = random.Random(seed * 7907 + a), [], None
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Task {a}: find why value_{rng.randint(0, 999)} is wrong."}]

        async def ask(tool_choice: str, max_tokens: int) -> dict:
            nonlocal previous
            salt = f"cold-{seed}-{a}-{len(out)}" if cold else f"agents-{seed}"
            res = await _chat_turn(client, model, messages, tool_choice, max_tokens, salt)
            res.update(agent=a, step=len(out), tool_choice=tool_choice, previous=previous)
            out.append(res)
            previous = res["prompt_tokens"] + res["completion_tokens"] if res["ok"] else None
            return res

        for _ in range(rng.randint(*turns)):
            res = await ask("required" if rng.random() < 0.5 else "auto", 96)
            if not res["ok"]:
                break
            if res["tool_calls"]:
                messages.append({"role": "assistant", "content": res["content"] or None,
                                 "tool_calls": res["tool_calls"]})
                messages += [{"role": "tool", "tool_call_id": c["id"],
                              "content": text_block(rng, f"r{a}", rng.randint(8, 15))} for c in res["tool_calls"]]
                res = await ask("auto", answer_tokens)
                if not res["ok"]:
                    break
            messages.append({"role": "assistant", "content": res["content"]})
            messages.append({"role": "user", "content": f"And value_{rng.randint(0, 999)}?"})
        return out

    return await side_by_side(client, agent, agents)


def agentic(url: str, model: str, seed: int, agents: int = 12, turns: tuple[int, int] = (4, 6),
            answer_tokens: int = 12, cold: bool = False, api_key: str = "none") -> list[dict]:
    """`agents` agents side by side, each `turns` turns of (call: `required` or `auto` at random; with a call, the
    tool results of 100-300 tokens and an `auto` answer); each request carries `previous`, the prompt plus output
    tokens of the agent's request before it. `cold`: every request has its own cache_salt (nothing reused)."""
    return asyncio.run(_agents(url, model, seed, agents, turns, answer_tokens, cold, api_key))


def resumed(results: list[dict], tail: int = 0) -> float | None:
    """Of the requests after each agent's first, the share whose cached tokens reach the previous request's
    prompt and output, less the last token and `tail` (the nr tail)."""
    later = [r for r in results if r["ok"] and r.get("previous") is not None]
    return sum(r["cached_tokens"] >= r["previous"] - 1 - tail for r in later) / len(later) if later else None
