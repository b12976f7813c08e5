"""bench_peer's `--fewshot` mode: few-shot prompts on new headers, ours against llama-server with and without
recurrent-state checkpoints it can reuse.

Per start of each arm: 8 headers of 500 tokens no server has seen, each warmed by one request of header + query;
then 32 queries of 30 tokens (4 per header, shuffled with a fixed seed) 4 at a time, each asking for 1 token. The
figures are the queries' mean TTFT (send to the whole answer, which is one token) and mean cached prompt tokens,
and the cached tokens of each header's first query after its warm-up (share of the header). Cached tokens come
from the answer: ours from `usage.prompt_tokens_details.cached_tokens`, llama-server's from its `timings`
(`cache_n`). llama-server stores its recurrent-state checkpoints a few tokens and a micro-batch before each
prompt's end: at its default `-ub 512` they lie before a 530-token prompt's start, at `-ub 128` inside the header
(the `llama-ub128` arm). Ours run as shipped: `app.api.local` (ours-local) and `serve run` of configs/config.yaml
with one replica (ours-ray: Serve's proxy, the ingress, the router and the controller in front of the engine).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from loadtest.common import median
from loadtest.peer import client, llama, servers
from loadtest.serve_harness import free_port

HEADERS, HEADER, QUERY, PER_HEADER, CONCURRENCY = 8, 500, 30, 4, 4
ARMS = ("ours-local", "ours-ray", "llama", "llama-ub128")
UB128 = ("-ub", "128")


def tokens_per_start() -> int:
    return HEADERS * (HEADER + (1 + PER_HEADER) * QUERY)


def plan(ids: list[int], starts: int) -> list[dict]:
    """Per start: the headers' warm-up prompts and the shuffled queries, as (header index, prompt)."""
    need = tokens_per_start() // HEADERS
    if len(ids) < starts * HEADERS * need:
        raise ValueError(f"the corpus holds {len(ids)} tokens; the few-shot plan needs {starts * HEADERS * need}")
    out, at = [], 0
    for s in range(starts):
        warm, queries = [], []
        for h in range(HEADERS):
            piece = ids[at : at + need]
            at += need
            header = piece[:HEADER]
            warm.append(header + piece[HEADER : HEADER + QUERY])
            queries += [(h, header + piece[HEADER + (q + 1) * QUERY : HEADER + (q + 2) * QUERY])
                        for q in range(PER_HEADER)]
        random.Random(s).shuffle(queries)
        out.append({"warm": warm, "queries": queries})
    return out


async def _ask(c: httpx.AsyncClient, url: str, arm: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the one-token answer, prompt tokens the server reports it reused)."""
    t0 = time.perf_counter()
    r = await c.post(f"{url}/v1/completions", json=client.body("llama" if arm.startswith("llama") else arm,
                                                                 prompt, 1))
    dt = time.perf_counter() - t0
    out = client._check(r, prompt, 1)
    return dt, cached_tokens(out)


def cached_tokens(answer: dict) -> int:
    """Prompt tokens an answer says were reused: OpenAI's usage field, else llama-server's timings."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = answer.get("timings") or {}
    if "cache_n" in timings:
        return int(timings["cache_n"])
    raise RuntimeError("the answer reports no cached tokens (neither usage.prompt_tokens_details nor timings)")


async def measure(url: str, arm: str, run: dict) -> dict:
    async with httpx.AsyncClient(timeout=client.TIMEOUT) as c:
        for prompt in run["warm"]:
            await _ask(c, url, arm, prompt)
        ttft, cached, first = [], [], {}
        queries = run["queries"]
        for i in range(0, len(queries), CONCURRENCY):
            group = queries[i : i + CONCURRENCY]
            answers = await asyncio.gather(*(_ask(c, url, arm, p) for _, p in group))
            for (h, _), (dt, n) in zip(group, answers):
                ttft.append(dt)
                cached.append(n)
                first.setdefault(h, n)
    return {"ttft_mean_s": sum(ttft) / len(ttft), "cached_mean": sum(cached) / len(cached),
            "first_query_share_min": min(first.values()) / HEADER, "first_query_cached": [first[h] for h in
                                                                                          sorted(first)]}


def bench(model: str, ids: list[int], starts: int, arms: list[str], logdir, model_file=None, say=print) -> dict:
    """Every arm `starts` times on fresh servers, interleaved (the order rotated per start); per arm the medians
    over starts. `model_file`: the model's GGUF, for the llama arms."""
    runs = plan(ids, starts)
    per: dict[str, list[dict]] = {a: [] for a in arms}
    for s, run in enumerate(runs):
        for arm in arms[s % len(arms):] + arms[: s % len(arms)]:
            port = free_port()
            if arm == "llama-ub128":
                server = servers.launch("llama", llama.server_command(model_file, port, llama.SERVER_FLAGS + UB128),
                                        port, logdir / f"{arm}-{model}-{port}.log")
            else:
                server = servers.start(arm, model, port, logdir, model_file)
            try:
                res = asyncio.run(measure(server.url, arm, run))
            finally:
                server.stop()
            per[arm].append(res)
            say(f"{model} {arm} start {s}: {res}")
    return {"per_start": per, "medians": {a: {k: median([r[k] for r in rs]) for k in
                                              ("ttft_mean_s", "cached_mean", "first_query_share_min")}
                                          for a, rs in per.items()}}


def markdown(res: dict) -> str:
    m = res["medians"]
    rows = [f"| {a} | {v['ttft_mean_s'] * 1e3:.1f} | {v['cached_mean']:.0f} | {v['first_query_share_min']:.2f} |"
            for a, v in m.items()]
    ratios = [f"\n\n{ours}'s mean TTFT over: " + ", ".join(
        f"{a} {m[ours]['ttft_mean_s'] / v['ttft_mean_s']:.2f}x" for a, v in m.items() if a.startswith("llama")) + "."
        for ours in m if ours.startswith("ours") and any(a.startswith("llama") for a in m)]
    return (f"{HEADERS} headers x {HEADER} tokens, each warmed by one request; then {HEADERS * PER_HEADER} queries of "
            f"{QUERY} tokens, {CONCURRENCY} at a time, 1 output token; medians over starts:\n\n"
            "| arm | mean TTFT ms | cached tokens per query | first query after warm-up, cached share of its "
            "header (least of the headers) |\n|---|---|---|---|\n" + "\n".join(rows) + "".join(ratios))
