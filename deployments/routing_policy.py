"""The prefix-aware routing decision as a pure function of predicted cost (no Ray; the router's memory of what it
sent where is deployments/router_memory.py): tests import both directly.

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
  resumes there and adds the load (its bytes at the replica's measured seconds per byte, `host_s_per_byte`). Its
  disk tier's marks likewise, adding the read (`disk_s_per_byte`) to the load.
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
from dataclasses import dataclass, field, replace

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
    disk_s_per_byte: float = 1e-9  # a disk-tier read's cost for a replica that has not measured its own (1 GB/s)
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
    disk_marks: dict = field(default_factory=dict)  # block hash -> ((r, tail hash, bytes), ...) of its disk tier
    disk_s_per_byte: float | None = None  # its measured disk read cost; None: RouterKnobs.disk_s_per_byte
    # peer fetches (issue 40): whether it can pull an entry from a peer (a host tier to file it in), its published
    # pool checkpoints alone (no expected ones: a fetch needs a stored entry), what one of its pool entries weighs
    # (a checkpoint slot, and KV per token), and its measured fetch cost from each peer: (fixed s, s per byte)
    can_fetch: bool = False
    fetch_room: int | None = None  # the largest entry its object store takes for a fetch (None: not capped)
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
    # a deeper host-tier entry is loaded back before the request starts; a deeper disk-tier one read, then loaded
    for marks, s_per_byte in ((c.host_marks, _host_s(c, knobs)), (c.disk_marks, _disk_s(c, knobs) + _host_s(c, knobs))):
        held, rest = deepest(marks, chain, ids, knobs.block_size) if marks else (0, ())
        if held > depth:
            depth, load_s = held, rest[0] * s_per_byte
    best = _priced(c, chain, prompt_len, depth, load_s, knobs, hint)
    for h in peers if c.can_fetch else ():
        if h.replica_id == c.replica_id:
            continue
        held, nbytes, tier = stored(h, chain, ids, knobs.block_size)
        if held <= depth or nbytes > min(knobs.fetch_max_bytes, c.fetch_room or nbytes, h.fetch_room or nbytes):
            continue
        cost = fetch_s(c, h, nbytes, knobs) + (nbytes * _disk_s(h, knobs) if tier == "disk" else 0.0)
        option = _priced(c, chain, prompt_len, held, cost, knobs, hint, h.replica_id, nbytes)
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


def stored(h: Candidate, chain: list[int], tokens: list[int] | None, block: int) -> tuple[int, int, str | None]:
    """(depth, bytes, tier) of the deepest entry `h` has stored that the prompt starts with: its published pool
    checkpoints (each a checkpoint slot and its prefix's KV), its host-tier and its disk-tier entries (each with its
    bytes; the holder reads a disk entry before it exports it); (0, 0, None) for none."""
    best = (0, 0, None)
    pool, _ = deepest(h.stored_marks, chain, tokens, block)
    if pool:
        best = (pool, h.state_bytes + pool * h.kv_bytes_per_token, "pool")
    for tier, marks in (("host", h.host_marks), ("disk", h.disk_marks)):
        depth, rest = deepest(marks, chain, tokens, block) if marks else (0, ())
        if depth > best[0]:
            best = (depth, rest[0], tier)
    return best


def _host_s(c: Candidate, knobs: RouterKnobs) -> float:
    return knobs.host_s_per_byte if c.host_s_per_byte is None else c.host_s_per_byte


def _disk_s(c: Candidate, knobs: RouterKnobs) -> float:
    return knobs.disk_s_per_byte if c.disk_s_per_byte is None else c.disk_s_per_byte


def fetch_s(c: Candidate, h: Candidate, nbytes: int, knobs: RouterKnobs) -> float:
    """What pulling `nbytes` from holder `h` to `c` costs before `c` can resume: the fixed cost and bytes at what
    `c` measured from `h` (the knobs' guess before a first fetch), plus `h`'s fixed step cost: it exports during a
    step's forward or between steps, waiting at most for a step's bookkeeping, not for its forward."""
    fixed, per_byte = c.fetch_costs.get(h.replica_id, (knobs.fetch_fixed_s, knobs.fetch_s_per_byte))
    return fixed + per_byte * nbytes + (knobs.fixed_s if h.fixed_s is None else h.fixed_s)


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
