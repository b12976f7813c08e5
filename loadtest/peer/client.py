"""What bench_peer.py sends, the same to every arm: POST /v1/completions with `prompt` a list of token ids,
greedy (temperature 0), `ignore_eos` so that exactly max_tokens come back (checked from `usage`), and the figures
it takes from the answers. Both servers take token-id prompts there; neither adds a BOS token to them (checked:
usage.prompt_tokens is the prompt's length).

Greedy ids: /v1/completions returns text, and re-tokenizing text is not the model's output, so the ids come from
each server's own report: ours from `logprobs: 0`, whose `tokens` are vocabulary entries, one string per id
(`Vocab`); llama-server from its native /completion with `return_tokens`. These requests do not set ignore_eos:
llama-server's ignore_eos bans end-of-generation tokens from the pick (a logit bias of -inf), ours only keeps
going after one, so greedy outputs would part at the first end token for that reason alone; without it both stop
there.

Inter-token latency (`stream_gaps`, `gaps`): per stream, the gaps between arrivals of SSE chunks that carry text, after
the first; a chunk carrying k tokens adds k - 1 gaps of 0 (the tokens came at once). Which chunk carried more
than one is not needed: the gaps' multiset depends only on the arrival times and the stream's token count
(usage.completion_tokens), so the count of zeros is tokens - chunks.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from app.models.tokenizer import Tokenizer

TIMEOUT = httpx.Timeout(600.0)


class Vocab:
    """Our logprobs `tokens` strings -> ids (app/api/logprobs.py: one vocabulary entry per id)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.ids = {tok.token_string(i): i for i in range(tok.vocab_size)}
        if len(self.ids) != tok.vocab_size:
            raise ValueError("two ids share a token string: logprobs tokens would not name ids")

    def __call__(self, tokens: list[str]) -> list[int]:
        return [self.ids[t] for t in tokens]


def body(arm: str, prompt: list[int], max_tokens: int, *, cold: bool = False, stream: bool = False) -> dict:
    """A /v1/completions request; `cold`: llama-server must not reuse a slot's cached prompt either."""
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    if cold and arm == "llama":
        b["cache_prompt"] = False
    return b


def _check(r: httpx.Response, prompt: list[int], max_tokens: int | None) -> dict:
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    out = r.json()
    usage = out["usage"]
    if usage["prompt_tokens"] != len(prompt):
        raise RuntimeError(f"the server counted {usage['prompt_tokens']} prompt tokens, sent {len(prompt)}")
    if max_tokens is not None and usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"{usage['completion_tokens']} tokens came back, asked for exactly {max_tokens}")
    return out


async def complete(client: httpx.AsyncClient, url: str, arm: str, prompt: list[int], max_tokens: int,
                   cold: bool = False) -> float:
    """Seconds from send to the whole (non-streamed) answer, which must hold exactly `max_tokens` tokens."""
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body(arm, prompt, max_tokens, cold=cold))
    dt = time.perf_counter() - t0
    _check(r, prompt, max_tokens)
    return dt


async def concurrent(client: httpx.AsyncClient, url: str, arm: str, prompts: list[list[int]],
                     max_tokens: int) -> float:
    """Wall seconds from the first send to the last answer of all `prompts` sent at once."""
    t0 = time.perf_counter()
    await asyncio.gather(*(complete(client, url, arm, p, max_tokens) for p in prompts))
    return time.perf_counter() - t0


async def greedy_ids(client: httpx.AsyncClient, url: str, arm: str, prompt: list[int], n: int,
                     vocab: Vocab) -> list[int]:
    """The ids of the greedy continuation (at most `n`, ending at an end token), as the server reports them."""
    if arm == "llama":
        r = await client.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                                         "return_tokens": True, "cache_prompt": False})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        return list(r.json()["tokens"])
    r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                         "logprobs": 0})
    out = _check(r, prompt, None)
    return vocab(out["choices"][0]["logprobs"]["tokens"])


async def stream_gaps(client: httpx.AsyncClient, url: str, arm: str, prompt: list[int], max_tokens: int) -> list[float]:
    """One streamed request's inter-token gaps in seconds (see the module doc): max_tokens - 1 of them."""
    arrivals, tokens = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body(arm, prompt, max_tokens, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            t = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                arrivals.append(t)
    tokens = len(arrivals) if tokens is None else tokens
    if tokens != max_tokens:
        raise RuntimeError(f"stream: {tokens} tokens came back, asked for exactly {max_tokens}")
    return gaps(arrivals, tokens)


def gaps(arrivals: list[float], tokens: int) -> list[float]:
    """Inter-token gaps of a stream whose text chunks arrived at `arrivals` carrying `tokens` tokens in all: the
    gaps between chunks, and 0 for each token beyond the first of a chunk (tokens - 1 values)."""
    if not 0 < len(arrivals) <= tokens:
        raise ValueError(f"{len(arrivals)} chunks cannot carry {tokens} tokens")
    return [b - a for a, b in zip(arrivals, arrivals[1:])] + [0.0] * (tokens - len(arrivals))


async def streams(client: httpx.AsyncClient, url: str, arm: str, prompts: list[list[int]],
                  max_tokens: int) -> list[float]:
    """Every gap of `prompts` streamed at once."""
    per = await asyncio.gather(*(stream_gaps(client, url, arm, p, max_tokens) for p in prompts))
    return [g for gaps in per for g in gaps]


async def tokenize(client: httpx.AsyncClient, url: str, text: str) -> list[int]:
    """llama-server's /tokenize of `text` (its GGUF vocabulary and pre-tokenizer)."""
    r = await client.post(f"{url}/tokenize", json={"content": text})
    return list(r.json()["tokens"])


def matches(ours: list[int], theirs: list[int], n: int) -> tuple[int, int]:
    """(positions of n where both have the same id or both have ended, length of the common prefix)."""
    same = sum((ours[i] if i < len(ours) else None) == (theirs[i] if i < len(theirs) else None) for i in range(n))
    prefix = next((i for i in range(min(len(ours), len(theirs))) if ours[i] != theirs[i]), min(len(ours), len(theirs)))
    return same, prefix
