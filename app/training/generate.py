"""Single-request generation without the engine: for the CLI, the retrieval probe and training reports."""

from __future__ import annotations

import torch

from app.engine.sampling import sample_token
from app.models.batch import BatchLayout, ContiguousKV
from app.models.hybrid import HybridForCausalLM


@torch.no_grad()
def generate(
    model: HybridForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: tuple[int, ...] = (),
    prefill_chunk: int = 1024,
) -> list[int]:
    """Prefill `prompt_ids` in chunks, then decode up to `max_new_tokens` (stopping after a stop id)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kv, states = ContiguousKV(), model.empty_states(1)
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    for lo in range(0, len(prompt_ids), prefill_chunk):
        piece = ids[lo : lo + prefill_chunk]
        logits, states = model(piece, BatchLayout((len(piece),), (lo,)), kv, states)
    out: list[int] = []
    pos = len(prompt_ids)
    while len(out) < max_new_tokens:
        token = sample_token(logits[0], temperature, top_p, gen)
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        logits, states = model(torch.tensor([token]), BatchLayout((1,), (pos,)), kv, states)
        pos += 1
    return out
