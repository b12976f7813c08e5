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
from app.dasc.selection import SelectionPlan
from app.models.batch import BatchLayout, LinearStates, host_to_device

POLICIES = ("nr", "wr")


def unit_window(horizon: float, w_max: float) -> int:
    """clamp(pow2ceil(H_s), 4, W_max) for one local unit (a horizon >= W_max, even inf, gives W_max)."""
    if horizon >= w_max:
        return int(w_max)
    return int(min(max(_pow2ceil(horizon), 4), w_max))


def _pow2ceil(x: float) -> int:
    """Smallest power of two >= x (1 for x <= 1), exact: frexp gives x = m * 2**e with 0.5 <= m < 1."""
    if x <= 1:
        return 1
    m, e = math.frexp(x)
    return 2 ** (e - 1) if m == 0.5 else 2**e


def wr_window(plan: SelectionPlan) -> int:
    """Replay length of wr: the longest unit_window over omitted units; 0 when nothing is omitted."""
    window = 0
    for lp in plan.layers:
        keep = set(lp.keep)
        window = max([window] + [unit_window(h, plan.w_max) for u, h in enumerate(lp.horizons) if u not in keep])
    return window


def local_rows(plan: SelectionPlan, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per layer, the rows of the [H * d_k, d_v] state view that the plan omits (index tensors on `device`)."""
    out = []
    for lp in plan.layers:
        mask = torch.ones(lp.heads * lp.d_k, dtype=torch.bool, device=device)
        mask[retained_rows(lp, device)] = False
        out.append(torch.nonzero(mask).flatten())
    return out


class ReadOnlyKV:
    """`AttentionKV` over cached history only: replayed windows attend to the cached entries of their
    prefixes (sequence i: positions [0, len(slots[i]))) and write nothing."""

    def __init__(self, storage: dict[int, torch.Tensor], slots: list[torch.Tensor]) -> None:
        device = next(iter(storage.values())).device if storage else torch.device("cpu")
        self.storage, self.slots = storage, [host_to_device(s, device) for s in slots]

    def extend(self, layer: int, seq: int, entries: torch.Tensor) -> torch.Tensor:
        return self.storage[layer][self.slots[seq]]

    def extend_padded(self, layer: int, seqs: list[int], entries: torch.Tensor,
                      counts: list[int] | None = None) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence([self.storage[layer][self.slots[s]] for s in seqs], batch_first=True)


@torch.no_grad()
def refresh_local_units(model, prefixes: list[list[int]], kv_storage: dict[int, torch.Tensor],
                        slots: list[torch.Tensor], states: LinearStates, plan: SelectionPlan,
                        rows: list[torch.Tensor]) -> int:
    """wr for a batch of sequences whose checkpoints cover `prefixes` (KV in `slots`): overwrite the local rows
    of `states` (batch B, in place) from scratch replays of each prefix's last window tokens, run as one batch.
    Returns the tokens replayed."""
    window = wr_window(plan)
    if window == 0 or not prefixes:
        return 0
    lens = [min(window, len(p)) for p in prefixes]
    starts = [len(p) - n for p, n in zip(prefixes, lens)]
    ids = host_to_device([t for p, s in zip(prefixes, starts) for t in p[s:]], states.ssm[0].device)
    _, fresh = model(ids, BatchLayout(tuple(lens), tuple(starts)), ReadOnlyKV(kv_storage, slots),
                     model.empty_states(len(prefixes)))
    for j, local in enumerate(rows):
        b, d_v = states.ssm[j].shape[0], states.ssm[j].shape[-1]
        states.ssm[j].view(b, -1, d_v)[:, local] = fresh.ssm[j].view(b, -1, d_v)[:, local]
    return sum(lens)
