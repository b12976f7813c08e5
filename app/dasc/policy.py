"""Load policies for compressed checkpoints (paper section 4.2).

nr: the omitted (local) units stay zero after loading: nothing to do.
wr: replay the last `window` tokens of the cached prefix through the model from a zeroed scratch recurrent
    state, reading (never writing) the cached attention KV, and copy only the refreshed local units into the
    active state; the stored checkpoint, the retained units, the conv windows and the KV stay unchanged.
    window = max over local units of clamp(pow2ceil(H_s), 4, W_max); 0 when nothing is omitted.
"""

from __future__ import annotations

import math

import torch

from app.dasc.codec import retained_rows
from app.dasc.plan import SelectionPlan
from app.models.batch import BatchLayout, LinearStates

POLICIES = ("nr", "wr")


def unit_window(horizon: float, w_max: float) -> int:
    """clamp(pow2ceil(H_s), 4, W_max) for one local unit."""
    p2 = 1 if horizon <= 1 else 2 ** math.ceil(math.log2(horizon))
    return int(min(max(p2, 4), w_max))


def wr_window(plan: SelectionPlan) -> int:
    windows = [unit_window(h, plan.w_max) for lp in plan.layers
               for u, h in enumerate(lp.horizons) if u not in set(lp.keep)]
    return max(windows, default=0)


def local_rows(plan: SelectionPlan) -> list[torch.Tensor]:
    """Per layer, the rows of the [H * d_k, d_v] state view that the plan omits."""
    out = []
    for lp in plan.layers:
        mask = torch.ones(lp.heads * lp.d_k, dtype=torch.bool)
        mask[retained_rows(lp)] = False
        out.append(torch.nonzero(mask).flatten())
    return out


class ReadOnlyKV:
    """`AttentionKV` over cached history only: a replayed window attends to the cached entries of its
    prefix (positions [0, len(slots))) and writes nothing."""

    def __init__(self, storage: dict[int, torch.Tensor], slots: torch.Tensor) -> None:
        self.storage, self.slots = storage, slots

    def extend(self, layer: int, seq: int, entries: torch.Tensor) -> torch.Tensor:
        return self.storage[layer][self.slots]

    def extend_padded(self, layer: int, seqs: list[int], entries: torch.Tensor) -> torch.Tensor:
        return self.storage[layer][self.slots][None]


@torch.no_grad()
def refresh_local_units(model, tokens: list[int], kv_storage: dict[int, torch.Tensor], slots: torch.Tensor,
                        state: LinearStates, plan: SelectionPlan, rows: list[torch.Tensor]) -> int:
    """wr for one sequence whose checkpoint covers `tokens` (KV in `slots`): overwrite the local rows of
    `state` (batch 1, in place) from a scratch replay of the last window tokens. Returns tokens replayed."""
    window = min(wr_window(plan), len(tokens))
    if window == 0:
        return 0
    start = len(tokens) - window
    scratch = model.empty_states(1)
    ids = torch.tensor(tokens[start:], dtype=torch.long)
    _, fresh = model(ids, BatchLayout((window,), (start,)), ReadOnlyKV(kv_storage, slots), scratch)
    for j, local in enumerate(rows):
        d_v = state.ssm[j].shape[-1]
        state.ssm[j].view(-1, d_v)[local] = fresh.ssm[j].view(-1, d_v)[local]
    return window
