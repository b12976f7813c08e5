"""Where a step leaves checkpoints: the engine's bookkeeping of storing states into the prefix cache.

Checkpoints are stored at prefill cuts (interval, branch, prompt end, fork), at aligned intervals during
decode, and at the end of generation (so the next conversation turn hits). Storing one inserts the sequence's
KV up to that position into the radix tree, so the checkpoint always has its KV. A step that passes no cut
costs one comparison per sequence here.
"""

from __future__ import annotations

import torch

from app.cache.prefix_cache import PrefixCache
from app.engine.config import EngineConfig
from app.engine.request import Sequence, Status


class Checkpointing:
    def __init__(self, cfg: EngineConfig, cache: PrefixCache, worker, scheduler) -> None:
        self.cfg, self.cache, self.worker, self.scheduler = cfg, cache, worker, scheduler

    def after_piece(self, seq: Sequence, start: int) -> None:
        """Store the checkpoints of the cuts a piece [start, num_computed) passed: inside the piece from the
        worker's snapshots, at its end from the state itself; and the last aligned decode interval the piece
        reached (a verify piece can pass one inside: its state there comes from the piece's rollback record)."""
        end = seq.num_computed
        if seq.cuts:
            for pos in sorted(p for p in seq.cuts if start < p <= end):
                kind, at = seq.cuts.pop(pos), None if pos == end else pos - start
                self.store(seq, pos, kind, snapshot_at=at)
                if kind == "fork":
                    self.scheduler.hold_fork(seq, pos, at)
        interval = self.cfg.interval
        if interval and self.cfg.enable_cache:
            pos = end - end % interval
            if start < pos and pos >= seq.prompt_len and seq.num_shared < pos and not self.close_behind(seq, pos):
                self.store(seq, pos, "interval", snapshot_at=None if pos == end else pos - start)

    def at_finish(self, seq: Sequence) -> None:
        """The generation-end checkpoint of a sequence that ends now (so that the next turn of a conversation
        resumes where this one stopped), unless a checkpoint sits just behind it and the output is not one a
        later prompt resumes (`SamplingParams.output_resumed`)."""
        if (self.cfg.enable_cache and self.cfg.store_generation_end and seq.status is Status.RUNNING
                and seq.num_computed > seq.num_shared
                and (seq.params.output_resumed or not self.close_behind(seq))):
            self.store(seq, seq.num_computed, "generation_end")

    def store(self, seq: Sequence, pos: int, kind: str, snapshot_at: int | None = None) -> None:
        """Insert the sequence's KV up to `pos` into the tree and store a checkpoint there: its current state,
        or the state the last step captured `snapshot_at` tokens into its piece."""
        res = self.cache.insert(seq.tokens[:pos], seq.kv_slots[:pos], seq.params.cache_salt)
        self.cache.lock(res.node)
        self.cache.unlock(seq.node)
        seq.node, seq.num_shared = res.node, pos
        seq.kv_slots = torch.cat([res.slots, seq.kv_slots[pos:]])
        slot, worker = seq.state_slot, self.worker
        if snapshot_at is None:
            self.cache.store_checkpoint(res.node, lambda ckpt: worker.store(slot, ckpt), kind)
        else:
            self.cache.store_checkpoint(res.node, lambda ckpt: worker.store_snapshot(slot, snapshot_at, ckpt), kind)

    def close_behind(self, seq: Sequence, pos: int | None = None) -> bool:
        """Whether the sequence's deepest tree node holds a checkpoint fewer than `checkpoint_min_gap` tokens
        behind `pos` (default: its end): then a generation-end or decode-interval checkpoint would nearly
        duplicate it (a one-token answer would store two almost equal states per request; a prompt ending just
        before an interval position, two within one token) and a later request replays those few tokens
        instead."""
        pos = seq.num_computed if pos is None else pos
        return (seq.node is not None and seq.node.checkpoint is not None
                and pos - seq.num_shared < self.cfg.checkpoint_min_gap)
