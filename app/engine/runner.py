"""Model runner: turns a step's work list into one flat forward pass and samples next tokens.

All pieces of a step run in one call: decode tokens of many sequences batch through the recurrent ops
together (equal extend length 1), prefill pieces run with their peers of equal length, attention reads and
writes the KV pool through `PagedKV`. States come from and go back to the active state pool.
"""

from __future__ import annotations

import torch

from app.cache.pools import KVPool, PagedKV, StatePool
from app.engine.request import Sequence
from app.engine.scheduler import Work
from app.models.batch import BatchLayout
from app.models.generate import sample_token
from app.models.hybrid import HybridForCausalLM


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, kv: KVPool, states: StatePool) -> None:
        self.model, self.kv, self.states = model, kv, states

    @torch.no_grad()
    def run(self, works: list[Work]) -> dict[int, torch.Tensor]:
        """Feed every piece; returns next-token logits [V] (fp32) keyed by id(seq) for pieces that reach the
        end of their sequence's token stream."""
        ids = torch.tensor([t for w in works for t in w.seq.tokens[w.start : w.end]], dtype=torch.long)
        layout = BatchLayout(tuple(w.end - w.start for w in works), tuple(w.start for w in works))
        kv = PagedKV(self.kv, [w.seq.kv_slots for w in works], [w.new_slots for w in works])
        slots = [w.seq.state_slot for w in works]
        logits, new_states = self.model(ids, layout, kv, self.states.gather(slots))
        self.states.scatter(slots, new_states)
        return {id(w.seq): logits[i].float() for i, w in enumerate(works) if w.end == len(w.seq.tokens)}


def sample(seq: Sequence, logits: torch.Tensor) -> int:
    """The sequence's next token under its sampling params, drawn with its own generator."""
    p = seq.params
    return sample_token(logits, p.temperature, p.top_p, seq.generator, p.top_k)
