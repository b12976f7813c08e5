"""The Engine facade: add requests, step, generate; it runs without Ray.

One step = schedule -> run the model on every piece -> store checkpoints at cuts -> sample -> finish.
Checkpoints are stored at prefill cuts (interval, branch, prompt end, fork), at aligned intervals during
decode, and at the end of generation (so the next conversation turn hits). Storing one inserts the
sequence's KV up to that position into the radix tree, so the checkpoint always has its KV.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import torch

from app.cache.checkpoint import CheckpointCodec, CheckpointPool, DenseCodec
from app.cache.policy import FlopAwareSelect, lru_select
from app.cache.pools import KVSlots
from app.cache.prefix_cache import PrefixCache
from app.engine.config import EngineConfig
from app.engine.grammar import JsonGrammars
from app.engine.grammar import for_tokenizer as grammars_for
from app.engine.logits import needs_processing
from app.engine.picks import collect_prompt_logprobs, greedy_tokens, output_logprobs, processed, row_logprobs, sample
from app.engine.request import RequestOutput, SamplingParams, Sequence, Status
from app.engine.scheduler import Scheduler, Work
from app.engine.speculative import NgramDrafter, accept
from app.engine.step_batch import StepBatch
from app.engine.telemetry import Telemetry
from app.engine.worker import Worker
from app.models.hybrid import HybridForCausalLM
from app.models.tokenizer import Tokenizer


class Engine:
    def __init__(self, model: HybridForCausalLM, tokenizer: Tokenizer, cfg: EngineConfig | None = None,
                 codec: CheckpointCodec | None = None, worker=None) -> None:
        """`worker`: a `Worker` or a TP group with the same verbs; by default an in-process Worker."""
        cfg = cfg or EngineConfig()
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.worker = worker or Worker(model, cfg, codec)
        self.cache = PrefixCache(KVSlots(cfg.kv_slots), self._pool(), cfg.admission, self._select(cfg))
        self.scheduler = Scheduler(cfg, self.cache, self.worker)
        self.scheduler.drafter = NgramDrafter(cfg) if cfg.spec == "ngram" else None
        self.telemetry = Telemetry()
        self.max_model_len = cfg.max_model_len or _model_len(model)
        self._ids = itertools.count()
        self._seqs: dict[str, list[Sequence]] = {}
        self.keep_logits = False  # True: greedy rows come back as logits too (tests that compare logits)

    @property
    def codec(self) -> CheckpointCodec:
        return self.worker.codec

    @property
    def plan(self):
        return self.worker.plan

    def _pool(self) -> CheckpointPool:
        return CheckpointPool(self.worker.codec.bytes_per_slot, self.worker.physical)

    def _select(self, cfg: EngineConfig):
        if cfg.eviction == "lru":
            return lru_select
        return FlopAwareSelect(*_flops_per_token(self.model), self.worker.codec.bytes_per_slot, cfg.flop_alpha)

    def retune(self, **changes) -> None:
        """Apply new knobs between steps: flat `EngineConfig` fields (w_max, policy, quant, layout, selector,
        interval, ...).

        A change of `cfg.checkpoint_settings` (what a checkpoint holds, or the pool's size) drops every stored
        checkpoint and rebuilds the pool (KV pages stay): one pool never mixes layouts. Any other change, a
        policy change included, keeps the checkpoints. Running sequences keep their active states."""
        new = replace(self.cfg, **changes)
        if new.checkpoint_settings != self.cfg.checkpoint_settings:
            self.cache.tree.drop_checkpoints()
            self.worker.configure_checkpoints(new)
            self.cache.checkpoints = self._pool()
            self.cache.select = self._select(new)
        else:
            self.worker.set_policy(new.policy)
        self.cfg = self.scheduler.cfg = new
        self.cache.admission = new.admission

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this engine cannot serve (reads no mutable state)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.model.config.vocab_size:
            raise ValueError("prompt token ids must be in [0, vocab_size)")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")
        if len(prompt_ids) + params.max_tokens > self.cfg.kv_slots:
            raise ValueError(f"request needs more KV than the engine holds ({self.cfg.kv_slots} tokens)")
        if params.guided_json is not None:  # compiled here, in the caller's thread, not in a step
            self.grammars.compile(params.guided_json)

    @property
    def grammars(self) -> JsonGrammars:
        """Structured output's compiled grammars over this engine's tokenizer and logits width (shared; made at
        the first request with a grammar)."""
        return grammars_for(self.tokenizer, self.model.config.vocab_size)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; raises ValueError for inputs the engine cannot serve. Atomic: everything that can
        raise (validation, the sequences' generators) runs before the request enters the engine's state, so a
        request that fails here leaves nothing behind."""
        self.validate(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id}")
        seqs = [Sequence(request_id, i, list(prompt_ids), params) for i in range(params.n)]
        for seq in seqs:
            seq.generator = _generator(params.seed, seq.index)
            seq.fork_of = seqs[0] if seq.index > 0 else None
        for seq in seqs:
            self.scheduler.add(seq)
        self._seqs[request_id] = seqs
        return request_id

    def abort(self, request_id: str) -> None:
        seqs = self._seqs.get(request_id, [])
        for seq in seqs:
            if not seq.is_finished:
                if seq in self.scheduler.waiting:
                    self.scheduler.waiting.remove(seq)
                self._finish(seq, "abort", store=False)
        if seqs:
            self.scheduler.drop_fork(seqs[0])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def unstarted(self) -> list[str]:
        """Requests none of whose sequences has been scheduled yet (still queued): what a bounded queue counts
        and a queue timeout may abort. Samples of n > 1 start after their leader, so the leader tells."""
        return [rid for rid, seqs in self._seqs.items() if not seqs[0].admitted_once]

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One step. If it raises (a device fault, a dead TP rank), nothing leaks: the KV slots allocated for
        the step's pieces go back to the pool, and the requests that had a piece in it are aborted, as their
        states may be half-written (`_drop_failed_step`); the other requests stay queued. Then it re-raises."""
        t0 = time.perf_counter()
        works = self.scheduler.schedule()
        try:
            outputs = self._step(works)
        except BaseException:
            self._drop_failed_step(works)
            raise
        if works:
            self.telemetry.step_cost.add(sum(w.end - w.start for w in works), time.perf_counter() - t0)
        return outputs

    def _drop_failed_step(self, works: list[Work]) -> None:
        for w in works:
            if w.seq.num_computed == w.start:  # the piece's slots were never attached to the sequence
                self.cache.free_kv(w.new_slots)
        for request_id in dict.fromkeys(w.seq.request_id for w in works):
            self.abort(request_id)

    def _step(self, works: list[Work]) -> list[RequestOutput]:
        loaded, self.scheduler.loaded = self.scheduler.loaded, []
        self._refresh_loaded([s for s in loaded if s.state_slot is not None])
        if not works:
            return []
        for w in works:
            if not w.seq.counted:
                self.telemetry.on_admit(w.seq)
                w.seq.counted = True
        picked, raw = self.run_works(works)
        guided = any(w.seq.params.guided_json is not None for w in works)
        verified = self._verify([w for w in works if w.draft], picked, raw, guided)
        plain = [w for w in works if not w.draft]
        logits = processed(plain, raw, self.tokenizer.stop_token_ids, self.grammars if guided else None)
        picked.update(greedy_tokens(plain, logits))
        picked.update(sample([w.seq for w in plain if id(w.seq) in logits and id(w.seq) not in picked], logits))
        logprobs = output_logprobs([w.seq for w in plain if id(w.seq) in picked and w.seq.params.logprobs is not None],
                                   raw, picked)
        self.telemetry.steps += 1
        outputs = []
        for w in works:
            seq = w.seq
            if w.draft:
                outputs.append(self._settle_verified(w, *verified[id(seq)]))
                continue
            seq.num_computed = w.end
            seq.kv_slots = torch.cat([seq.kv_slots, w.new_slots])
            self._checkpoint_after(seq, w.start)
            if id(seq) in picked:
                outputs.append(self._append_token(seq, picked[id(seq)], logprobs.get(id(seq))))
            elif seq.params.max_tokens == 0 and seq.num_computed == seq.num_tokens:  # the prompt's logprobs only
                self._finish(seq, "length", store=True)
                outputs.append(RequestOutput(seq.request_id, seq.index, [], "", "", True, "length", seq.prompt_len,
                                             seq.cached_len, [], None, prompt_logprobs=[None, *seq.prompt_lps],
                                             compressed_hit=seq.compressed_hit))
        return outputs

    def _checkpoint_after(self, seq: Sequence, start: int) -> None:
        """Store the checkpoints of the cuts this step passed: inside the piece from the worker's snapshots,
        at its end from the state itself; and the last aligned decode interval the piece reached (a verify
        piece can pass one inside: its state there comes from the piece's rollback record)."""
        end = seq.num_computed
        for pos in sorted(p for p in seq.cuts if start < p <= end):
            kind, at = seq.cuts.pop(pos), None if pos == end else pos - start
            self._store(seq, pos, kind, snapshot_at=at)
            if kind == "fork":
                self.scheduler.hold_fork(seq, pos, at)
        if self.cfg.enable_cache and self.cfg.interval:
            pos = end - end % self.cfg.interval
            if (start < pos and pos >= seq.prompt_len and seq.num_shared < pos
                    and not self._checkpoint_close_behind(seq, pos)):
                self._store(seq, pos, "interval", snapshot_at=None if pos == end else pos - start)

    def _store(self, seq: Sequence, pos: int, kind: str, snapshot_at: int | None = None) -> None:
        """Insert the sequence's KV up to `pos` into the tree and store a checkpoint there: its current state,
        or the state the last step captured `snapshot_at` tokens into its piece."""
        res = self.cache.insert(seq.tokens[:pos], seq.kv_slots[:pos], seq.params.cache_salt)
        self.cache.lock(res.node)
        self.cache.unlock(seq.node)
        seq.node, seq.num_shared = res.node, pos
        seq.kv_slots = torch.cat([res.slots, seq.kv_slots[pos:]])
        slot = seq.state_slot
        if snapshot_at is None:
            self.cache.store_checkpoint(res.node, lambda ckpt: self.worker.store(slot, ckpt), kind)
        else:
            self.cache.store_checkpoint(res.node, lambda ckpt: self.worker.store_snapshot(slot, snapshot_at, ckpt),
                                        kind)

    def _checkpoint_close_behind(self, seq: Sequence, pos: int | None = None) -> bool:
        """Whether the sequence's deepest tree node holds a checkpoint fewer than `checkpoint_min_gap` tokens
        behind its end: then a generation-end or decode-interval checkpoint would nearly duplicate it (a
        one-token answer would store two almost equal states per request; a prompt ending just before an
        interval position, two within one token) and a later request replays those few tokens instead."""
        pos = seq.num_computed if pos is None else pos
        return (seq.node is not None and seq.node.checkpoint is not None
                and pos - seq.num_shared < self.cfg.checkpoint_min_gap)

    def _append_token(self, seq: Sequence, token: int, logprobs=None, finish: bool = True) -> RequestOutput:
        """Record a sampled token and decide whether the sequence is done. Text grows incrementally (the
        token's bytes through the sequence's UTF-8 decoder), so each token costs the same however long the
        output already is; stop strings are searched only where a new match can start."""
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.decoder = self.tokenizer.incremental_decoder()
        seq.output_ids.append(token)
        p = seq.params
        reason = None
        stops = p.stop_token_ids + (() if p.ignore_eos else self.tokenizer.stop_token_ids)
        before = len(seq.decoded)
        early = len(seq.output_ids) <= p.min_tokens  # min_tokens: no stop yet (the ids were masked too)
        if token in stops and not early:
            reason = "stop"
        else:
            seq.decoded += seq.decoder.push(token)
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            seq.decoded += seq.decoder.flush()
        hits = [] if early else [i for s in p.stop if (i := seq.decoded.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            seq.decoded, reason = seq.decoded[: min(hits)], "stop"
        text = seq.decoded
        if reason is None:  # hold back what may still become a stop string
            hold = max((len(s) - 1 for s in p.stop), default=0)
            text = text[: len(text) - hold] if hold else text
        delta = text[len(seq.text):] if len(text) > len(seq.text) else ""
        seq.text += delta
        if reason is not None and finish:  # (a verify piece finishes after its rollback: `_settle_verified`)
            self._finish(seq, reason, store=True)
        prompt_lps = None
        if len(seq.output_ids) == 1 and seq.index == 0 and p.prompt_logprobs is not None:
            prompt_lps = [None, *seq.prompt_lps]
        return RequestOutput(seq.request_id, seq.index, [token], delta, seq.text, reason is not None, reason,
                             seq.prompt_len, seq.cached_len, list(seq.output_ids) if reason else [],
                             seq.first_token_time - seq.arrival, new_logprobs=None if logprobs is None else [logprobs],
                             prompt_logprobs=prompt_lps, compressed_hit=seq.compressed_hit)

    def _finish(self, seq: Sequence, reason: str, store: bool) -> None:
        seq.finish_reason, seq.finish_time = reason, time.perf_counter()
        if (store and self.cfg.enable_cache and self.cfg.store_generation_end and seq.status is Status.RUNNING
                and seq.num_computed > seq.num_shared and not self._checkpoint_close_behind(seq)):
            self._store(seq, seq.num_computed, "generation_end")
        self.scheduler.release(seq)
        seq.status = Status.FINISHED
        if seq.admitted_once:
            self.telemetry.on_finish(seq)
        if all(s.is_finished for s in self._seqs.get(seq.request_id, [])):
            self._seqs.pop(seq.request_id, None)

    def run_works(self, works: list[Work]) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """One forward for the step's pieces. For pieces that reach the end of their sequence's token stream:
        greedy picks made beside the logits (unless `keep_logits`, or the request wants logprobs), and next-token
        logits for the others, both keyed by id(seq)."""
        want = [i for i, w in enumerate(works)
                if (w.draft or w.end == w.seq.num_tokens) and w.seq.params.max_tokens > 0]
        every = tuple(i for i, w in enumerate(works)
                      if w.seq.params.prompt_logprobs is not None and w.start + 1 < w.seq.prompt_len)
        greedy = tuple(works[i].seq.params.temperature <= 0 and works[i].seq.params.logprobs is None
                       and not needs_processing(works[i].seq.params) and not self.keep_logits for i in want)
        snaps = tuple(tuple(sorted(p - w.start for p in w.seq.cuts if w.start < p < w.end)) for w in works)
        verify = tuple(i for i, w in enumerate(works) if w.draft)
        batch = StepBatch([t for w in works for t in (w.seq.token_range(w.start, w.end) if not w.draft else
                                                      w.seq.token_range(w.start, w.start + 1) + list(w.draft))],
                          tuple(w.end - w.start for w in works), tuple(w.start for w in works),
                          [w.seq.kv_slots for w in works], [w.new_slots for w in works],
                          [w.seq.state_slot for w in works], want, snaps if any(snaps) else (), greedy, every,
                          verify)
        tokens, logits = self.worker.run(batch)
        for i in every:
            collect_prompt_logprobs(works[i], self.worker.piece_logits[i])
        picked, raw, t, r = {}, {}, 0, 0
        for i, g in zip(want, greedy):  # a verify piece's rows come back together: a list of picks, or [n, V]
            seq, n = works[i].seq, (works[i].end - works[i].start if works[i].draft else 0)
            if g:
                picked[id(seq)] = tokens[t : t + n] if n else tokens[t]
                t += max(n, 1)
            else:
                raw[id(seq)] = logits[r : r + n] if n else logits[r]
                r += max(n, 1)
        return picked, raw

    def _verify(self, works: list[Work], picked: dict, raw: dict, guided: bool) -> dict[int, tuple]:
        """The tokens each verify piece emits (its accepted drafts and one more: `speculative.accept`), appended
        to its sequence with their logprobs, each sequence's finishing deferred; then every verify piece's state
        rolled back to its last computed token in one worker call. -> id(seq): (outputs, emitted, reason)."""
        done, keep = {}, {}
        for w in works:
            seq = w.seq
            rows = picked.get(id(seq), raw.get(id(seq)))
            tokens = accept(seq, w.draft, rows, self.tokenizer.stop_token_ids, self.grammars if guided else None)
            self.telemetry.on_verify(len(w.draft), len(tokens) - 1)
            NgramDrafter.record(seq, len(w.draft), len(tokens) - 1)
            lps = None
            if seq.params.logprobs is not None:
                lps = row_logprobs(raw[id(seq)][: len(tokens)], tokens, seq.params.logprobs)
            outs = []
            for j, tok in enumerate(tokens):
                outs.append(self._append_token(seq, tok, None if lps is None else lps[j], finish=False))
                if outs[-1].finished:
                    break
            done[id(seq)] = outs
            keep[seq.state_slot] = len(outs)  # the emitted tokens but the last are computed: x0 + accepted drafts
        self.worker.rollback(keep)
        return {k: (outs, len(outs), outs[-1].finish_reason) for k, outs in done.items()}

    def _settle_verified(self, w: Work, outs: list[RequestOutput], emitted: int, reason: str | None) -> RequestOutput:
        """A verify piece after its rollback: its first `emitted` KV slots stay and the rejected drafts' go back,
        checkpoints it passed are stored, the sequence finishes if it ended; its outputs merge into one."""
        seq = w.seq
        self.cache.free_kv(w.new_slots[emitted:])
        seq.num_computed = w.start + emitted
        seq.kv_slots = torch.cat([seq.kv_slots, w.new_slots[:emitted]])
        self._checkpoint_after(seq, w.start)
        if reason is not None:
            self._finish(seq, reason, store=True)
        first, last = outs[0], outs[-1]
        lps = [lp for o in outs for lp in (o.new_logprobs or ())]
        return replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                       new_text="".join(o.new_text for o in outs), new_logprobs=lps or None,
                       prompt_logprobs=first.prompt_logprobs, ttft_s=first.ttft_s)

    def _refresh_loaded(self, seqs: list[Sequence]) -> None:
        """wr: refresh the omitted units of the checkpoints loaded this step, in one batched replay."""
        if not seqs or self.worker.local_rows is None:
            return
        t0 = time.perf_counter()
        n = self.worker.refresh([s.tokens[: s.num_computed] for s in seqs],
                                [s.kv_slots[: s.num_computed] for s in seqs], [s.state_slot for s in seqs])
        self.telemetry.wr_replay_tokens += n
        self.telemetry.wr_replay_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[RequestOutput]]:
        """Run prompts to completion (batched); per request the final output of each of its n sequences."""
        ids = [self.add_request(p, params) for p in prompts]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[(out.request_id, out.index)] = out
        return [[final[(r, i)] for i in range(params.n)] for r in ids]

    def snapshot(self) -> dict:
        snap = self.telemetry.snapshot(self.cache, self.scheduler.states, len(self.scheduler.running),
                                       len(self.scheduler.waiting))
        snap["preemptions"] = self.scheduler.num_preemptions
        dense = self.plan.total_units if self.plan else None
        snap["dasc"] = None if self.plan is None else {
            "w_max": self.plan.w_max, "policy": self.cfg.policy, "quant": self.cfg.quant, "layout": self.cfg.layout,
            "selector": self.plan.selector, "retained_fraction": self.plan.retained_fraction,
            "compression_ratio": DenseCodec(self.worker.states.template()).bytes_per_slot / self.codec.bytes_per_slot,
            "total_units": dense, "retained_units": self.plan.retained_units}
        graphs = getattr(self.worker, "graphs", None)
        snap["decode_graphs"] = None if graphs is None else graphs.stats()
        return snap

    def check_integrity(self) -> None:
        """Every KV slot and checkpoint slot owned once or free (the cache), and every active-state slot held by
        a running sequence or a held fork state, or free (the scheduler)."""
        self.cache.check_integrity(self.scheduler.private_slots())
        forks = [seqs[0].fork for seqs in self._seqs.values() if seqs[0].fork is not None]
        self.scheduler.check_integrity([f.state_slot for f in forks if f.state_slot is not None])


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Sample `index`'s generator: seed + index taken modulo 2**64, the range `manual_seed` takes (which maps a
    negative seed s to s + 2**64 itself), so that no seed a request may carry overflows it."""
    return None if seed is None else torch.Generator().manual_seed((seed + index) % 2**64)


def _model_len(model: HybridForCausalLM) -> int:
    return int(getattr(model.config, "max_position_embeddings", 4096))


def _flops_per_token(model: HybridForCausalLM) -> tuple[float, float]:
    """(FLOPs per token of everything but attention scores, FLOPs per (query, key) pair over all attention
    layers): the cost model of flop-aware eviction."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    pair = sum(4 * getattr(model.model.layers[i].mixer, "score_dim", 0) for i in model.attention_layers)
    return 2.0 * params, float(pair)
