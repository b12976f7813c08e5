"""Engine configuration: every knob defined once, in one frozen dataclass validated on construction.

Each field of `EngineConfig` is a knob. Its annotation is its type (a `Literal` lists the allowed values, taken
from the module that implements them) and `knob(...)` gives its default, lower bound, pattern and one-line
doc. `KNOBS` reads them back as `Knob` records: the CLI (app/cli.py) builds its flags from them and the serve
config (deployments/builder.py) its pydantic `EngineArgs`, so names, types, allowed values, bounds, defaults
and docs agree by construction. docs/design.md, "Knobs", explains the choices.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from app.cache.policy import ADMISSIONS, EVICTIONS
from app.dasc.layout import LAYOUTS, QUANTS
from app.dasc.policy import POLICIES

Admission = Literal[ADMISSIONS]
Eviction = Literal[EVICTIONS]
Policy = Literal[POLICIES]
Quant = Literal[QUANTS]
Layout = Literal[LAYOUTS]
Dtype = Literal["float32", "bfloat16"]
SpecMethod = Literal["off", "ngram"]
SpecRollback = Literal["replay", "snapshot"]
MAX_SPEC_TOKENS = 16  # a verify piece (1 + drafts) stays inside one chunk of the recurrent layers' chunked form


def knob(default: Any, doc: str, *, ge: float | None = None, pattern: str | None = None,
         flag: str | None = None) -> Any:
    """A dataclass field with its knob description: `ge` a lower bound, `pattern` a full-match regular
    expression for strings, `flag` the CLI flag when it is not the default one (see `Knob.flag`)."""
    return field(default=default, metadata={"knob": {"doc": doc, "ge": ge, "pattern": pattern, "flag": flag}})


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (docs/design.md, Knobs); each field's one-line doc is in its `knob(...)`.

    Longer notes. checkpoint_budget_mb sizes the checkpoint pool by bytes (slots by Eq. 8) and must be >= 0
    unless checkpoint_slots is set. w_max None stores exact copies; a number stores dasc checkpoints keeping the
    units whose static horizon exceeds it. decode_graphs and compile_decode need one worker and no routed
    experts; on the CPU the graph step runs eagerly (the padded step, as padded_decode runs it), and the compiled
    step turns the step's few hundred dispatched ops into a few fused C++ kernels and C++ GEMM kernels on frozen,
    pre-packed weights, one package per batch bucket, kept across starts in compile_cache_dir (it needs a C++
    compiler). checkpoint_min_gap skips a
    branch-point, prompt-end, generation-end or decode-interval checkpoint that would nearly duplicate the
    sequence's last one; a later request replays those few tokens instead.
    """

    max_running: int = knob(64, "sequences decoding or prefilling at once (active state slots)", ge=1)
    max_waiting: int = knob(256, "requests queued to start before new ones are refused as overloaded (0: no "
                                 "bound)", ge=0)
    chunk_size: int = knob(512, "most prompt tokens one sequence feeds in one step (chunked prefill)", ge=1)
    max_tokens_per_step: int = knob(2048, "token budget of a step, decode tokens and prefill pieces together", ge=1)
    kv_slots: int = knob(131072, "attention KV capacity in tokens (one slot per token)", ge=1)
    checkpoint_budget_mb: float | None = knob(64.0, "checkpoint pool budget in MiB (unused when checkpoint_slots "
                                                    "is set)")
    checkpoint_slots: int | None = knob(None, "size the checkpoint pool by usable slots instead of a budget", ge=0)
    host_mb: float = knob(0.0, "host tier in MiB: checkpoints the pools evict are kept in host memory with their "
                               "prefix's KV, and loaded back on a hit (0: off)", ge=0)
    disk_dir: str | None = knob(None, "disk tier directory: entries the host tier evicts (with host_mb 0, those the "
                                      "pools evict) are written there behind the serving path and found again after "
                                      "a restart (needs one worker and the secret in DASC_DISK_SECRET; unset: off)")
    peer_fetch: bool = knob(False, "take checkpoints a peer replica exports when the router sends a request with "
                                   "a fetch (issue 40); with host_mb 0, a staging area holds them until loaded")
    disk_mb: float = knob(4096.0, "disk tier budget in MiB (the oldest entries go beyond it)", ge=0)
    disk_ttl_s: float = knob(7 * 24 * 3600.0, "disk tier entries older than this are removed", ge=0)
    disk_reuse_mb_s: float = knob(32.0, "a checkpoint loaded for the first time is also written behind to the disk "
                                        "tier (so a crash keeps it), at most this many MiB a second (0: only what "
                                        "the tiers evict, and a graceful stop)", ge=0)
    interval: int = knob(0, "checkpoint every N aligned tokens in prefill and decode (0: only prompt ends, branch "
                            "points and generation ends)", ge=0)
    lookback: int = knob(0, "also checkpoint each prompt at least this many tokens before its prompt-end "
                            "checkpoint (aligned down to lookback_align): where a request that shares all but the "
                            "prompt's last tokens resumes, the first query on a new few-shot header (0: off)", ge=0)
    lookback_align: int = knob(16, "alignment of lookback checkpoints, in tokens (the router's block size)", ge=1)
    admission: Admission = knob("always", "prompt-end checkpoints always, or second_hit: only for prefixes seen "
                                          "before")
    eviction: Eviction = knob("lru", "which checkpoint a full pool drops: lru, or flop_aware (Marconi)")
    enable_cache: bool = knob(True, "the prefix cache's lookups and checkpoints (off: cold runs)",
                              flag="--no-cache")
    flop_alpha: float = knob(0.5, "flop_aware eviction's weight of recency against prefill FLOPs saved per byte")
    max_model_len: int | None = knob(None, "longest prompt plus output in tokens (unset: the model's context length)")
    w_max: float | None = knob(None, "dasc W_max: keep units with static horizon > W_max (0: all); unset: dense "
                                     "checkpoints", ge=0)
    policy: Policy = knob("nr", "omitted units on load: zero-filled (nr) or refreshed by a bounded replay (wr)")
    quant: Quant = knob("none", "storage of retained units: fp32 (none) or int8")
    layout: Layout = knob("ragged", "checkpoint slot layout of retained units")
    selector: str = knob("decay", "decay, or random:<seed> (count-matched random units, the paper's baseline)",
                         pattern=r"decay|random:.*")
    recompute_tail: float = knob(4.0, "dasc nr: after a checkpoint load, recompute at least this many times W_max "
                                      "prompt tokens before the last one (prompt-end checkpoints sit that far back)",
                                 ge=0)
    store_generation_end: bool = knob(True, "checkpoint where generation ended, so a conversation's next turn hits")
    checkpoint_min_gap: int = knob(16, "skip a branch, prompt-end, generation-end or interval checkpoint fewer than "
                                       "this many tokens above the sequence's last one", ge=0)
    device: str = knob("cpu", "cpu, cuda (TP rank r on the r-th visible GPU) or cuda:N (rank r on GPU N + r)",
                       pattern=r"cpu|cuda(:\d+)?")
    dtype: Dtype = knob("float32", "weights and KV (recurrent states and their checkpoints stay fp32)")
    padded_decode: bool = knob(True, "pure decode steps run as the padded step of app/engine/graphs.py (one host-built "
                                     "slot table per step) where it applies: one worker, no routed experts")
    decode_graphs: bool = knob(False, "replay pure decode steps from captured CUDA graphs (app/engine/graphs.py)")
    compile_decode: bool = knob(False, "compiled decode steps, one per batch bucket, made when the worker starts "
                                       "(CPU: ahead-of-time packages kept in compile_cache_dir; GPU: torch.compile)")
    compile_prefill: bool = knob(False, "the chunked recurrent pass of prefill pieces as compiled packages (one per "
                                        "chunk-count bucket), made when the worker starts (CPU; kept in "
                                        "compile_cache_dir)")
    compile_background: bool = knob(True, "CPU compiled packages the cache lacks are built by a background process "
                                          "at idle priority while the engine serves eagerly, each swapped in between "
                                          "steps (false: the start waits for them)")
    compile_cache_dir: str | None = knob(None, "private directory (mode 0700) of the CPU's compiled decode packages "
                                               "(unset: ~/.cache/dasc-serve/compiled)")
    compile_cache_mb: float = knob(2048.0, "size cap of compile_cache_dir in MiB (least recently used packages "
                                           "dropped first)", ge=0)
    spec: SpecMethod = knob("off", "speculative decoding: off, or ngram (prompt lookup: drafts from the sequence's "
                                   "own earlier tokens)", flag="--spec")
    spec_tokens: int = knob(4, "most draft tokens a sequence verifies per step (adaptive below it, 1..16)", ge=1,
                            flag="--spec-tokens")
    spec_rollback: SpecRollback = knob("replay", "how a verify step's recurrent state returns to the last accepted "
                                                 "token: replay its kept inputs, or snapshot every position")
    spec_ngram_max: int = knob(4, "prompt lookup: longest suffix n-gram matched", ge=1)
    spec_ngram_min: int = knob(2, "prompt lookup: shortest suffix n-gram matched", ge=1)
    spec_verify_cost: float = knob(0.3, "adaptive depth: what a verify step costs beyond a decode step whatever its "
                                   "drafts, in decode steps", ge=0)
    spec_draft_cost: float = knob(0.05, "adaptive depth: what each verified draft token adds, in decode steps", ge=0)
    spec_max_batch: int = knob(4, "no drafts in a step that decodes more sequences than this (vLLM's "
                               "disable_by_batch_size): in a larger batch verifying them costs about what they save",
                               ge=0)

    def __post_init__(self) -> None:
        for k in KNOBS.values():
            k.check(getattr(self, k.name))
        if self.checkpoint_slots is None and (self.checkpoint_budget_mb is None or self.checkpoint_budget_mb < 0):
            raise ValueError("checkpoint_budget_mb must be >= 0 unless checkpoint_slots is set")
        if self.spec_tokens > MAX_SPEC_TOKENS:
            raise ValueError(f"spec_tokens must be <= {MAX_SPEC_TOKENS}, got {self.spec_tokens}")
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ValueError(f"spec_ngram_min ({self.spec_ngram_min}) must be <= spec_ngram_max "
                             f"({self.spec_ngram_max})")

    @property
    def tail(self) -> int:
        """Prompt tokens recomputed before the last one after a load (docs/dasc.md, "Where checkpoints sit"):
        ceil(recompute_tail * W_max) under dasc, whose omitted units hold the last tokens' information and are
        rebuilt by recomputing the tail; 0 for dense checkpoints (exact, or INT8 of every unit: a tail does not
        restore long-horizon units) and under wr, which refreshes the omitted units by its own bounded replay."""
        return 0 if self.w_max is None or self.policy == "wr" else math.ceil(self.recompute_tail * self.w_max)

    @property
    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings(**{f.name: getattr(self, f.name) for f in fields(CheckpointSettings)})


@dataclass(frozen=True)
class CheckpointSettings:
    """What a stored checkpoint holds (w_max, quant, layout, selector) and how many the pool keeps
    (checkpoint_budget_mb, checkpoint_slots): the knobs whose change makes `Engine.retune` drop every stored
    checkpoint and rebuild the pool. `policy` is not one of them: nr or wr decides how a checkpoint is loaded,
    not what it holds. Field names are those of `EngineConfig`."""

    w_max: float | None
    quant: Quant
    layout: Layout
    selector: str
    checkpoint_budget_mb: float | None
    checkpoint_slots: int | None

    @property
    def exact(self) -> bool:
        """Whether a stored checkpoint is an exact copy of the state (dense, fp32): a hit on it answers as a cold
        run does. Any W_max or INT8 storage is lossy (nr zero-fills omitted units, wr replays a bounded window)."""
        return self.w_max is None and self.quant == "none"


@dataclass(frozen=True)
class Knob:
    """One knob of `EngineConfig` as its users see it. `type` is the resolved annotation (`int`,
    `float | None`, a `Literal`, ...)."""

    name: str
    type: Any
    default: Any
    doc: str
    ge: float | None = None
    pattern: str | None = None
    flag: str | None = None

    @property
    def choices(self) -> tuple | None:
        """The allowed values of a Literal knob; None for any other."""
        return typing.get_args(self.type) if typing.get_origin(self.type) is Literal else None

    @property
    def optional(self) -> bool:
        return isinstance(self.type, types.UnionType) and type(None) in typing.get_args(self.type)

    @property
    def base(self) -> type:
        """The Python type of a set value: `int` for `int | None`, `str` for a Literal of strings."""
        if self.choices is not None:
            return type(self.choices[0])
        if isinstance(self.type, types.UnionType):
            return next(t for t in typing.get_args(self.type) if t is not type(None))
        return self.type

    @property
    def cli_flag(self) -> str:
        """`flag` when given, else `--no-<name>` for a switch that is on by default, else `--<name>`
        (underscores become dashes)."""
        dashed = self.name.replace("_", "-")
        return self.flag or (f"--no-{dashed}" if self.default is True else f"--{dashed}")

    def check(self, value: Any) -> None:
        """Raise ValueError, naming the knob, for None where the type has no None, a value outside the Literal,
        below `ge`, or not matching `pattern`. Types themselves are not checked here."""
        if value is None:
            if not self.optional:
                raise ValueError(f"{self.name} must be set, got None")
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {self.choices}, got {value!r}")
        if self.ge is not None and value < self.ge:
            raise ValueError(f"{self.name} must be >= {self.ge}, got {value!r}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value, re.DOTALL):
            raise ValueError(f"{self.name} must match {self.pattern!r} ({self.doc}), got {value!r}")


def _knobs() -> dict[str, Knob]:
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: Knob(f.name, hints[f.name], f.default, **f.metadata["knob"]) for f in fields(EngineConfig)}


KNOBS: dict[str, Knob] = _knobs()
