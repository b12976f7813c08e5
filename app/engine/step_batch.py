"""`StepBatch`: what one forward of the worker takes (the scheduler's step, in slot ids and tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    """One forward: sequence i feeds token_ids[offsets[i]:offsets[i+1]] at positions cached_lens[i]...,
    reads KV `history[i]`, writes `new_slots[i]`, carries state slot `state_slots[i]`; logits come back for
    the sequences listed in `want_logits` (their last token), or only the argmax token for those `greedy`
    marks. States after `snapshots[i]` tokens of a piece are kept until the next run, for `store_snapshot`.
    `every_row` sequences (prompt logprobs) also get their piece's every position's logits, kept by the worker
    in `piece_logits` until the next run. A `verify` piece's rows all come back, in order, where its entry of
    `want_logits` would."""

    token_ids: list[int]
    extend_lens: tuple[int, ...]
    cached_lens: tuple[int, ...]
    history: list[torch.Tensor]
    new_slots: list[torch.Tensor]
    state_slots: list[int]
    want_logits: list[int]
    snapshots: tuple[tuple[int, ...], ...] = ()  # per sequence: offsets inside its piece to keep states at
    greedy: tuple[bool, ...] = ()  # per want_logits entry: only its argmax token is needed
    every_row: tuple[int, ...] = ()  # sequences whose logits at every position of the piece are wanted too
    # speculative verify pieces (the last token and k >= 1 drafts): every row of theirs comes back in the want
    # order (argmax tokens or logits, as `greedy` marks the piece), and their states wait for `Worker.rollback`
    verify: tuple[int, ...] = ()
