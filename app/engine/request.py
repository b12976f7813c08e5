"""Requests and their sequences: sampling parameters, progress through the token stream, timing.

A sequence's token stream is prompt + output. `num_computed` tokens of it have been fed to the model: their
KV sits in `kv_slots` and their effect in the active state. The next step feeds
tokens[num_computed : end]; when end reaches the stream's length the step yields logits and a new token.
In decode, num_computed == len(tokens) - 1 (the last sampled token is not fed yet).

    tokens:      p0 p1 ... p(P-1) | o0 o1 ... o(k-1)
    kv_slots:    [ shared (tree, locked through `node`) | private (this sequence) ]   length num_computed
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from app.cache.radix import Node

if TYPE_CHECKING:
    from app.engine.grammar import GrammarState
    from app.engine.tool_grammar import ToolCallState
    from app.models.tokenizer import IncrementalDecoder


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what OpenAI-style clients send: a signed 64-bit integer


GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's cap)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy, and so is any temperature below GREEDY_BELOW (as in vLLM): logits divided by a
    subnormal temperature overflow to inf, and sampling from them failed the whole engine step. A top_p below it
    keeps only the most likely token (top_k 1): float32 rounds a subnormal top_p to 0, an empty nucleus. top_k 0 is off;
    `stop` strings end generation and are not returned."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    cache_salt: str | None = None  # prefixes are shared only among requests with the same salt
    logprobs: int | None = None  # report each output token's log-probability and this many top alternatives
    # the prompt's tokens too (each from the first on): the request then computes every prompt position and
    # resumes from no checkpoint inside the prompt; with it, max_tokens may be 0 (the prompt only, n 1)
    prompt_logprobs: int | None = None
    cache_lossless: bool = False  # resume only from exact checkpoints (a lossy one is not used: recomputed)
    # vLLM's logits processing (app/engine/logits.py) and min_p (app/engine/sampling.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs
    min_tokens: int = 0  # stop ids are masked, and stop strings not matched, before this many output tokens
    # structured output: the JSON schema (its text) the output follows (app/engine/grammar.py); generation ends
    # with an end token once the value is complete. No stop strings or ids, ignore_eos or min_tokens with it:
    # each could end (or refuse to end) the output elsewhere than where the value does.
    guided_json: str | None = None
    # forced tool calls (`tool_choice` required or named): a `ToolSpec`'s JSON text (app/engine/tool_grammar.py);
    # the same combinations are refused as with guided_json
    guided_tools: str | None = None
    # the output will come back as the start of a later prompt (a chat answer, re-sent with the history): its
    # generation-end checkpoint is stored even where the prompt end's lies fewer than checkpoint_min_gap tokens
    # behind, so the next turn resumes exactly where this one ended
    output_resumed: bool = False
    # prompt lengths where this request also stores a checkpoint: where the next turn's prompt leaves this one's
    # (a thinking template's generation prompt opens a block the turn's history form does not have)
    checkpoint_at: tuple[int, ...] = ()
    # sent by the server itself, to store the prompt-end checkpoint the next turn resumes from (a conversation as the
    # next turn re-sends it); its one output token is dropped and it stays out of the request telemetry
    warm: bool = False

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (a JSON schema or forced tool calls)."""
        return self.guided_json is not None or self.guided_tools is not None

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt logprobs), got {self.max_tokens}")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError("max_tokens 0 (the prompt's logprobs only) takes n 1")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < GREEDY_BELOW:
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 1)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 1 <= self.n <= 16:
            raise ValueError(f"n must be in [1, 16], got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.guided_json is not None and self.guided_tools is not None:
            raise ValueError("one grammar at most: a JSON schema or forced tool calls")
        if self.constrained:
            for name in ("stop", "stop_token_ids", "ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with a grammar (response_format, forced tool calls)")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer), got {self.seed}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ForkHold:
    """n > 1: the leader's exact state at the fork point (the prompt end), kept in an active-state slot until
    every sample has started from it, with the tree node (locked meanwhile) and KV slots of the prefix. The
    samples start from this copy, not from the fork checkpoint, which a dasc codec stores lossily."""

    node: Node
    pos: int
    kv_slots: torch.Tensor
    state_slot: int | None  # None once the last sample took it (or the request ended)
    waiting: int  # samples still to start from it


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    cached_len: int = 0  # prompt tokens served by the cache at (first) admission
    replayed: int = 0  # tokens recomputed although their KV was cached (replay from an earlier checkpoint)
    lost: int = 0  # of them, those a checkpoint evicted for room would have saved (`MatchResult.lost_len`)
    discarded: int = 0  # of them, beyond `lost`, those a checkpoint a layout change discarded would have saved
    # tokens before a stored prompt's end where it left that prompt's path, if it then replayed at least
    # checkpoint_min_gap tokens of the shared part (not for want of an evicted checkpoint): what a longer lookback
    # would have saved
    branch_back: int | None = None
    state_slot: int | None = None
    num_shared: int = 0
    node: Node | None = None
    cuts: dict[int, str] = field(default_factory=dict)  # checkpoint position -> kind, still ahead
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    text: str = ""  # output text reported so far (held back where a stop string may still begin)
    decoded: str = ""  # every complete character decoded so far
    decoder: IncrementalDecoder | None = None
    admitted_once: bool = False
    counted: bool = False  # prompt and hit counted in telemetry
    fork_of: "Sequence | None" = None  # n > 1: waits for this leader to reach the fork point
    fork: ForkHold | None = None  # leader of n > 1: the held fork state (set once)
    compressed_hit: bool = False  # resumed from a lossy (dasc or INT8) checkpoint, or forked from one that did
    # prompt_logprobs: the entries of prompt tokens 1..prompt_lp_upto so far (token 0 has none)
    prompt_lps: list = field(default_factory=list)
    grammar: GrammarState | ToolCallState | None = None  # made at the first constrained row, follows output_ids
    spec: object | None = None  # speculative decoding: its n-gram index and acceptance (app/engine/speculative.py)
    greedy_only: bool = False  # its picks need nothing but the argmax of the raw logits (the engine sets it)

    # KV slot ids (`kv_slots`) in a buffer that grows by doubling, so that a decode step's slot is appended in
    # constant time instead of copying the whole list
    _kv: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    _kv_len: int = 0

    @property
    def kv_slots(self) -> torch.Tensor:
        """[num_computed] int64 KV slot ids (a view: replaced, never changed in place, by later appends)."""
        return torch.from_numpy(self._kv[: self._kv_len])

    @property
    def kv_key(self) -> np.ndarray:
        """The buffer of the slot ids: the same object for as long as `kv_slots` only grows at its end (a new one
        when it is replaced or outgrows it), so equal keys and lengths mean equal slot ids (`DecodeInputs`)."""
        return self._kv

    @kv_slots.setter
    def kv_slots(self, slots: torch.Tensor) -> None:
        self._kv = slots.numpy().copy() if isinstance(slots, torch.Tensor) else np.array(slots, dtype=np.int64)
        self._kv_len = len(self._kv)

    def append_kv(self, slots: torch.Tensor) -> None:
        new = slots.numpy()
        end = self._kv_len + len(new)
        if end > len(self._kv):
            grown = np.empty(max(end, 2 * len(self._kv), 64), dtype=np.int64)
            grown[: self._kv_len] = self._kv[: self._kv_len]
            self._kv = grown
        if end - self._kv_len == 1:  # a decode step's one slot
            self._kv[self._kv_len] = new[0]
        else:
            self._kv[self._kv_len : end] = new
        self._kv_len = end

    @property
    def prompt_lp_upto(self) -> int:
        return len(self.prompt_lps)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end], without building the whole list (a decode step reads one output token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def next_end(self, budget: int) -> int:
        """Where this step's piece ends: the budget or the stream's end. Checkpoint cuts inside a piece are
        captured as state snapshots during the same forward, so they never split a step."""
        return min(self.num_tokens, self.num_computed + budget)


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a sequence after a step: the new tokens and text, and at the end why.
    `output_ids` (every output token) is filled in the final output only: copied with every token, it would
    cost O(n) per token, O(n^2) per output. `text` is the text so far (a string the engine keeps anyway).
    Treated as immutable (`dataclasses.replace` makes changed copies), but not frozen: a frozen dataclass's
    constructor sets each field through `object.__setattr__`, for every token of every sequence."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    ttft_s: float | None
    replica: str | None = None  # set by a Serve replica: which one served it
    # with `SamplingParams.logprobs`: per new token, its log-probability under the model (log_softmax of the raw
    # logits: before temperature, top-k or top-p) and the top `logprobs` (id, log-probability) pairs, best first
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with `SamplingParams.prompt_logprobs`, in the sequence's first output (index 0's): one entry per prompt
    # token, None for the first
    prompt_logprobs: list | None = None
    compressed_hit: bool = False  # the sequence resumed from a lossy checkpoint (see `Sequence.compressed_hit`)

    def wire(self) -> dict:
        """The fields to send over a process boundary (a Serve stream). A chunk before the last carries its
        deltas only, with `text` empty too (and `output_ids`, empty in such an output anyway): sending what
        grows with the output in every chunk would make a stream of n tokens carry O(n^2) data. The last chunk
        carries them in full."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.finished:
            out["text"], out["output_ids"] = "", []
        return out
