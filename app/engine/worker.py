"""The worker: what one tensor-parallel rank holds (its model shard, KV storage, active-state storage and
checkpoint storage) and the verbs the engine drives it with. The engine's scheduler and cache only decide
slot ids; every byte moves here. Under TP the same verb runs on every rank (app/engine/tp.py).

Every tensor is created on the worker's device explicitly (from a weight, a template state or the layout's
device), never through a default-device mode. The engine gets back only the greedy picks of a step and the
logits of its sampled rows. Why: docs/architecture.md, "Engine: who decides, who holds the bytes".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from app.cache.checkpoint import CheckpointCodec, DenseCodec, physical_slots
from app.cache.host_store import HostStore
from app.cache.pools import KVStorage, PagedKV, StateStorage
from app.dasc.codec import DascCodec
from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.placement import plan_placement
from app.dasc.policy import local_rows, refresh_local_units
from app.dasc.selection import make_plan
from app.dasc.tp_codec import PlacedDascCodec
from app.engine.compiled import CompiledPackages
from app.engine.config import EngineConfig
from app.engine.graphs import DecodeGraphs
from app.engine.step_batch import StepBatch
from app.models.batch import BatchLayout, LinearStates, host_to_device
from app.models.hybrid import HybridForCausalLM
from app.models.layers import Experts
from app.models.loader import cast_model
from app.ops.chunk import compiled_cores


@dataclass(frozen=True)
class TPContext:
    """This worker is rank `rank` of `size`; `geometry`/`horizons` describe the full (unsharded) model, and
    `head_order` is the stage-1 permutation it was sharded with (None: identity)."""

    rank: int
    size: int
    placement: str
    head_order: tuple | None
    geometry: list
    horizons: list


def worker_device(device: str, rank: int = 0) -> torch.device:
    """The device of TP rank `rank` under the configured `device` (see EngineConfig), or a clear error."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"engine device {device!r}: torch sees no CUDA device (torch.cuda.is_available() is "
                           "False); set the engine's device to 'cpu'")
    index = rank + (int(device.split(":")[1]) if ":" in device else 0)
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"TP rank {rank} needs GPU {index} under device {device!r}, but "
                           f"{torch.cuda.device_count()} are visible")
    return torch.device("cuda", index)


class Worker:
    def __init__(self, model: HybridForCausalLM, cfg: EngineConfig, codec: CheckpointCodec | None = None,
                 tp: TPContext | None = None) -> None:
        self.device = worker_device(cfg.device, tp.rank if tp else 0)
        self.model = cast_model(model.to(self.device), getattr(torch, cfg.dtype)).eval()
        self.tp = tp
        self._allocate(cfg, codec)
        self.snapshots: dict[tuple[int, int], object] = {}
        self.piece_logits: dict[int, torch.Tensor] = {}  # every_row pieces of the last run: [n, V] fp32, host
        # verify pieces of the last run, by state slot: per linear layer, what `rollback` rebuilds a state from
        self.verifying: dict[int, list] = {}
        self.spec_rollback = cfg.spec_rollback
        self.host = HostStore(self.device)  # the host tier's bytes of this worker's shard (app/cache/host_tier.py)

    def _allocate(self, cfg: EngineConfig, codec: CheckpointCodec | None) -> None:
        fixed = cfg.decode_graphs or cfg.compile_decode  # asked for: refused where they cannot run
        padded = fixed or (cfg.padded_decode and self.tp is None and not routed_experts(self.model))
        scratch = 1 if padded else 0  # one state slot and one KV slot past the allocators' for padding
        self.kv = KVStorage(kv_widths(self.model), cfg.kv_slots + scratch, self.model.model.embed_tokens.weight.dtype,
                            self.device)
        self.states = StateStorage(self.model.empty_states(1), cfg.max_running + scratch)
        self.graphs = None
        if padded:  # the padded decode step of app/engine/graphs.py
            if self.tp is not None:
                raise ValueError("decode_graphs and compile_decode run with one worker (tp 1)")
            self.graphs = DecodeGraphs(self.model, self.kv, self.states, cfg.max_running, cfg.kv_slots, self.device,
                                       capture=cfg.decode_graphs, compiled=cfg.compile_decode)
        # the CPU's compiled packages (app/engine/compiled.py): decode steps into `graphs`, prefill cores here
        cpu = self.device.type == "cpu"
        self.compiled = None
        if cpu and (cfg.compile_decode or cfg.compile_prefill):
            self.compiled = CompiledPackages(self.model, cfg, self.graphs if cfg.compile_decode else None)
        self.chunk_cores = self.compiled.cores if self.compiled is not None and cfg.compile_prefill else None
        self.prefill_report = self.compiled.prefill_report if self.compiled is not None else None
        self.configure_checkpoints(cfg, codec)

    # ------------------------------------------------------------------ checkpoint storage
    def configure_checkpoints(self, cfg: EngineConfig, codec: CheckpointCodec | None = None) -> tuple[int, int]:
        """Build the codec the config asks for (dense, or dasc with a plan) and allocate its slots within the
        budget. Returns (bytes per slot, physical slots). Old checkpoints are dropped."""
        template = self.model.empty_states(1)
        self.plan = None
        if codec is None and cfg.w_max is not None and self.tp is None:
            self.plan = make_plan(model_geometry(self.model), model_horizons(self.model), cfg.w_max, cfg.selector)
            codec = DascCodec(template, self.plan, cfg.layout, cfg.quant)
        elif codec is None and cfg.w_max is not None:
            t = self.tp
            self.plan = make_plan(t.geometry, t.horizons, cfg.w_max, cfg.selector)
            placement = plan_placement(self.plan, t.size, t.placement, head_order=t.head_order)
            codec = PlacedDascCodec(template, self.plan, placement, t.rank, cfg.quant)
        self.codec = codec or DenseCodec(template)
        self.set_policy(cfg.policy)
        budget = None if cfg.checkpoint_slots is not None else int(cfg.checkpoint_budget_mb * 2**20)
        self.physical = physical_slots(self.codec.bytes_per_slot, budget, cfg.checkpoint_slots)
        self.codec.allocate(self.physical)
        return self.codec.bytes_per_slot, self.physical

    def set_policy(self, policy: str) -> None:
        """wr needs the rows of this worker's state that the plan omits (under TP: of its own heads)."""
        self.local_rows = None
        if self.plan is not None and policy == "wr":
            self.local_rows = local_rows(self.plan, self.device) if self.tp is None else self.codec.omitted_rows()

    def store(self, state_slot: int, ckpt_slot: int) -> None:
        self.codec.store(ckpt_slot, self.states.view(state_slot))

    def load(self, ckpt_slot: int, state_slot: int) -> None:
        self.states.write(state_slot, self.codec.load(ckpt_slot))

    def zero(self, state_slot: int) -> None:
        self.states.zero(state_slot)

    # ------------------------------------------------------------------ host tier
    def demote(self, entry_id: int, ckpt_slot: int, kv_slots: torch.Tensor, blocks: list[int],
               new_blocks: list[tuple[int, int]], block: int) -> None:
        """Copy checkpoint `ckpt_slot`, as stored, to the host tier as `entry_id`, with the KV rows of `kv_slots`
        (its prefix's tokens, in order): of its `blocks` (hashes of its full `block`-token blocks) those in
        `new_blocks` ((hash, first token)), which the tier does not hold yet, and the tokens past the last one."""
        index = kv_slots.to(self.device)
        own = index[len(blocks) * block:]
        new = {h: {layer: t.index_select(0, index[at:at + block]) for layer, t in self.kv.storage.items()}
               for h, at in new_blocks}
        self.host.put(entry_id, self.codec.export(ckpt_slot),
                      {layer: t.index_select(0, own) for layer, t in self.kv.storage.items()}, blocks, new)

    def promote_kv(self, entry_id: int, start: int, kv_slots: torch.Tensor) -> None:
        """Write host entry `entry_id`'s KV rows from its token `start` on into `kv_slots`."""
        rows = self.host.kv_rows(entry_id, start)
        index = kv_slots.to(self.device)
        for layer, t in self.kv.storage.items():
            t.index_copy_(0, index, rows[layer].to(self.device, non_blocking=True))

    def promote_state(self, entry_id: int, ckpt_slot: int) -> None:
        """Write host entry `entry_id`'s checkpoint into pool slot `ckpt_slot`, bit for bit."""
        self.codec.import_rows(ckpt_slot, [r.to(self.device, non_blocking=True) for r in self.host.state(entry_id)])

    def host_drop(self, entry_ids: list[int], blocks: list[int] = ()) -> None:
        self.host.drop(entry_ids, blocks)

    def store_snapshot(self, state_slot: int, offset: int, ckpt_slot: int) -> None:
        """Store the state the last run captured `offset` tokens into `state_slot`'s piece (or, for a verify
        piece, the state its rollback record gives there)."""
        state = self.snapshots.get((state_slot, offset))
        self.codec.store(ckpt_slot, state if state is not None else self._verified_state(state_slot, offset))

    def rollback(self, accepted: dict[int, int]) -> None:
        """Speculative decoding: per state slot of a verify piece of the last run, the number of its tokens that
        stay (1 <= n <= its length); the slot gets the state after them. Verify pieces not named keep the state
        from before the piece (the request ended)."""
        for slot, n in accepted.items():
            self.states.write(slot, self._verified_state(slot, n))

    def _verified_state(self, slot: int, n: int) -> LinearStates:
        """The state after the first n tokens of the verify piece `slot` fed in the last run: replayed from the
        state before it (`VerifyInputs.state_at`), or the snapshot the run kept there."""
        records = self.verifying[slot]
        if self.spec_rollback == "snapshot":
            conv, ssm = zip(*(r[n - 1] for r in records))
        else:
            conv, ssm = zip(*(r.state_at(n) for r in records))
        return LinearStates([c[None] for c in conv], [s[None] for s in ssm])

    def rollback_bytes(self) -> int:
        """Bytes the last run kept to roll its verify pieces back beyond their final states: the replay inputs,
        or the snapshots at every position but the last."""
        total = 0
        for records in self.verifying.values():
            for r in records:
                if self.spec_rollback == "snapshot":
                    total += sum(t.numel() * t.element_size() for st in r[:-1] for t in st)
                else:
                    total += r.replay_bytes()
        return total

    def copy_state(self, src_slot: int, offset: int | None, dst_slot: int) -> None:
        """Fork: copy an active state into another slot, or the state the last run captured `offset` tokens
        into `src_slot`'s piece."""
        if offset is None:
            self.states.copy(src_slot, dst_slot)
        else:
            self.states.write(dst_slot, self.snapshots[(src_slot, offset)])

    # ------------------------------------------------------------------ compute
    @torch.no_grad()
    def run(self, batch: StepBatch) -> tuple[list[int], torch.Tensor]:
        """Feed every piece; returns the argmax tokens of the `greedy` rows of `want_logits` and the fp32
        next-token logits of the others, on the host (see `split_logits`)."""
        self.verifying = {}
        if self.compiled is not None:  # packages built since the last step come in force now
            self.compiled.install()
        if self.graphs is not None and self.graphs.handles(batch):
            self.snapshots, self.piece_logits = {}, {}
            return split_logits(*self.graphs.run(batch), greedy=batch.greedy)
        ids = host_to_device(batch.token_ids, self.device)
        layout = BatchLayout(batch.extend_lens, batch.cached_lens, batch.snapshots, verify=batch.verify)
        kv = PagedKV(self.kv, batch.history, batch.new_slots)
        slots = batch.state_slots
        rows, last = _logit_rows(batch)
        picked = None if rows is None else host_to_device(rows, self.device)
        # the model never writes its input states; a verify piece's slot keeps the state before the piece until
        # `rollback`, and its records replay from a copy of it (gathered), which checkpoints read after the rollback
        with compiled_cores(self.chunk_cores):
            states = self.states.view(slots[0]) if len(slots) == 1 and not batch.verify else self.states.gather(slots)
            logits, new_states = self.model(ids, layout, kv, states, logit_rows=picked)
        if len(slots) == 1 and not batch.verify:  # read the slot in place, one copy back
            self.states.write(slots[0], new_states)
        else:
            keep = [i for i in range(len(slots)) if i not in batch.verify]
            if len(keep) == len(slots):
                self.states.scatter(slots, new_states)
            elif keep:
                self.states.scatter([slots[i] for i in keep], new_states.select(keep))
        for i, records in (new_states.verify or {}).items():
            self.verifying[slots[i]] = (records if self.spec_rollback == "replay"
                                        else [[r.state_at(t) for t in range(1, r.n + 1)] for r in records])
        self.snapshots = {(slots[i], k): st for (i, k), st in (new_states.snapshots or {}).items()}
        # every_row pieces: all their rows kept (they end at the piece's last row)
        self.piece_logits = {i: logits[last[i] - n + 1 : last[i] + 1].float().cpu()
                             for i, n in enumerate(batch.extend_lens) if i in batch.every_row}
        if rows is not None:  # the wanted rows among those computed: a verify piece's all, another's last
            want = [r for i in batch.want_logits
                    for r in (range(last[i] - batch.extend_lens[i] + 1, last[i] + 1) if i in batch.verify
                              else (last[i],))]
            logits = logits[host_to_device(want, self.device)]
        elif batch.want_logits != list(range(logits.shape[0])):
            logits = logits[host_to_device(batch.want_logits, self.device)]
        greedy = batch.greedy
        if batch.verify and greedy:
            greedy = tuple(g for i, g in zip(batch.want_logits, greedy)
                           for _ in range(batch.extend_lens[i] if i in batch.verify else 1))
        return split_logits(logits, greedy=greedy)

    def refresh(self, prefixes: list[list[int]], kv_slots: list[torch.Tensor], state_slots: list[int]) -> int:
        """dasc-wr: refresh the omitted units of freshly loaded checkpoints (one batched replay)."""
        if not self.local_rows or not prefixes:
            return 0
        states = self.states.gather(state_slots)
        n = refresh_local_units(self.model, prefixes, self.kv.storage, kv_slots, states, self.plan, self.local_rows)
        self.states.scatter(state_slots, states)
        return n


def _logit_rows(batch: StepBatch) -> tuple[list[int] | None, list[int]]:
    """With `every_row` or `verify` pieces: (the flat rows to compute logits at: all of those pieces', the last
    of the others; the index of each piece's last row among them). Without: (None, [])."""
    if not batch.every_row and not batch.verify:
        return None, []
    rows, last, at = [], [], 0
    for i, n in enumerate(batch.extend_lens):
        rows += list(range(at, at + n)) if i in batch.every_row or i in batch.verify else [at + n - 1]
        last.append(len(rows) - 1)
        at += n
    return rows, last


def split_logits(logits: torch.Tensor, argmax: torch.Tensor | None = None, *,
                 greedy: tuple[bool, ...]) -> tuple[list[int], torch.Tensor]:
    """(the argmax tokens of the rows `greedy` marks, computed where the logits are, or taken from `argmax` when
    the step made them; the other rows, fp32 on the host). With a large vocabulary this keeps a step's [B, V]
    logits off the host link, and the argmax off the host, for greedy requests. argmax takes the first maximum
    on ties, as `sample_token` does."""
    if not any(greedy):
        return [], logits.float().cpu()
    if argmax is None:
        argmax = logits.argmax(-1)
    if all(greedy):
        return argmax.tolist(), _no_rows(logits.shape[-1])
    picks = [i for i, g in enumerate(greedy) if g]
    rest = [i for i, g in enumerate(greedy) if not g]
    tokens = argmax[host_to_device(picks, logits.device)].tolist()
    return tokens, logits[host_to_device(rest, logits.device)].float().cpu()


@functools.lru_cache(maxsize=8)
def _no_rows(width: int) -> torch.Tensor:
    return torch.empty(0, width)


def routed_experts(model: HybridForCausalLM) -> bool:
    return any(isinstance(m, Experts) for m in model.modules())


def kv_widths(model: HybridForCausalLM) -> dict[int, int]:
    return {i: model.model.layers[i].mixer.kv_entry_width for i in model.attention_layers}
