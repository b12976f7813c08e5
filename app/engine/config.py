"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.cache.policy import ADMISSIONS, EVICTIONS


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (see DESIGN.md, Knobs).

    max_running: sequences decoding or prefilling at once (active state slots).
    chunk_size: most prompt tokens one sequence feeds in one step (chunked prefill).
    max_tokens_per_step: token budget of a step, decode tokens and prefill pieces together.
    kv_slots: attention KV capacity in tokens (one slot per token).
    checkpoint_budget_mb: the checkpoint pool's byte budget (slots by Eq. 8); checkpoint_slots, when set,
        sizes it by a usable slot count instead.
    interval: checkpoint every `interval` tokens (aligned positions) in prefill and decode; 0 = only
        prompt ends, branch points and generation ends.
    admission: `always` or `second_hit` (prompt-end checkpoints only for prefixes seen before).
    eviction: `lru` or `flop_aware` (Marconi) for checkpoints.
    enable_cache: False gives cold runs: no lookups and no checkpoints.
    w_max: None stores dense checkpoints (exact copies); a number stores dasc checkpoints keeping the units
        whose static horizon exceeds it (0 keeps every unit through the dasc path).
    policy: `nr` zero-fills omitted units on load, `wr` refreshes them by replaying a bounded suffix.
    quant: `none` (fp32) or `int8` storage of retained units. layout: `ragged` or `padded`.
    selector: `decay` or `random:<seed>` (count-matched random units, the paper's baseline).
    store_generation_end: checkpoint where generation ended, so a conversation's next turn hits.
    device: where the worker keeps weights, KV, states and checkpoints: `cpu`, or `cuda` (TP rank r on the
        r-th visible GPU) or `cuda:N` (rank r on GPU N + r). dtype: `float32` or `bfloat16` weights and KV
        (recurrent states and their checkpoints stay fp32).
    decode_graphs: replay pure decode steps from captured CUDA graphs (app/engine/graphs.py; one worker, no
        routed experts). On the CPU the same padded step runs eagerly: it is the tested twin, not faster.
    compile_decode: run pure decode steps through `torch.compile` (Inductor), one compiled step per batch
        bucket, compiled when the worker starts (same conditions as decode_graphs). On the CPU the step's few
        hundred dispatched ops become a few fused C++ kernels and C++ GEMM kernels on frozen, pre-packed
        weights (each bucket holds its own copy); it needs a C++ compiler.
    checkpoint_min_gap: a branch-point, generation-end or decode-interval checkpoint is skipped when the
        sequence already has a checkpoint fewer than this many tokens before it (a hit just above a branch
        point, a short answer, an interval position just after the prompt end): it would nearly duplicate
        that one, and a later request replays those few tokens instead.
    """

    max_running: int = 64
    chunk_size: int = 512
    max_tokens_per_step: int = 2048
    kv_slots: int = 131072
    checkpoint_budget_mb: float | None = 64.0
    checkpoint_slots: int | None = None
    interval: int = 0
    admission: str = "always"
    eviction: str = "lru"
    enable_cache: bool = True
    flop_alpha: float = 0.5
    max_model_len: int | None = None
    w_max: float | None = None
    policy: str = "nr"
    quant: str = "none"
    layout: str = "ragged"
    selector: str = "decay"
    store_generation_end: bool = True
    checkpoint_min_gap: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    decode_graphs: bool = False
    compile_decode: bool = False

    def __post_init__(self) -> None:
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if min(self.max_running, self.chunk_size, self.max_tokens_per_step, self.kv_slots) < 1:
            raise ValueError("max_running, chunk_size, max_tokens_per_step and kv_slots must be positive")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.checkpoint_min_gap < 0:
            raise ValueError(f"checkpoint_min_gap must be >= 0, got {self.checkpoint_min_gap}")
        if (self.policy not in ("nr", "wr") or self.quant not in ("none", "int8")
                or self.layout not in ("ragged", "padded")):
            raise ValueError(f"bad dasc settings: policy {self.policy!r}, quant {self.quant!r}, layout {self.layout!r}")
        if self.w_max is not None and self.w_max < 0:
            raise ValueError(f"w_max must be >= 0, got {self.w_max}")
        if not (self.selector == "decay" or self.selector.startswith("random:")):
            raise ValueError(f"selector must be 'decay' or 'random:<seed>', got {self.selector!r}")
        if self.interval < 0:
            raise ValueError(f"interval must be >= 0, got {self.interval}")
        if self.checkpoint_slots is None and (self.checkpoint_budget_mb is None or self.checkpoint_budget_mb < 0):
            raise ValueError("checkpoint_budget_mb must be >= 0 unless checkpoint_slots is set")
        if self.checkpoint_slots is not None and self.checkpoint_slots < 0:
            raise ValueError(f"checkpoint_slots must be >= 0, got {self.checkpoint_slots}")
