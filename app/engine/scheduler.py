"""Continuous batching: which sequences feed which tokens this step, admission and preemption.

Each step: running sequences in decode feed one token each; running sequences in prefill get pieces
(chunked prefill) that end at the next checkpoint cut, the per-sequence chunk size or the step's remaining
token budget; then waiting sequences are admitted while state slots and budget remain. Every piece gets
fresh KV slots; when the pool is short the cache evicts unlocked tree leaves, then the scheduler preempts
the most recently admitted other sequence (its work is recomputed later). Nothing fails for lack of room.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from app.cache.pools import SlotAllocator
from app.cache.prefix_cache import PrefixCache
from app.engine.config import EngineConfig
from app.engine.request import ForkHold, Sequence, Status

# how far below a request's branch point a stored prompt end still counts as the prompt it branched from
# (telemetry: what a longer lookback would have served; beyond the largest lookback worth a checkpoint), and at
# most as far as the part shared above it: a prompt that shares only a short system prompt with a stored one
# does not ask for a lookback checkpoint in that prompt's first half
BRANCH_REACH = 512


class Work(NamedTuple):
    """seq feeds tokens[start:end] this step into `new_slots` [end - start]; with `draft` (speculative
    decoding), its last token and the drafts (end = start + 1 + len(draft)), to verify them."""

    seq: Sequence
    start: int
    end: int
    new_slots: torch.Tensor
    draft: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, cfg: EngineConfig, cache: PrefixCache, worker) -> None:
        self.cfg, self.cache, self.worker = cfg, cache, worker
        self.states = SlotAllocator(cfg.max_running)  # active-state slots; the worker holds their tensors
        self.loaded: list[Sequence] = []  # admitted from a checkpoint since the engine last looked (dasc wr)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.drafter = None  # speculative decoding: proposes drafts for decoding sequences (the engine sets it)
        self._draft_turn = 0  # which decoding sequence is offered the draft room first (turns each step)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[Work]:
        """The step's pieces. If a worker call raises meanwhile (loading a checkpoint into a state slot), the
        KV slots of the pieces planned so far go back to the pool and the sequence being admitted returns to
        the queue holding nothing; the sequences already running keep their places."""
        works: list[Work] = []
        try:
            self._plan(works)
        except BaseException:
            for w in works:
                self.cache.free_kv(w.new_slots)
            raise
        return works

    def _plan(self, works: list[Work]) -> None:
        budget = self.cfg.max_tokens_per_step
        decoding, prefilling = [], []
        for s in self.running:
            (decoding if s.num_computed >= s.num_tokens - 1 else prefilling).append(s)
        if decoding and len(decoding) <= budget:  # one token each (and drafts): one allocation for all of them
            drafts = self._drafts(decoding, budget)
            sizes = [1 + len(d) for d in drafts]
            slots = self.cache.alloc_kv(sum(sizes))
            if slots is None and sum(sizes) > len(decoding):  # no room for drafts: plain decoding
                drafts, sizes = [()] * len(decoding), [1] * len(decoding)
                slots = self.cache.alloc_kv(len(decoding))
            if slots is not None:
                pieces = (slots,) if len(sizes) == 1 else slots.split(sizes)
                works.extend(Work(seq, seq.num_computed, seq.num_computed + n, piece, d)
                             for seq, n, piece, d in zip(decoding, sizes, pieces, drafts))
                budget -= sum(sizes)
                decoding = []
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted by an earlier allocation this step
                continue
            work = self._piece(seq, budget, works)
            if work is not None:
                works.append(work)
                budget -= work.end - work.start
        while self.waiting and budget > 0 and self.states.num_free > 0:
            seq = self.waiting[0]
            if seq.fork_of is not None and not _fork_ready(seq):
                break
            self.waiting.popleft()
            try:
                self._admit(seq)
            except BaseException:
                self._requeue(seq)
                raise
            work = self._piece(seq, budget, works)
            if work is None:
                self.preempt(seq)
                break
            works.append(work)
            budget -= work.end - work.start

    def _drafts(self, decoding: list[Sequence], budget: int) -> list[tuple[int, ...]]:
        """Each decoding sequence's drafts: none beyond what its max_tokens leaves after the token it emits
        anyway, and all of them within the step's token budget (the room is offered to the sequences in turn);
        none when more than `spec_max_batch` sequences decode."""
        if self.drafter is None or len(decoding) > self.cfg.spec_max_batch:
            return [()] * len(decoding)
        room = budget - len(decoding)
        out = [()] * len(decoding)
        # the first pick of the room turns round the batch step by step, so every sequence gets its share
        first = self._draft_turn % len(decoding)
        self._draft_turn += 1
        for i in [*range(first, len(decoding)), *range(first)]:
            seq = decoding[i]
            limit = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
            out[i] = self.drafter.propose(seq, limit) if limit > 0 else ()
            room -= len(out[i])
        return self.drafter.select(decoding, out)

    def _piece(self, seq: Sequence, budget: int, scheduled: list[Work]) -> Work | None:
        end = seq.next_end(min(budget, self.cfg.chunk_size))
        slots = self._alloc(end - seq.num_computed, seq, scheduled)
        return None if slots is None else Work(seq, seq.num_computed, end, slots)

    def _alloc(self, n: int, for_seq: Sequence, scheduled: list[Work]) -> torch.Tensor | None:
        """n KV slots; preempts the latest-admitted other running sequence not yet scheduled this step."""
        busy = None  # built only when the pool runs short: per sequence it would make a step quadratic
        while True:
            slots = self.cache.alloc_kv(n)
            if slots is not None:
                return slots
            busy = busy or {id(w.seq) for w in scheduled} | {id(for_seq)}
            victims = [s for s in self.running if id(s) not in busy]
            if not victims:
                return None
            self.preempt(victims[-1])

    # ------------------------------------------------------------------ admission
    def _admit(self, seq: Sequence) -> None:
        """Match the cache, lock the shared prefix, load the checkpoint into a fresh state slot, plan cuts."""
        hold = seq.fork_of.fork if seq.fork_of is not None else None
        if hold is not None and hold.state_slot is not None and not seq.admitted_once:
            return self._admit_fork(seq, hold)
        tokens = seq.tokens
        limit = len(tokens) - 1  # at least one token is always computed, to produce logits
        if seq.params.prompt_logprobs is not None:  # resume only where the prompt's logprobs are collected
            limit = min(limit, seq.prompt_lp_upto)
        exact = self.cfg.checkpoint_settings.exact
        use_cache = (self.cfg.enable_cache or seq.fork_of is not None) and (exact or not seq.params.cache_lossless)
        salt = seq.params.cache_salt
        # a lossy checkpoint is loaded `tail` tokens further back, so that the units it omitted are rebuilt
        match = self.cache.match(tokens, max(0, limit - self.cfg.tail), salt) if use_cache else None
        if match is not None and match.host_len:  # a deeper checkpoint waits in the host tier: back to the pools
            match = self.cache.promote(tokens, max(0, limit - self.cfg.tail), salt, match)
        hit = match is not None and match.checkpoint_node is not None
        seq.state_slot = self.states.alloc(1)[0]
        if hit:
            seq.node, seq.num_computed = match.checkpoint_node, match.checkpoint_len
            seq.kv_slots = match.kv_slots.clone()
        else:
            seq.node, seq.num_computed = self.cache.root(salt), 0
            seq.kv_slots = torch.zeros(0, dtype=torch.long)
        self.cache.lock(seq.node)
        seq.num_shared = seq.num_computed
        # what the sequence holds is recorded above, so that `release` gives it all back if the worker raises
        if hit:
            self.worker.load(self.cache.load_checkpoint(seq.node), seq.state_slot)
            self.loaded.append(seq)
            seq.compressed_hit = seq.compressed_hit or not exact
        else:
            self.worker.zero(seq.state_slot)
        if not seq.admitted_once:
            seq.cached_len = min(seq.num_computed, seq.prompt_len)
            seq.replayed = max(0, min(match.kv_len, limit) - seq.num_computed) if match is not None else 0
            seq.lost = max(0, match.lost_len - seq.num_computed) if match is not None else 0
            seq.discarded = max(0, match.discarded_len - seq.num_computed - seq.lost) if match is not None else 0
            if match is not None and match.kv_len < limit and not seq.lost and \
                    seq.replayed >= self.cfg.checkpoint_min_gap:  # it branched and replays the shared part: how far
                seq.branch_back = self.cache.branch_back(match, min(BRANCH_REACH, match.kv_len))  # before its end
            seq.admitted_once = True
        seq.cuts = self._plan_cuts(seq, match)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _admit_fork(self, seq: Sequence, hold: ForkHold) -> None:
        """A sample of an n > 1 request starts from its leader's exact state at the fork point; the last one
        takes the held slot itself."""
        last = hold.waiting == 1
        seq.state_slot = hold.state_slot if last else self.states.alloc(1)[0]
        seq.node, seq.num_computed, seq.kv_slots = hold.node, hold.pos, hold.kv_slots.clone()
        self.cache.lock(seq.node)
        seq.num_shared = seq.cached_len = hold.pos
        seq.compressed_hit = seq.fork_of.compressed_hit
        if not last:
            self.worker.copy_state(hold.state_slot, None, seq.state_slot)  # if it raises, the caller requeues
        hold.waiting -= 1
        if last:
            hold.state_slot = None
            self.cache.unlock(hold.node)
        seq.admitted_once = True
        seq.cuts = self._plan_cuts(seq, None)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def hold_fork(self, leader: Sequence, pos: int, snapshot_at: int | None) -> None:
        """The leader just stored its fork checkpoint at `pos` (its node and KV are in the tree): keep an exact
        copy of the state there for its samples, if an active-state slot is free (else they start from the
        checkpoint like any other hit)."""
        if leader.fork is not None or self.states.num_free == 0:
            return
        slot = self.states.alloc(1)[0]
        try:
            self.worker.copy_state(leader.state_slot, snapshot_at, slot)
        except BaseException:
            self.states.free([slot])
            raise
        self.cache.lock(leader.node)
        leader.fork = ForkHold(leader.node, pos, leader.kv_slots[:pos].clone(), slot, leader.params.n - 1)

    def drop_fork(self, leader: Sequence) -> None:
        """The request ended before every sample started: free the held state and unlock its node."""
        hold = leader.fork
        if hold is not None and hold.state_slot is not None:
            self.states.free([hold.state_slot])
            self.cache.unlock(hold.node)
            hold.state_slot = None

    def _plan_cuts(self, seq: Sequence, match) -> dict[int, str]:
        """Checkpoint positions ahead of num_computed within the prompt: intervals, the branch points (where
        the KV match ends, and a stateless fork on the matched path; each unless the loaded checkpoint is
        fewer than `checkpoint_min_gap` tokens above it), the prompt end (admission permitting), a lookback
        checkpoint at least `lookback` tokens before the prompt end (so that the next prompt sharing all of this
        one but its last tokens, a new few-shot header's next query, resumes there), the request's own
        `checkpoint_at` positions (where its next turn's prompt leaves this one: "resend") and, for n > 1,
        the fork point of the request's own samples. A prompt end fewer than `checkpoint_min_gap` tokens above
        the checkpoint the request loaded or the last cut before it is not stored: a repeat replays those few
        tokens from there (the prompts that share a header and differ in a short query do not each fill a slot
        with a checkpoint only an exact repeat could use). Under a recompute tail (`EngineConfig.tail`) the branch
        and prompt-end checkpoints sit `tail` tokens earlier, where a later request's lossy load may use them."""
        cuts: dict[int, str] = {}
        prompt_end = seq.prompt_len - 1
        if self.cfg.enable_cache:
            if self.cfg.interval:
                first = (seq.num_computed // self.cfg.interval + 1) * self.cfg.interval
                cuts.update({p: "interval" for p in range(first, prompt_end + 1, self.cfg.interval)})
            if match is not None:  # under a tail, `tail` tokens before the branch: where a later request loads
                # (a match of the whole prompt branches at its end: `tail` before the prompt's last token, as below)
                for pos in (match.fork_len - self.cfg.tail, min(match.kv_len, prompt_end) - self.cfg.tail):
                    if pos > 0 and seq.num_computed + self.cfg.checkpoint_min_gap <= pos <= prompt_end:
                        cuts[pos] = "branch"
            salt = seq.params.cache_salt
            at = prompt_end - self.cfg.tail  # where a repeat of this prompt can load it (see `_admit`)
            below = max([seq.num_computed, *(p for p in cuts if p <= at)])  # loaded, or cut last before `at`
            gap = self.cfg.checkpoint_min_gap if below and not seq.params.warm else 0
            # a warm request is sent for its prompt end: stored however close, whatever the admission policy
            if at > below + max(0, gap - 1) and \
                    (seq.params.warm or self.cache.admit_prompt_end(seq.prompt_ids[:at], salt)):
                cuts[at] = "prompt_end"
            for pos in seq.params.checkpoint_at:  # where the next turn leaves this prompt (`SamplingParams`)
                if below < pos < at and self.cache.admit_prompt_end(seq.prompt_ids[:pos], salt):
                    cuts.setdefault(pos, "resend")
            if self.cfg.lookback:  # where a prompt that differs only in its last lookback tokens resumes
                align = self.cfg.lookback_align
                pos = (at - self.cfg.lookback) // align * align
                if pos > below + max(0, gap - 1) and self.cache.admit_prompt_end(seq.prompt_ids[:pos], salt):
                    cuts[pos] = "lookback"
        if seq.params.n > 1 and seq.index == 0 and prompt_end > seq.num_computed:
            cuts[prompt_end] = "fork"
        return {p: k for p, k in cuts.items() if p > seq.num_computed}

    # ------------------------------------------------------------------ release
    def preempt(self, seq: Sequence) -> None:
        """Give back everything the sequence holds; it returns to the front of the queue to recompute."""
        self._requeue(seq)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self.release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.kv_slots = torch.zeros(0, dtype=torch.long)
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Free private KV, unlock the shared prefix, free the state slot, leave the running list."""
        if seq in self.running:
            self.running.remove(seq)
        if len(seq.kv_slots) > seq.num_shared:
            self.cache.free_kv(seq.kv_slots[seq.num_shared :])
        seq.kv_slots = seq.kv_slots[: seq.num_shared]
        if seq.node is not None:
            self.cache.unlock(seq.node)
            seq.node = None
        if seq.state_slot is not None:
            self.states.free([seq.state_slot])
            seq.state_slot = None

    def private_slots(self) -> list[torch.Tensor]:
        return [s.kv_slots[s.num_shared :] for s in self.running]

    def check_integrity(self, fork_slots: list[int] = ()) -> None:
        """Every active-state slot is held by one running sequence or one held fork state (`fork_slots`), or
        free, exactly once; a waiting sequence holds nothing."""
        held = [s.state_slot for s in self.running] + list(fork_slots)
        free = self.states.free_ids()
        assert None not in held, "running sequence without a state slot"
        assert len(held) == len(set(held)), "state slot held twice"
        assert not set(held) & set(free), "state slot both held and free"
        assert len(held) + len(free) == self.states.capacity, "state slot leaked"
        for s in self.waiting:
            assert s.state_slot is None and s.node is None and not len(s.kv_slots), "waiting sequence holds slots"


def _fork_ready(seq: Sequence) -> bool:
    """A fork child may start once its leader has computed the prompt up to the fork point (or ended)."""
    leader = seq.fork_of
    return leader.is_finished or leader.num_computed >= leader.prompt_len - 1
