"""The agentic workload (loadtest/workloads.py, `agentic`) over the Responses API: the same agents, system prompt,
tools, tool results and questions, but each request after an agent's first sends only its new items (tool outputs,
the next question) with `previous_response_id`, so the server resumes from the stored ids and the router from the
replica that served the previous response. Results have the fields of `agentic`'s (`resumed` reads them)."""

from __future__ import annotations

import asyncio
import random
import time

from loadtest.workloads import AGENT_TOOLS, agent_system, side_by_side, text_block

TOOLS = [{"type": "function", **t["function"]} for t in AGENT_TOOLS]  # the Responses API's flat form


async def _turn(client, model: str, items: list[dict], previous_id: str | None, tool_choice: str, max_tokens: int,
                salt: str) -> dict:
    """One streamed response: ok, TTFT (latency_s: to the first event), usage, id and the function calls."""
    t0 = time.perf_counter()
    ttft, final = None, None
    try:
        stream = await client.responses.create(
            model=model, input=items, previous_response_id=previous_id, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, max_output_tokens=max_tokens, temperature=0, stream=True,
            extra_body={} if previous_id else {"cache_salt": salt})
        async for event in stream:
            if ttft is None:  # the server sends its first event once the first token is out, as chat its first chunk
                ttft = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": repr(e)}
    if final is None or final.usage is None:
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": "no completed event"}
    usage = final.usage
    return {"ok": True, "latency_s": ttft if ttft is not None else time.perf_counter() - t0, "id": final.id,
            "replica": None,  # a response object does not name it
            "prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "cached_tokens": usage.input_tokens_details.cached_tokens,
            "tool_calls": [{"call_id": o.call_id} for o in final.output if o.type == "function_call"]}


async def _agents(url: str, model: str, seed: int, agents: int, turns: tuple[int, int], answer_tokens: int,
                  salt: str, api_key: str) -> list[dict]:
    from openai import AsyncOpenAI

    system = agent_system(seed)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)

    async def agent(a: int) -> list[dict]:
        rng, out, previous, last_id = random.Random(seed * 7907 + a), [], None, None
        items = [{"role": "system", "content": system},
                 {"role": "user", "content": f"Task {a}: find why value_{rng.randint(0, 999)} is wrong."}]

        async def ask(tool_choice: str, max_tokens: int) -> dict:
            nonlocal previous, last_id
            res = await _turn(client, model, items, last_id, tool_choice, max_tokens, salt)
            res.update(agent=a, step=len(out), tool_choice=tool_choice, previous=previous)
            out.append(res)
            previous = res["prompt_tokens"] + res["completion_tokens"] if res["ok"] else None
            last_id = res.get("id")
            return res

        for _ in range(rng.randint(*turns)):
            res = await ask("required" if rng.random() < 0.5 else "auto", 96)
            if not res["ok"]:
                break
            if res["tool_calls"]:  # the same results, drawn in the same order, as the chat agents'
                items = [{"type": "function_call_output", "call_id": c["call_id"],
                          "output": text_block(rng, f"r{a}", rng.randint(8, 15))} for c in res["tool_calls"]]
                res = await ask("auto", answer_tokens)
                if not res["ok"]:
                    break
            items = [{"role": "user", "content": f"And value_{rng.randint(0, 999)}?"}]
        return out

    return await side_by_side(client, agent, agents)


def agentic_responses(url: str, model: str, seed: int, agents: int = 12, turns: tuple[int, int] = (4, 6),
                      answer_tokens: int = 12, salt: str = "responses", api_key: str = "none") -> list[dict]:
    """`agents` agents side by side over the Responses API (see the module doc); `salt`: the cache_salt of each
    agent's first request, which its continuations inherit."""
    return asyncio.run(_agents(url, model, seed, agents, turns, answer_tokens, salt, api_key))
