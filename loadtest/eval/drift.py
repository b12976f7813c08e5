"""Logprob fidelity through the API: the same greedy requests, one after another, against a server per setting;
each step's top logprobs are kept with whether the request resumed from a compressed checkpoint
(`usage.prompt_tokens_details.compressed_checkpoint`), so a setting's steps can be compared with the dense run's
(`compare.compare_steps`) on exactly the requests that a compressed checkpoint served."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from loadtest.eval.compare import compare_steps

TASKS = Path(__file__).parent / "tasks"


def copy_prompt(doc: dict) -> str:
    """The text of a dasc_code_copy document as lm-eval renders it (its YAML's doc_to_text)."""
    return f"{doc['header']}\n\n# Repeat a line from above:\n{doc['prefix']}"


def copy_prompts(limit: int | None = None) -> list[str]:
    docs = [json.loads(line) for line in (TASKS / "dasc_code_copy.jsonl").read_text().splitlines()]
    return [copy_prompt(d) for d in docs[:limit]]


def run(url: str, model: str, prompts: list[list[int]], max_tokens: int = 16, top: int = 20) -> list[dict]:
    """One greedy completion per prompt (token ids), in order -> per request: its steps [(token, {token:
    logprob})], cached prompt tokens and whether a compressed checkpoint served it."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for ids in prompts:
            r = client.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                      "temperature": 0, "logprobs": top})
            r.raise_for_status()
            body = r.json()
            lp = body["choices"][0]["logprobs"]
            details = body["usage"].get("prompt_tokens_details") or {}
            out.append({"steps": list(zip(lp["tokens"], lp["top_logprobs"])),
                        "cached": details.get("cached_tokens", 0),
                        "compressed": bool(details.get("compressed_checkpoint"))})
    return out


def summarize(dense: list[dict], other: list[dict]) -> dict:
    """Over the requests a compressed checkpoint served in `other`: mean per-step KL against dense, top-1
    agreement per step, share of whole generations equal to dense, steps compared."""
    kls, agree, same, served = [], [], 0, 0
    for d, o in zip(dense, other):
        if not o["compressed"]:
            continue
        served += 1
        k, a = compare_steps(d["steps"], o["steps"])
        kls += k
        agree += a
        same += [t for t, _ in d["steps"]] == [t for t, _ in o["steps"]]
    return {"requests": len(other), "compressed": served, "steps": len(kls),
            "kl_mean": sum(kls) / len(kls) if kls else None,
            "top1_agreement": sum(agree) / len(agree) if agree else None,
            "greedy_agreement": same / served if served else None}
