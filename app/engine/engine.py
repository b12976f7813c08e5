"""The Engine facade: add requests, step, generate; it runs without Ray.

One step reads top to bottom in `_step`: the scheduler's pieces -> one forward (`step_inputs`) -> picks
(greedy, processed, sampled; speculative verify pieces accepted and rolled back: app/engine/verify.py) -> each
piece settled: its progress, the checkpoints it passed (app/engine/checkpoints.py), its token's output
(app/engine/outputs.py), finishing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import time
from dataclasses import replace

import torch

from app.cache.checkpoint import CheckpointCodec, CheckpointPool, DenseCodec
from app.cache.disk_tier import DiskTier
from app.cache.fingerprint import codec_fingerprint, model_fingerprint
from app.cache.host_tier import HostTier
from app.cache.policy import FlopAwareSelect, lru_select
from app.cache.pools import KVSlots
from app.cache.prefix_cache import PrefixCache
from app.engine.checkpoints import Checkpointing
from app.engine.config import EngineConfig
from app.engine.grammar import JsonGrammars
from app.engine.grammar import for_tokenizer as grammars_for
from app.engine.logits import needs_processing
from app.engine.outputs import Outputs
from app.engine.picks import collect_prompt_logprobs, greedy_tokens, output_logprobs, processed, sample
from app.engine.request import RequestOutput, SamplingParams, Sequence, Status
from app.engine.scheduler import Scheduler, Work
from app.engine.speculative import NgramDrafter
from app.engine.step_batch import split_rows, step_inputs
from app.engine.telemetry import Telemetry
from app.engine.verify import merged, verify
from app.engine.worker import Worker
from app.models.hybrid import HybridForCausalLM
from app.models.tokenizer import Tokenizer

DISK_SECRET_ENV = "DASC_DISK_SECRET"  # the deployment secret that keys and authenticates disk tier entries


class Engine:
    def __init__(self, model: HybridForCausalLM, tokenizer: Tokenizer, cfg: EngineConfig | None = None,
                 codec: CheckpointCodec | None = None, worker=None) -> None:
        """`worker`: a `Worker` or a TP group with the same verbs; by default an in-process Worker."""
        cfg = cfg or EngineConfig()
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.worker = worker or Worker(model, cfg, codec)
        # the tree, the pools and the tiers: whoever steps or changes them holds it; an AsyncEngine sets open_forward,
        # and `run_works` then lets go of it while the worker runs the forward (app/engine/async_engine.py)
        self.cache_lock, self.open_forward = threading.Lock(), False
        staged = cfg.disk_dir or (cfg.peer_fetch and isinstance(self.worker, Worker))
        host = HostTier(self._host_bytes(cfg, model), self.worker.kv.bytes_per_token) if cfg.host_mb > 0 or \
            staged else None
        self.cache = PrefixCache(KVSlots(cfg.kv_slots), self._pool(), cfg.admission, self._select(cfg), host,
                                 self.worker, _layout(cfg))
        self.cache.disk = self._disk_tier(cfg) if cfg.disk_dir else None
        self.cache.staging = bool(staged) and cfg.host_mb <= 0
        self.scheduler = Scheduler(cfg, self.cache, self.worker)
        self.scheduler.drafter = NgramDrafter(cfg) if cfg.spec == "ngram" else None
        self.checkpoints = Checkpointing(cfg, self.cache, self.worker, self.scheduler)
        self.outputs = Outputs(tokenizer)
        self.telemetry = Telemetry()
        self.max_model_len = cfg.max_model_len or _model_len(model)
        self._ids = itertools.count()
        self._seqs: dict[str, list[Sequence]] = {}
        self.keep_logits = False  # True: greedy rows come back as logits too (tests that compare logits)

    @functools.cached_property
    def model_fp(self) -> str:
        """The model fingerprint disk entries and peer fetches are checked against (computed on first use: only
        engines with a disk tier or peer fetches pay for it)."""
        return model_fingerprint(self.model, dataclasses.asdict(self.model.config))

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

    def _host_bytes(self, cfg: EngineConfig, model: HybridForCausalLM) -> int:
        """The host tier's budget: `host_mb`; with the host tier off and a disk tier or peer fetches on, a staging area
        for disk hits and fetched entries on their way to the pools: two entries at the longest prefix the KV pool
        holds."""
        if cfg.host_mb > 0:
            return int(cfg.host_mb * 2**20)
        longest = min(cfg.kv_slots, cfg.max_model_len or _model_len(model))
        return 2 * (longest * self.worker.kv.bytes_per_token + self.worker.codec.bytes_per_slot)

    def _disk_tier(self, cfg: EngineConfig) -> DiskTier:
        """The disk tier under the host tier (docs/serving.md, "Disk tier"): keyed with the deployment secret."""
        secret = os.environ.get(DISK_SECRET_ENV)
        if not secret:
            raise ValueError(f"disk_dir: set the deployment secret in the environment variable {DISK_SECRET_ENV}")
        if not isinstance(self.worker, Worker):
            raise ValueError("disk_dir: the disk tier runs with one worker (tp 1)")
        return DiskTier(cfg.disk_dir, secret.encode(), self.model_fp, _codec_fp(cfg),
                        budget_bytes=int(cfg.disk_mb * 2**20), ttl_s=cfg.disk_ttl_s,
                        reuse_bytes_s=cfg.disk_reuse_mb_s * 2**20)

    def persist(self, timeout_s: float = 30.0) -> int:
        """A graceful stop: write what the pool and the host tier hold to the disk tier (if any) and wait for the
        writes, within `timeout_s`; returns the entries written. Call it between steps, after draining."""
        if self.cache.disk is None:
            return 0
        before = self.cache.disk.counters.writes
        self.cache.persist(time.monotonic() + timeout_s)
        self.cache.disk.flush()
        return self.cache.disk.counters.writes - before

    def export_entry(self, tokens: list[int], limit: int, salt: str | None) -> dict | None:
        """What a peer fetches (issue 40): the deepest checkpoint of `salt` that `tokens` starts with, at most `limit`
        deep, with its prefix's KV, as host tensors, and the fingerprints and salt it is valid for; None when this
        engine holds none (or runs TP > 1). Call it holding the cache lock (`AsyncEngine.cache_call`): it only reads
        stored entries (and a disk file)."""
        found = self.cache.export_entry(tokens, limit, salt) if isinstance(self.worker, Worker) else None
        if found is None:
            return None
        entry_tokens, kind, tensors = found
        return {"model": self.model_fp, "codec": _codec_fp(self.cfg), "salt": salt, "tokens": entry_tokens,
                "kind": kind, "tensors": tensors}

    def import_entry(self, entry: dict, prompt: list[int], salt: str | None) -> str | None:
        """File a peer's `export_entry` for a request of `prompt` under `salt` into the host tier (its admission then
        loads it); None when filed, else why not: another model or codec (fingerprints), another salt, tokens that do
        not start the prompt, tensors of other shapes, no room. Call it holding the cache lock
        (`AsyncEngine.cache_call`): it changes the host tier alone."""
        if self.cache.host is None or not isinstance(self.worker, Worker):
            return "no host tier"
        tokens = entry.get("tokens") or []
        if entry.get("model") != self.model_fp or entry.get("codec") != _codec_fp(self.cfg):
            return "foreign"
        if entry.get("salt") != salt or prompt[: len(tokens)] != tokens or not tokens:
            return "mismatched"
        if not self.cache.fits(len(tokens), entry["tensors"]):
            return "shape"
        if self.cache.file_entry(salt, tokens, entry.get("kind"), entry["tensors"]) is None:
            return "no room"
        return None

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
            self.cache.set_layout(_layout(new))
        else:
            self.worker.set_policy(new.policy)
        self.cfg = self.scheduler.cfg = self.checkpoints.cfg = new
        self.cache.admission = new.admission
        if self.cache.disk is not None:
            self.cache.disk.codec_fp = _codec_fp(new)

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
        if params.constrained:  # compiled here, in the caller's thread, not in a step
            self.grammars.check(params)

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
        greedy_only = params.temperature <= 0 and params.logprobs is None and not needs_processing(params)
        for seq in seqs:
            seq.generator = _generator(params.seed, seq.index)
            seq.fork_of = seqs[0] if seq.index > 0 else None
            seq.greedy_only = greedy_only
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
        """schedule (done) -> forward -> picks (greedy, processed and sampled rows; verify pieces accepted and
        rolled back) -> each piece settled: progress, checkpoints, its token's output, finishing."""
        loaded, self.scheduler.loaded = self.scheduler.loaded, []
        self._refresh_loaded([s for s in loaded if s.state_slot is not None])
        if not works:
            return []
        for w in works:
            if not w.seq.counted:
                self.telemetry.on_admit(w.seq)
                w.seq.counted = True
        picked, raw = self.run_works(works)
        drafts = [w for w in works if w.draft]
        guided = self.grammars if any(w.seq.params.constrained for w in works) else None
        verified = verify(drafts, picked, raw, self.outputs, self.worker, self.telemetry, guided) if drafts else {}
        plain = [w for w in works if not w.draft] if drafts else works
        logprobs = {}
        if raw:
            logits = processed(plain, raw, self.tokenizer.stop_token_ids, guided)
            picked.update(greedy_tokens(plain, logits))
            picked.update(sample([w.seq for w in plain if id(w.seq) in logits and id(w.seq) not in picked], logits))
            logprobs = output_logprobs([w.seq for w in plain if id(w.seq) in picked
                                        and w.seq.params.logprobs is not None], raw, picked)
        self.telemetry.steps += 1
        outputs = []
        for w in works:
            seq = w.seq
            if w.draft:  # KV of the rejected drafts back, the sequence as far as it emitted
                outs = verified[id(seq)]
                self.cache.free_kv(w.new_slots[len(outs):])
                self._advance(seq, w.start, w.start + len(outs), w.new_slots[: len(outs)])
                if outs[-1].finish_reason is not None:
                    self._finish(seq, outs[-1].finish_reason, store=True)
                outputs.append(merged(outs))
                continue
            self._advance(seq, w.start, w.end, w.new_slots)
            if id(seq) in picked:
                out, reason = self.outputs.append(seq, picked[id(seq)], logprobs.get(id(seq)))
                if reason is not None:
                    self._finish(seq, reason, store=True)
                outputs.append(out)
            elif seq.params.max_tokens == 0 and seq.num_computed == seq.num_tokens:  # the prompt's logprobs only
                self._finish(seq, "length", store=True)
                outputs.append(RequestOutput(seq.request_id, seq.index, [], "", "", True, "length", seq.prompt_len,
                                             seq.cached_len, [], None, prompt_logprobs=[None, *seq.prompt_lps],
                                             compressed_hit=seq.compressed_hit))
        return outputs

    def _advance(self, seq: Sequence, start: int, end: int, slots: torch.Tensor) -> None:
        """The sequence has computed tokens [start, end) into KV `slots`; store the checkpoints it passed."""
        seq.num_computed = end
        seq.append_kv(slots)
        self.checkpoints.after_piece(seq, start)

    def _finish(self, seq: Sequence, reason: str, store: bool) -> None:
        seq.finish_reason, seq.finish_time = reason, time.perf_counter()
        if store:
            self.checkpoints.at_finish(seq)
        self.scheduler.release(seq)
        seq.status = Status.FINISHED
        if seq.admitted_once:
            self.telemetry.on_finish(seq)
        if all(s.is_finished for s in self._seqs.get(seq.request_id, [])):
            self._seqs.pop(seq.request_id, None)

    def run_works(self, works: list[Work]) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """One forward for the step's pieces (`step_inputs`): greedy picks and raw logits keyed by id(seq)
        (`split_rows`); prompt logprobs collected on the way. Under an AsyncEngine (`open_forward`) the forward
        runs without the cache lock: it touches only the step's new KV slots and its sequences' working states, so
        readers of stored entries (`AsyncEngine.cache_call`) need not wait for it."""
        batch = step_inputs(works, self.keep_logits)
        if self.open_forward:
            self.cache_lock.release()
            try:
                tokens, logits = self.worker.run(batch)
            finally:
                self.cache_lock.acquire()
        else:
            tokens, logits = self.worker.run(batch)
        for i in batch.every_row:
            collect_prompt_logprobs(works[i], self.worker.piece_logits[i])
        return split_rows(works, batch, tokens, logits)

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
        snap["disk_tier"] = None if self.cache.disk is None else self.cache.disk.stats()
        graphs = getattr(self.worker, "graphs", None)
        snap["decode_graphs"] = None if graphs is None else graphs.stats()
        report = getattr(self.worker, "prefill_report", None)
        snap["compiled_prefill"] = None if report is None else report.stats()
        snap["compile"] = None if self.compiled is None else self.compiled.stats()
        return snap

    @property
    def compiled(self):
        """The worker's CPU compiled packages (app/engine/compiled.py), or None."""
        return getattr(self.worker, "compiled", None)

    def install_compiled(self) -> int:
        """Put the compiled packages built since the last step in force (between steps); returns how many."""
        return 0 if self.compiled is None else self.compiled.install()

    def close(self) -> None:
        """Stop what runs beside the engine for it: the background compile of its packages, if any."""
        if self.compiled is not None:
            self.compiled.close()

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


def _codec_fp(cfg: EngineConfig) -> str:
    return codec_fingerprint(cfg.w_max, cfg.policy, cfg.quant, cfg.layout, cfg.selector, cfg.tail)


def _layout(cfg: EngineConfig) -> tuple:
    """What stored checkpoint bytes mean (the host tier never loads an entry of another): the codec's settings,
    without the pool's size."""
    c = cfg.checkpoint_settings
    return (c.w_max, c.quant, c.layout, c.selector)


def _model_len(model: HybridForCausalLM) -> int:
    return int(getattr(model.config, "max_position_embeddings", 4096))


def _flops_per_token(model: HybridForCausalLM) -> tuple[float, float]:
    """(FLOPs per token of everything but attention scores, FLOPs per (query, key) pair over all attention
    layers): the cost model of flop-aware eviction."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    pair = sum(4 * getattr(model.model.layers[i].mixer, "score_dim", 0) for i in model.attention_layers)
    return 2.0 * params, float(pair)
