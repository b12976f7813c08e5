"""The prefix-aware routing decision as a pure function of predicted cost, and the router's memory as a plain
class with an injectable clock (no Ray): tests import both directly.

For each candidate replica `predict` estimates the request's time to first token there:

    uncached = prompt - checkpointed + resume          (tokens this request would prefill on that replica)
    work     = queued + uncached                        (prefill tokens ahead of its first token, its own included)
    steps    = ceil(work / (step_tokens - decoding))    (steps of the replica's token budget; decodes share each)
    ttft     = steps x step_fixed_s + step_token_s x (work + decoding x steps)

- checkpointed: the deepest checkpoint the prompt starts with, read from the replica's published checkpoint
  marks (per checkpoint: the hash of its prefix's last full block, and of the few tokens from there to the
  checkpoint, checked against the prompt's own tokens). A hybrid model resumes only at a checkpoint, so KV shared
  beyond it saves nothing for this request. A Responses continuation's hint (`Hint`) names the replica that served
  the stored response it continues: there the generation-end checkpoint of that response counts (its prompt +
  output - 1 - tail tokens) before any digest shows it, while the hint is fresh or the replica still holds the
  stored prompt's KV (`claimed`). A replica's host tier publishes marks too, with each entry's bytes: where one
  lies deeper than every pool checkpoint the prompt starts with, the engine will load it back, so the prediction
  resumes there and adds the load (its bytes at the replica's measured seconds per byte, `host_s_per_byte`).
- resume: what a hit still recomputes: the dasc-wr replay window; 0 for dense checkpoints and under dasc-nr,
  whose checkpoints are stored (and their marks published) `tail` tokens early, where a hit loads them.
- queued: the prefill tokens the replica reported waiting, plus what this router sent it since that report.
- step_fixed_s, step_token_s: the replica's measured step cost (a fit of step time against tokens per step).

The request goes to the least `score`:

    score = ttft + token_s x (work_weight x uncached - affinity_credit x kv beyond the checkpoint)

- work_weight (4): the prefill a request adds to a replica delays that replica's later requests as well as its
  own first token, so it counts beyond the request's own wait, about as many times as there are requests behind
  it. Without it each request takes the shorter queue whenever the queue ahead of its checkpoint costs more than
  the checkpoint saves it alone; under load that trades a hit for a miss that costs every later request at the
  other replica (measured on the reuse-distance replay with 2 replicas at concurrency 8: hit rate 0.27 at 0,
  0.32 at 1, 0.36 at 2 and 4). A hot prefix spills when the queue ahead of its holder costs more than
  (1 + work_weight) times what its checkpoint saves.
- affinity_credit (0.5): the KV the replica holds beyond its checkpoint (its digest, and what this router sent
  it lately) saves this request nothing, but the engine cuts a branch checkpoint where the prompt leaves that KV
  (`tail` tokens before, under a recompute tail), and the prefix's later requests resume there: keeping a
  prefix on one replica is what makes its checkpoints pay.
- key_credit (2): a replica that served the request's `prompt_cache_key` lately (it publishes the keys it
  served; this router remembers where it sent them) is credited this many of the request's prompts' prefill:
  requests sharing a key, which a client sends because they will share prefixes, stay on one replica until the
  queue ahead of them there costs more than that, then spill (and the key then sits on both).

The router's memory predicts that branch checkpoint, and the prompt-end one every request stores
(`expected_marks`), as soon as it sends the request, so the prefix's next request (or the conversation's next
turn) sees them before the replica's digest does. Scores within one block's prefill time of the best tie; ties
go to the replica with fewer of the recent decisions, then the lower id.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from app.cache.digest import matched_blocks, tail_hash


@dataclass(frozen=True)
class RouterKnobs:
    """block_size: tokens per hashed block (must equal the replicas' digest block).
    affinity_credit: weight of KV held beyond the checkpoint (see the module doc).
    work_weight: weight of the prefill the request adds to a replica, beyond its own wait (see the module doc);
    with affinity_credit 0 too, the request goes where its own TTFT is least.
    token_s, fixed_s, step_tokens: the step cost assumed for a replica that has not reported its own.
    host_s_per_byte: the host-tier load cost assumed for a replica that has not measured its own (1 GB/s).
    share_window: how many recent routing decisions break ties."""

    block_size: int = 16
    affinity_credit: float = 0.5
    work_weight: float = 4.0
    token_s: float = 1e-3
    fixed_s: float = 0.0
    step_tokens: int = 2048
    share_window: int = 64
    key_credit: float = 2.0
    host_s_per_byte: float = 1e-9
    fetch_s_per_byte: float = 1e-9  # a peer fetch's cost per byte until measured between the two replicas
    fetch_fixed_s: float = 0.05  # and its fixed cost (calls, export, filing)
    fetch_max_bytes: int = 512 * 2**20  # no fetch of a larger entry (object-store room)


@dataclass(frozen=True)
class Candidate:
    """A replica as the policy sees it. known: block hashes of the KV it holds (its digest) plus those this router
    sent it lately (KV it will hold); marks: its checkpoints (`app.cache.digest.checkpoint_mark`), by the
    hash of each one's last full block."""

    replica_id: str
    known: frozenset[int] = frozenset()
    marks: dict = field(default_factory=dict)  # block hash -> ((r, tail hash), ...) of its checkpoints
    queued: int = 0  # prefill tokens waiting there
    decoding: int = 0  # sequences decoding there
    resume: int = 0  # tokens a hit recomputes (the dasc-wr replay window)
    tail: int = 0  # tokens before a branch point or prompt end where the engine stores its checkpoint (nr tail)
    prompt_ends: bool = True  # whether it stores every prompt's end (admission "always"), or only seen ones
    lookback: int = 0  # it also checkpoints each prompt this many tokens before that (EngineConfig.lookback)
    lookback_align: int = 16
    token_s: float | None = None  # measured step cost per token; None: RouterKnobs.token_s
    fixed_s: float | None = None  # measured step cost whatever its tokens
    step_tokens: int | None = None  # the replica's token budget per step
    queue_len: int = 0  # requests there (reported), for the record
    recent: int = 0  # of the last share_window decisions, how many went here
    keys: frozenset[int] = frozenset()  # hashed prompt_cache_keys it served or was sent lately
    host_marks: dict = field(default_factory=dict)  # block hash -> ((r, tail hash, bytes), ...) of its host tier
    host_s_per_byte: float | None = None  # its measured host-tier load cost; None: RouterKnobs.host_s_per_byte
    # peer fetches (issue 40): whether it can pull an entry from a peer (a host tier to file it in), its published
    # pool checkpoints alone (no expected ones: a fetch needs a stored entry), what one of its pool entries weighs
    # (a checkpoint slot, and KV per token), and its measured fetch cost from each peer: (fixed s, s per byte)
    can_fetch: bool = False
    stored_marks: dict = field(default_factory=dict)
    state_bytes: int = 0
    kv_bytes_per_token: int = 0
    fetch_costs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Hint:
    """What the API knows about where a request's prefix lives (app/api/hints.py), as the router sees it.
    key: the hashed prompt_cache_key; replica, prompt, prefix: a Responses continuation's (the replica that served
    the stored response, that response's prompt and prompt + output lengths, which this prompt starts with);
    fresh: the response was stored within the router's memory horizon (no digest can show it yet)."""

    key: int | None = None
    replica: str | None = None
    prompt: int = 0
    prefix: int = 0
    fresh: bool = False


@dataclass(frozen=True)
class Prediction:
    checkpointed: int  # prompt tokens the deepest usable checkpoint covers
    uncached: int  # tokens this request prefills there
    ttft_s: float
    score: float
    kv: int = 0  # prompt tokens held as KV there (block-aligned)
    fetch_from: str | None = None  # the peer it pulls its checkpoint from first (None: it resumes from its own)
    fetch_bytes: int = 0



def expected_marks(c: Candidate, chain: list[int], tokens: list[int] | int, p: Prediction,
                   block: int) -> list[tuple[int, int, int]]:
    """The checkpoints this request will have replica `c` store, as marks (`checkpoint_mark`), given its
    prediction `p` there: the branch checkpoint where it leaves the KV shared beyond its checkpoint (whole blocks,
    `c.tail` tokens early), and with the prompt's ids, its prompt end (`c.tail` tokens early, where a repeat or the
    conversation's next turn resumes) when the replica admits prompt ends and it lies beyond the branch, and its
    lookback checkpoint (`c.lookback` tokens before that, aligned down), where the next prompt that differs only in
    its last tokens resumes: a burst of queries on a new header goes where the first one's checkpoint will be."""
    out, below = [], p.checkpointed
    blocks = max(0, p.kv - c.tail) // block
    if blocks * block > p.checkpointed:
        out.append((chain[blocks - 1], 0, tail_hash(chain[blocks - 1], [])))
        below = blocks * block
    if c.prompt_ends and not isinstance(tokens, int):
        at = len(tokens) - 1 - c.tail
        back = (at - c.lookback) // c.lookback_align * c.lookback_align if c.lookback else 0
        for pos in (at, back):
            k = min(pos // block, len(chain))
            if k and pos > below:
                out.append((chain[k - 1], pos - k * block, tail_hash(chain[k - 1], tokens[k * block : pos])))
    return out


def checkpointed(marks: dict, chain: list[int], tokens: list[int] | None, block: int) -> int:
    """Depth of the deepest checkpoint among `marks` that the prompt (`chain`, `tokens`) starts with: the prompt
    holds its last full block (the chain is chained, so every block before too) and its tail. Without the prompt's
    tokens only block-aligned checkpoints count."""
    return deepest(marks, chain, tokens, block)[0]


def deepest(marks: dict, chain: list[int], tokens: list[int] | None, block: int) -> tuple[int, tuple]:
    """`checkpointed`'s depth and the rest of that mark's tuple after (r, tail hash): (0, ()) for none."""
    for i in range(len(chain) - 1, -1, -1):  # a mark after block i lies deeper than any after block i - 1
        best = (0, ())
        for r, tail, *rest in marks.get(chain[i], ()):
            end = (i + 1) * block + r
            if tokens is None:
                ok = r == 0
            else:
                ok = end <= len(tokens) and tail_hash(chain[i], tokens[(i + 1) * block : end]) == tail
            if ok and end > best[0]:
                best = (end, tuple(rest))
        if best[0]:
            return best
    return 0, ()


def claimed(c: Candidate, chain: list[int], hint: Hint | None, block: int) -> int:
    """The depth of the stored response's generation-end checkpoint on `c` that `hint` vouches for (0: none): its
    prompt + output - 1 tokens (the last output token is never fed), `c.tail` early, if the hint names `c` and is
    fresh, or `c` still holds (or was lately sent) the KV of the stored prompt's full blocks."""
    if hint is None or hint.replica != c.replica_id or hint.prefix <= 0:
        return 0
    if not hint.fresh and matched_blocks(chain, c.known) < hint.prompt // block:
        return 0
    return max(0, hint.prefix - 1 - c.tail)


def predict(c: Candidate, chain: list[int], tokens: list[int] | int, knobs: RouterKnobs,
            hint: Hint | None = None, peers: list[Candidate] = ()) -> Prediction:
    """The request's predicted TTFT on `c` (see the module doc) and its score: resuming from what `c` holds, or,
    when that scores less, from a deeper entry a peer (`peers`) holds, fetched first. tokens: the prompt's ids, or
    only its length."""
    ids, prompt_len = (None, tokens) if isinstance(tokens, int) else (tokens, len(tokens))
    depth = max(checkpointed(c.marks, chain, ids, knobs.block_size), claimed(c, chain, hint, knobs.block_size))
    load_s = 0.0
    if c.host_marks:  # a deeper host-tier entry is loaded back before the request starts
        host, rest = deepest(c.host_marks, chain, ids, knobs.block_size)
        if host > depth:
            depth = host
            load_s = rest[0] * (knobs.host_s_per_byte if c.host_s_per_byte is None else c.host_s_per_byte)
    best = _priced(c, chain, prompt_len, depth, load_s, knobs, hint)
    for h in peers if c.can_fetch else ():
        if h.replica_id == c.replica_id:
            continue
        held, nbytes = stored(h, chain, ids, knobs.block_size)
        if held <= depth or nbytes > knobs.fetch_max_bytes:
            continue
        option = _priced(c, chain, prompt_len, held, fetch_s(c, h, nbytes, knobs), knobs, hint, h.replica_id, nbytes)
        if option.score < best.score:
            best = option
    return best


def _priced(c: Candidate, chain: list[int], prompt_len: int, depth: int, load_s: float, knobs: RouterKnobs,
            hint: Hint | None, fetch_from: str | None = None, fetch_bytes: int = 0) -> Prediction:
    """TTFT and score on `c` resuming at `depth` after `load_s` (a host-tier load, or a peer fetch)."""
    depth = min(depth, prompt_len - 1) if depth else 0
    uncached = prompt_len - depth + (c.resume if depth else 0)
    uncached = max(1, min(prompt_len, uncached))
    token_s = knobs.token_s if c.token_s is None else c.token_s
    fixed_s = knobs.fixed_s if c.fixed_s is None else c.fixed_s
    budget = max(1, (c.step_tokens or knobs.step_tokens) - c.decoding)
    work = c.queued + uncached
    steps = math.ceil(work / budget)
    ttft = steps * fixed_s + token_s * (work + c.decoding * steps) + load_s
    kv = matched_blocks(chain, c.known) * knobs.block_size
    score = ttft + token_s * (knobs.work_weight * uncached - knobs.affinity_credit * max(0, kv - depth))
    if hint is not None and hint.key is not None and hint.key in c.keys:
        score -= token_s * knobs.key_credit * prompt_len
    return Prediction(depth, uncached, ttft, score, kv, fetch_from, fetch_bytes)


def stored(h: Candidate, chain: list[int], tokens: list[int] | None, block: int) -> tuple[int, int]:
    """(depth, bytes) of the deepest entry `h` has stored (its published pool checkpoints, each a checkpoint slot and
    its prefix's KV, and its host-tier entries, each with its bytes) that the prompt starts with; (0, 0) for none."""
    pool, _ = deepest(h.stored_marks, chain, tokens, block)
    host, rest = deepest(h.host_marks, chain, tokens, block) if h.host_marks else (0, ())
    if host > pool:
        return host, rest[0]
    return pool, (h.state_bytes + pool * h.kv_bytes_per_token) if pool else 0


def fetch_s(c: Candidate, h: Candidate, nbytes: int, knobs: RouterKnobs) -> float:
    """What pulling `nbytes` from holder `h` to `c` costs before `c` can resume: the fixed cost and bytes at what
    `c` measured from `h` (the knobs' guess before a first fetch), plus one of `h`'s steps (it exports between
    steps)."""
    fixed, per_byte = c.fetch_costs.get(h.replica_id, (knobs.fetch_fixed_s, knobs.fetch_s_per_byte))
    budget = h.step_tokens or knobs.step_tokens
    step = (knobs.fixed_s if h.fixed_s is None else h.fixed_s) + \
        (knobs.token_s if h.token_s is None else h.token_s) * min(h.queued + h.decoding, budget)
    return fixed + per_byte * nbytes + step


def with_peer_costs(candidates: list[Candidate]) -> list[Candidate]:
    """A replica that has not measured its step cost yet (just started) is taken to cost what its measured peers
    do (their median), not the knobs' guess: a guess off by 3x would steer every request away from it or to it."""
    measured = [c for c in candidates if c.token_s is not None]
    if not measured or len(measured) == len(candidates):
        return candidates
    token_s = statistics.median(c.token_s for c in measured)
    fixed_s = statistics.median(c.fixed_s or 0.0 for c in measured)
    return [c if c.token_s is not None else replace(c, token_s=token_s, fixed_s=fixed_s) for c in candidates]


@dataclass(frozen=True)
class Decision:
    """`choose`'s answer: replica ids in preference ranks ([[chosen], [the rest by score]]), and the chosen one's
    prediction (its `fetch_from`: a peer to pull the checkpoint from first)."""

    ranks: list[list[str]]
    prediction: Prediction | None = None
    predictions: dict = field(default_factory=dict)  # every candidate's, by replica id


def choose(candidates: list[Candidate], chain: list[int], tokens: list[int] | int, knobs: RouterKnobs,
           hint: Hint | None = None) -> Decision:
    """The least score among the candidates, each resuming from what it holds or from a peer's deeper entry."""
    if not candidates:
        return Decision([])
    candidates = with_peer_costs(candidates)
    preds = {c.replica_id: predict(c, chain, tokens, knobs, hint, candidates) for c in candidates}
    tie = knobs.block_size * min((c.token_s if c.token_s is not None else knobs.token_s) for c in candidates)
    best = min(p.score for p in preds.values())
    chosen = min((c for c in candidates if preds[c.replica_id].score <= best + tie),
                 key=lambda c: (preds[c.replica_id].fetch_from is not None, c.recent, c.replica_id))
    rest = sorted((c for c in candidates if c is not chosen),
                  key=lambda c: (preds[c.replica_id].score, c.recent, c.replica_id))
    return Decision([[chosen.replica_id]] + ([[c.replica_id for c in rest]] if rest else []),
                    preds[chosen.replica_id], preds)


def rank(candidates: list[Candidate], chain: list[int], tokens: list[int] | int, knobs: RouterKnobs,
         hint: Hint | None = None) -> list[list[str]]:
    """Replica ids in preference ranks: [[chosen], [the rest by score]]. tokens: the prompt's ids, or its length."""
    return choose(candidates, chain, tokens, knobs, hint).ranks


class RouterMemory:
    """What one router remembers between decisions. `clock`: seconds, monotonic.

    - each replica's published stats; a new `version` is noted with the time it was first seen;
    - per replica, the block hashes this router sent it and when. A hash sent at t is known until t + remember_s
      (inclusive), so requests sharing a new prefix stick to one replica until its digest shows the prefix; and
      it is dropped earlier when a digest first seen more than `settle_s` after t does not hold it (the replica
      evicted it, or its codec changed and dropped its checkpoints);
    - per replica, the checkpoints it expects a sent request to store (`routed(marks=...)`, `expected_marks`),
      held until a stats version first seen more than `settle_s` after the send
      (which shows the real mark, or shows that none was cut) or for remember_s;
    - per replica, the prefill tokens sent since its last stats version, of which the latest `queue_len` (the
      requests in flight there, when known, plus those routed but not yet `confirmed` as sent) are added to the
      reported queue: a request that finished before the next stats no longer counts;
    - per replica, the prompt_cache_keys (hashed) this router sent it and when, for remember_s, beside those its
      stats publish;
    - the replicas of the last `share_window` routing decisions (`Candidate.recent`)."""

    def __init__(self, remember_s: float, share_window: int, settle_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remember_s, self.settle_s, self.clock = remember_s, settle_s, clock
        self._recent: deque[str] = deque(maxlen=share_window)
        self._routed: dict[str, dict[int, float]] = {}  # replica -> block hash -> when it was sent there
        self._sent: dict[str, list[int]] = {}  # replica -> prefill tokens sent since its stats version
        self._unconfirmed: dict[str, int] = {}  # replica -> routed there, not yet seen sent (Ray counts it then)
        self._expected: dict[str, dict[tuple, float]] = {}  # replica -> expected mark -> when
        self._keys: dict[str, dict[int, float]] = {}  # replica -> hashed prompt_cache_key -> when it was sent there
        # replica -> (stats version, when first seen, digest, marks, host-tier marks)
        self._stats: dict[str, tuple[object, float, frozenset[int], dict]] = {}

    def routed(self, replica_id: str, chain: list[int], tokens: int = 0, marks: list[tuple] = (),
               confirmed: bool = True, key: int | None = None) -> None:
        """One decision: the request with block hashes `chain` (and hashed prompt_cache_key `key`), predicted to
        prefill `tokens` there and to have the replica store checkpoints at `marks` (`expected_marks`), went to
        `replica_id`. confirmed=False: decided, not yet sent (see `confirmed`)."""
        self._recent.append(replica_id)
        now = self.clock()
        if key is not None:
            self._keys.setdefault(replica_id, {})[key] = now
        self._routed.setdefault(replica_id, {}).update((h, now) for h in chain)
        self._sent.setdefault(replica_id, []).append(tokens)
        if marks:
            self._expected.setdefault(replica_id, {}).update((m, now) for m in marks)
        if not confirmed:
            self._unconfirmed[replica_id] = self._unconfirmed.get(replica_id, 0) + 1

    def confirmed(self, replica_id: str) -> None:
        """A request `routed(confirmed=False)` to `replica_id` was sent there: the replica's request count now
        includes it."""
        if self._unconfirmed.get(replica_id, 0) > 0:
            self._unconfirmed[replica_id] -= 1

    def candidate(self, replica_id: str, stats: dict | None, queue_len: int | None) -> Candidate:
        """The replica as `rank` sees it. stats: its published routing stats (`record_routing_stats`), None
        before the first; queue_len: a fresher request count than the stats' (None: use the stats')."""
        stats = stats or {}
        now = self.clock()
        version = stats.get("version")
        held = self._stats.get(replica_id)
        routed = self._routed.setdefault(replica_id, {})
        if held is None or held[0] != version:
            marks: dict[int, tuple] = {}
            for h, r, tail in stats.get("marks", ()):
                marks[h] = marks.get(h, ()) + ((r, tail),)
            host: dict[int, tuple] = {}
            for h, r, tail, nbytes in stats.get("host_marks", ()):
                host[h] = host.get(h, ()) + ((r, tail, nbytes),)
            held = (version, now, frozenset(stats.get("digest", ())), marks, host)
            self._stats[replica_id] = held
            self._sent[replica_id] = []  # taken as counted in the new stats' queue
            self._unconfirmed[replica_id] = 0
            if version is not None:  # a digest to disagree with
                for h in [h for h, t in routed.items() if t < now - self.settle_s and h not in held[2]]:
                    del routed[h]
                expected = self._expected.get(replica_id, {})
                for h in [h for h, t in expected.items() if t < now - self.settle_s]:
                    del expected[h]
        horizon = now - self.remember_s
        for memory in (routed, self._expected.get(replica_id, {}), self._keys.get(replica_id, {})):
            for h in [h for h, t in memory.items() if t < horizon]:
                del memory[h]
        sent = self._sent.get(replica_id, [])
        if queue_len is not None:  # at most the latest sends, as many as are in flight there, count
            in_flight = queue_len + self._unconfirmed.get(replica_id, 0)
            sent = sent[len(sent) - in_flight:] if in_flight < len(sent) else sent
        sent = sum(sent)
        marks = held[3]
        if self._expected.get(replica_id):
            marks = dict(marks)
            for h, r, tail in self._expected[replica_id]:
                marks[h] = marks.get(h, ()) + ((r, tail),)
        return Candidate(
            replica_id, held[2] | frozenset(routed) if routed else held[2], marks,
            queued=int(stats.get("prefill_tokens", 0)) + sent, decoding=int(stats.get("decoding", 0)),
            resume=int(stats.get("resume_tokens", 0)), tail=int(stats.get("tail_tokens", 0)),
            prompt_ends=bool(stats.get("prompt_ends", True)), lookback=int(stats.get("lookback", 0)),
            lookback_align=int(stats.get("lookback_align", 16)),
            token_s=stats.get("step_token_s"), fixed_s=stats.get("step_fixed_s"), step_tokens=stats.get("step_tokens"),
            queue_len=int(stats.get("queue", 0) if queue_len is None else queue_len),
            recent=sum(1 for r in self._recent if r == replica_id),
            keys=frozenset(stats.get("keys", ())) | frozenset(self._keys.get(replica_id, ())),
            host_marks=held[4], host_s_per_byte=stats.get("host_s_per_byte"),
            can_fetch=bool(stats.get("can_fetch", False)), stored_marks=held[3],
            state_bytes=int(stats.get("state_bytes", 0)), kv_bytes_per_token=int(stats.get("kv_bytes_per_token", 0)),
            fetch_costs={peer: tuple(cost) for peer, cost in (stats.get("fetch_costs") or {}).items()})
