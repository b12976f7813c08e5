"""Greedy agreement with llama-server on random Qwen3.5 checkpoints (`bench_peer --agreement`): the families the zoo
has no model of, converted by llama.cpp's own converter (`qwen35`, `qwen35moe`).

`SYNTH` names the checkpoints: random weights in the hub's vision-language layout (loadtest/synth_model.py, the zoo
tokenizer), written once under ~/.cache/dasc-serve/synth/<name>-<RECIPE> (never into the repository).
loadtest/peer/gguf.py converts them (the vision and MTP tensors dropped first: a text-only GGUF). Per model: one
start of ours-local (eager: the agreement is about the forward, not its compiled form) and one of llama-server,
llama-server's /tokenize against ours on the prompt text, then `PROMPTS` greedy continuations of `TOKENS` tokens
from the held-out corpus, ids as each server reports them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from app.models.tokenizer import Tokenizer
from loadtest.bench_engine import corpus_ids
from loadtest.peer import client, gguf, llama, servers
from loadtest.serve_harness import free_port
from loadtest.synth_model import qwen3_5_config, write

PROMPTS, PROMPT_LEN, TOKENS = 5, 64, 32
RECIPE = "3"  # part of the directory name: change it when a SYNTH shape or the writer changes
# hidden 256, 8 layers (6 GDN, 2 gated attention), 4 heads of 64 on 2 KV heads, GDN 2 key x 4 value heads of 64
_SHAPE = dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, linear_k_heads=2, linear_v_heads=4,
              linear_head_dim=64, intermediate=512)
SYNTH = {"qwen3.5-random": _SHAPE, "qwen3.5-moe-random": {**_SHAPE, "intermediate": 128, "experts": 8}}
LOCAL_ENGINE = {"compile_decode": False, "compile_prefill": False}


def synth_dir(name: str) -> Path:
    """The checkpoint `name` of `SYNTH`, written first if it is not there."""
    out = llama.cache_root() / "synth" / f"{name}-{RECIPE}"
    if not (out / "config.json").exists():
        write(out.with_name(out.name + ".part"), qwen3_5_config(**SYNTH[name]), seed=0)
        out.with_name(out.name + ".part").replace(out)
    return out


def bench(name: str, logdir: Path, say=print) -> dict:
    model_dir = synth_dir(name)
    tok = Tokenizer.from_dir(model_dir)
    ids = corpus_ids(tok, PROMPTS * PROMPT_LEN)
    prompts = [ids[i * PROMPT_LEN: (i + 1) * PROMPT_LEN] for i in range(PROMPTS)]
    model_file = gguf.convert(name, model_dir, say)
    out: dict = {"model_dir": str(model_dir), "gguf": model_file.name, "ids": {}}
    for arm in ("ours-local", "llama"):
        server = servers.start(arm, str(model_dir), free_port(), logdir, model_file, LOCAL_ENGINE)
        say(f"{name} {arm}: up in {server.start_s:.1f} s")
        try:
            if arm == "llama":
                text = tok.decode(ids)
                theirs = asyncio.run(_tokenize(server.url, text))
                out["tokenizer"] = {"tokens": len(ids), "equal": tok.encode(text) == theirs}
            out["ids"][arm] = asyncio.run(_greedy(server.url, arm, prompts, client.Vocab(tok)))
        finally:
            server.stop()
    out["agreement"] = [client.matches(o, t, TOKENS) for o, t in zip(out["ids"]["ours-local"], out["ids"]["llama"])]
    return out


async def _tokenize(url: str, text: str) -> list[int]:
    async with httpx.AsyncClient(timeout=client.TIMEOUT) as c:
        return await client.tokenize(c, url, text)


async def _greedy(url: str, arm: str, prompts: list[list[int]], vocab: client.Vocab) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=client.TIMEOUT) as c:
        return [await client.greedy_ids(c, url, arm, p, TOKENS, vocab) for p in prompts]


def markdown(res: dict) -> str:
    cells = ", ".join(f"{s}/{TOKENS}" for s, _ in res["agreement"])
    prefixes = ", ".join(str(p) for _, p in res["agreement"])
    tok = res["tokenizer"]
    return (f"Random checkpoint {Path(res['model_dir']).name} (loadtest/peer/agreement.py `SYNTH`), converted by "
            f"llama.cpp's convert_hf_to_gguf.py to `{res['gguf']}` (f32).\n\n"
            f"Greedy agreement ours-local vs llama-server, tokens equal per prompt ({PROMPTS} prompts of "
            f"{PROMPT_LEN} tokens, {TOKENS} new): {cells} (common prefix {prefixes}). llama-server's /tokenize "
            f"on the prompts' text: {'equal to ours' if tok['equal'] else 'DIFFERENT from ours'} "
            f"({tok['tokens']} tokens).")
