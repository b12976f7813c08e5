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
    # per sequence: what identifies its `history` buffer across steps (`Sequence.kv_key`), so that a persistent
    # input row written from it at the previous step is known to need only the newest slot (`DecodeInputs`)
    history_keys: tuple = ()


def step_inputs(works: list, keep_logits: bool = False) -> StepBatch:
    """The forward of a step's pieces (`scheduler.Work`s): logits wanted for the pieces that reach the end of
    their sequence's token stream (and every row of a verify piece), greedy picks for those whose sequence needs
    nothing but the argmax (`Sequence.greedy_only`, unless `keep_logits`), every row for prompt logprobs, state
    snapshots at the checkpoint cuts strictly inside a piece."""
    tokens: list[int] = []
    want, greedy, every, verify, snaps = [], [], [], [], []
    for i, w in enumerate(works):
        seq = w.seq
        if w.draft:
            tokens += seq.token_range(w.start, w.start + 1)
            tokens += w.draft
            verify.append(i)
        else:
            tokens += seq.token_range(w.start, w.end)
        if (w.draft or w.end == seq.num_tokens) and seq.params.max_tokens > 0:
            want.append(i)
            greedy.append(seq.greedy_only and not keep_logits)
        if seq.params.prompt_logprobs is not None and w.start + 1 < seq.prompt_len:
            every.append(i)
        if seq.cuts:
            inside = tuple(sorted(p - w.start for p in seq.cuts if w.start < p < w.end))
            if inside:
                snaps.append((i, inside))
    snapshots = ()
    if snaps:
        at = dict(snaps)
        snapshots = tuple(at.get(i, ()) for i in range(len(works)))
    return StepBatch(tokens, tuple(w.end - w.start for w in works), tuple(w.start for w in works),
                     [w.seq.kv_slots for w in works], [w.new_slots for w in works], [w.seq.state_slot for w in works],
                     want, snapshots, tuple(greedy), tuple(every), tuple(verify),
                     tuple(w.seq.kv_key for w in works))


def split_rows(works: list, batch: StepBatch, tokens: list[int], logits: torch.Tensor) -> tuple[dict, dict]:
    """The worker's answer per sequence (keyed by id(seq)): greedy picks (an int; a verify piece's: a list of
    its rows' argmax) and raw next-token logits ([V], or a verify piece's [n, V])."""
    picked, raw, t, r = {}, {}, 0, 0
    for i, g in zip(batch.want_logits, batch.greedy):
        w = works[i]
        n = w.end - w.start if w.draft else 0
        if g:
            picked[id(w.seq)] = tokens[t : t + n] if n else tokens[t]
            t += max(n, 1)
        else:
            raw[id(w.seq)] = logits[r : r + n] if n else logits[r]
            r += max(n, 1)
    return picked, raw
