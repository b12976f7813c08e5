"""`DecodeInputs.write` keeps its rows across steps and writes only a row's newest KV slot when the row held the
same sequence's history at the previous step: the buffers must always equal those a fresh write gives."""

from __future__ import annotations

import numpy as np
import torch

from app.engine.decode_inputs import DecodeInputs
from app.engine.request import SamplingParams, Sequence
from app.engine.step_batch import StepBatch

FILL, SCRATCH, B, S = 999, 7, 4, 16


def _seq(name: str, slots: list[int]) -> Sequence:
    seq = Sequence(name, 0, [1, 2, 3], SamplingParams(max_tokens=8))
    seq.kv_slots = torch.tensor(slots, dtype=torch.long)
    return seq


def _batch(seqs: list[Sequence], new: list[int]) -> StepBatch:
    n = len(seqs)
    return StepBatch([5] * n, (1,) * n, tuple(len(s.kv_slots) for s in seqs), [s.kv_slots for s in seqs],
                     [torch.tensor([x]) for x in new], list(range(n)), list(range(n)), (), (True,) * n,
                     history_keys=tuple(s.kv_key for s in seqs))


def _check(kept: DecodeInputs, batch: StepBatch) -> None:
    fresh = DecodeInputs(B, S, FILL, SCRATCH, torch.device("cpu"))
    kept.write(batch)
    fresh.write(batch)
    assert torch.equal(kept.head, fresh.head)
    assert torch.equal(kept.kv_read, fresh.kv_read)


def _decode(seqs: list[Sequence], new: list[int]) -> None:
    """What the engine does after a step: each sequence's new slot joins its history."""
    for seq, slot in zip(seqs, new):
        seq.append_kv(torch.tensor([slot]))


def test_kept_rows_equal_a_fresh_write_through_every_change_a_row_can_see():
    kept = DecodeInputs(B, S, FILL, SCRATCH, torch.device("cpu"))
    a, b, c = _seq("a", [10, 11, 12, 13, 14]), _seq("b", [20, 21, 22]), _seq("c", [30])
    _check(kept, _batch([a, b, c], [15, 23, 31]))
    _decode([a, b, c], [15, 23, 31])
    _check(kept, _batch([a, b, c], [16, 24, 32]))  # (the first append moved each history to a roomier buffer)
    _decode([a, b, c], [16, 24, 32])
    assert [held for held, _ in kept._rows[:3]] == [a.kv_key, b.kv_key, c.kv_key]
    _check(kept, _batch([a, b, c], [17, 25, 33]))  # each row continues: one slot written per row
    _decode([a, b, c], [17, 25, 33])
    _check(kept, _batch([b, a, c], [26, 18, 34]))  # rows change hands
    _decode([b, a, c], [26, 18, 34])
    a.kv_slots = torch.tensor([40, 41, 42, 43, 44, 45, 46, 47, 48])  # replaced (a checkpoint store): a new key
    _check(kept, _batch([b, a, c], [27, 49, 35]))
    _decode([b, a, c], [27, 49, 35])
    _decode([c], [90])  # a step of c's in another bucket (a longer history): its row here is a step behind
    _check(kept, _batch([b, a, c], [28, 50, 36]))
    _check(kept, _batch([c], [37]))  # the batch shrinks: the rows past it hold padding again
    d = _seq("d", list(range(100, 114)))  # grows past its buffer's end while in a row: a new buffer, a new key
    _check(kept, _batch([d], [114]))
    _decode([d], [114])
    assert d.kv_key is not None and len(d.kv_slots) == 15
    _check(kept, _batch([d], [115]))


def test_a_key_is_the_sequence_buffer_and_changes_whenever_its_prefix_may():
    seq = _seq("a", [1, 2, 3])  # a buffer of exactly its slots: the first append moves it to a roomier one
    first = seq.kv_key
    seq.append_kv(torch.tensor([4]))
    key = seq.kv_key
    assert key is not first
    seq.append_kv(torch.tensor([5]))
    assert seq.kv_key is key and seq.kv_slots.tolist() == [1, 2, 3, 4, 5]  # grown at its end only
    seq.kv_slots = torch.tensor([1, 2, 9, 4, 5])
    assert seq.kv_key is not key
    grown = seq.kv_key
    seq.append_kv(torch.tensor(np.arange(200)))
    assert seq.kv_key is not grown and seq.kv_slots[:4].tolist() == [1, 2, 9, 4]
