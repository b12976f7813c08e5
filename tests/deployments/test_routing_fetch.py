"""The router's third option (issue 40), priced by `routing_policy.choose`: besides queueing at the replica that
holds a prompt's checkpoint and recomputing elsewhere, a replica that can fetch pulls the holder's entry first.
Unit cases: a busy holder with an idle peer (fetch), a slow link (recompute), an idle holder (stay), and the
limits: no fetch of an entry the holder has not stored yet, of one over the byte cap, by a replica without a
host tier, or across salts."""

from __future__ import annotations

from dataclasses import replace

from app.cache.digest import block_hashes, checkpoint_mark
from deployments.router_memory import RouterMemory
from deployments.routing_policy import Candidate, RouterKnobs, choose, fetch_s, stored
from tests.deployments.test_router_memory import _Clock

KNOBS = RouterKnobs(block_size=4, affinity_credit=0.5, work_weight=4.0, token_s=1e-3, fixed_s=0.0, step_tokens=10_000,
                    fetch_fixed_s=0.05, fetch_s_per_byte=1e-9)
PROMPT = list(range(400))
CHAIN = block_hashes(PROMPT, 4)
MARK = checkpoint_mark(PROMPT[:396], 4)  # the holder's checkpoint: the prompt's first 396 tokens
POOL = {MARK[0]: ((MARK[1], MARK[2]),)}
# the holder: a pool checkpoint it published, 100 kB a slot and 1 kB of KV a token (496 kB for this entry), busy
# with 3,000 tokens queued; its steps take at most 256 tokens (0.256 s at 1 ms a token), plus 10 ms each whatever
# their tokens (its bookkeeping, which an export may wait for)
HOLDER = Candidate("a", marks=POOL, stored_marks=POOL, state_bytes=100_000, kv_bytes_per_token=1_000, queued=3000,
                   step_tokens=256, fixed_s=0.01, token_s=1e-3)
PEER = Candidate("b", can_fetch=True)


def test_an_idle_peer_fetches_from_a_busy_holder():
    """Queueing at the holder: 3.1 s; recomputing at the peer: 0.4 s (2.0 of score with the work weight); fetching:
    0.05 s + 496 kB at 1 GB/s + the holder's step bookkeeping (10 ms), then one step of 4 tokens (the peer, not
    measured yet, is taken to cost what the holder does: 10 ms + 4 ms): the fetch wins."""
    assert stored(HOLDER, CHAIN, PROMPT, 4) == (396, 496_000, "pool")
    d = choose([HOLDER, PEER], CHAIN, PROMPT, KNOBS)
    assert d.ranks[0] == ["b"] and d.prediction.fetch_from == "a" and d.prediction.fetch_bytes == 496_000
    assert abs(d.prediction.ttft_s - (0.05 + 496_000e-9 + 0.01 + 0.01 + 4e-3)) < 1e-9


def test_a_slow_link_recomputes_instead():
    """Measured from the holder at 10 MB/s, the entry takes 5 s to come: the peer recomputes (no fetch)."""
    slow = replace(PEER, fetch_costs={"a": (0.05, 1e-7 * 100)})
    d = choose([HOLDER, slow], CHAIN, PROMPT, KNOBS)
    assert d.ranks[0] == ["b"] and d.prediction.fetch_from is None and d.prediction.checkpointed == 0


def test_an_idle_holder_keeps_the_request():
    d = choose([replace(HOLDER, queued=0), PEER], CHAIN, PROMPT, KNOBS)
    assert d.ranks[0] == ["a"] and d.prediction.fetch_from is None and d.prediction.checkpointed == 396
    assert d.predictions["b"].fetch_from == "a"  # were Ray to send it to its second choice, that one fetches


def test_a_holders_step_bookkeeping_counts_in_the_fetch_its_forward_does_not():
    """A holder exports during its forward (cache_call), so its step's size does not delay a fetch; its step's
    fixed cost (bookkeeping under the cache lock) does: at 2 s a step, recomputing wins."""
    assert fetch_s(PEER, replace(HOLDER, step_tokens=2000), 496_000, KNOBS) == fetch_s(PEER, HOLDER, 496_000, KNOBS)
    d = choose([replace(HOLDER, fixed_s=2.0), PEER], CHAIN, PROMPT, KNOBS)
    assert d.prediction.fetch_from is None and d.ranks[0] == ["b"]
    assert fetch_s(PEER, replace(HOLDER, fixed_s=2.0), 496_000, KNOBS) > 2.0


def test_no_fetch_of_what_is_not_stored_over_the_cap_without_a_host_tier_or_across_salts():
    expected = replace(HOLDER, stored_marks={})  # the router expects it there; the holder has not published it
    assert choose([expected, PEER], CHAIN, PROMPT, KNOBS).prediction.fetch_from is None
    capped = replace(KNOBS, fetch_max_bytes=400_000)
    assert choose([HOLDER, PEER], CHAIN, PROMPT, capped).prediction.fetch_from is None
    # the object store's room, published by the fetcher or by the holder, caps it too
    assert choose([HOLDER, replace(PEER, fetch_room=400_000)], CHAIN, PROMPT, KNOBS).prediction.fetch_from is None
    assert choose([replace(HOLDER, fetch_room=400_000), PEER], CHAIN, PROMPT, KNOBS).prediction.fetch_from is None
    assert choose([HOLDER, replace(PEER, fetch_room=500_000)], CHAIN, PROMPT, KNOBS).prediction.fetch_from == "a"
    assert choose([HOLDER, replace(PEER, can_fetch=False)], CHAIN, PROMPT, KNOBS).prediction.fetch_from is None
    salted = block_hashes(PROMPT, 4, "tenant-b")  # another tenant's prompt: its chain matches no mark of the holder
    assert choose([HOLDER, PEER], salted, PROMPT, KNOBS).prediction.checkpointed == 0


def test_a_host_tier_entry_of_the_holder_is_fetched_at_its_bytes():
    h, r, tail = checkpoint_mark(PROMPT[:300], 4)
    holder = replace(HOLDER, marks={}, stored_marks={}, host_marks={h: ((r, tail, 80_000),)})
    assert stored(holder, CHAIN, PROMPT, 4) == (300, 80_000, "host")
    d = choose([holder, PEER], CHAIN, PROMPT, KNOBS)
    assert d.prediction.fetch_from == "a" and d.prediction.checkpointed == 300


def test_the_router_reads_what_fetches_need_from_the_stats():
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    h, r, tail = MARK
    c = memory.candidate("a", {"version": 1, "marks": [(h, r, tail)], "can_fetch": True, "state_bytes": 100,
                               "kv_bytes_per_token": 10, "fetch_costs": {"b": [0.01, 2e-9]}, "fetch_room": 7}, None)
    assert c.can_fetch and c.stored_marks == {h: ((r, tail),)} and c.state_bytes == 100 and c.fetch_room == 7
    assert c.kv_bytes_per_token == 10 and c.fetch_costs == {"b": (0.01, 2e-9)}
    memory.routed("a", CHAIN, 400, marks=[(h, 1, 2)])  # an expected mark: in `marks`, not in `stored_marks`
    c = memory.candidate("a", {"version": 1, "marks": [(h, r, tail)]}, None)
    assert (1, 2) in c.marks[h] and c.stored_marks == {h: ((r, tail),)}


def test_a_peer_fetches_a_holders_disk_entry_priced_with_the_holders_read():
    """A holder whose disk tier (not its pools) holds the entry: the fetch adds the holder's read of its bytes; a
    slow disk there makes recomputing win. Pool and host entries as deep are preferred (no read)."""
    disk = replace(HOLDER, marks={}, stored_marks={}, disk_marks={MARK[0]: ((MARK[1], MARK[2], 496_000),)},
                   disk_s_per_byte=1e-9)
    assert stored(disk, CHAIN, PROMPT, 4) == (396, 496_000, "disk")
    d = choose([disk, PEER], CHAIN, PROMPT, KNOBS)
    assert d.ranks[0] == ["b"] and d.prediction.fetch_from == "a"
    assert abs(d.prediction.ttft_s - (0.05 + 2 * 496_000e-9 + 0.01 + 0.01 + 4e-3)) < 1e-9
    assert choose([replace(disk, disk_s_per_byte=1e-5), PEER], CHAIN, PROMPT, KNOBS).prediction.fetch_from is None
    both = replace(disk, stored_marks=POOL)
    assert stored(both, CHAIN, PROMPT, 4) == (396, 496_000, "pool")
