"""The router's hints, priced by its cost model (`routing_policy.predict` and `rank` with a `Hint`, and the
router's memory of prompt_cache_keys): a Responses continuation goes to the replica that served the stored
response unless the queue there costs more than the prefix saves, a stale hint counts only where the stored
prompt's KV still is, requests sharing a prompt_cache_key stay on one replica until its queue costs more than
the key's credit, and a host-tier entry deeper than the pools counts with its load cost."""

from __future__ import annotations

from dataclasses import replace

from app.cache.digest import block_hashes, checkpoint_mark
from deployments.router_memory import RouterMemory
from deployments.routing_policy import Candidate, Hint, RouterKnobs, predict, rank
from tests.deployments.test_router_memory import _Clock

KNOBS = RouterKnobs(block_size=4, affinity_credit=0.5, work_weight=4.0, token_s=1e-3, fixed_s=0.0, step_tokens=10_000,
                    key_credit=2.0)
PROMPT = list(range(400))
CHAIN = block_hashes(PROMPT, 4)
# the stored response: a 300-token prompt and 80 tokens of output, which PROMPT starts with
STORED = dict(prompt=300, prefix=380)


def test_a_continuation_counts_the_stored_response_checkpoint_on_the_replica_that_served_it():
    hint = Hint(replica="a", fresh=True, **STORED)
    served, other = Candidate("a"), Candidate("b")
    assert predict(served, CHAIN, PROMPT, KNOBS, hint).checkpointed == 379  # the last output token is never fed
    assert predict(other, CHAIN, PROMPT, KNOBS, hint).checkpointed == 0
    assert predict(Candidate("a", tail=8), CHAIN, PROMPT, KNOBS, hint).checkpointed == 371  # stored tail early
    assert rank([served, other], CHAIN, PROMPT, KNOBS, hint)[0] == ["a"]


def test_a_continuation_leaves_its_replica_when_the_queue_there_costs_more_than_the_prefix_saves():
    """Elsewhere it prefills 400 tokens (2.0 s of score with the work weight); at its replica 21 plus the queue:
    it stays while the queue is below 1895 tokens."""
    hint = Hint(replica="a", fresh=True, **STORED)
    assert rank([Candidate("a", queued=1000), Candidate("b")], CHAIN, PROMPT, KNOBS, hint)[0] == ["a"]
    assert rank([Candidate("a", queued=3000), Candidate("b")], CHAIN, PROMPT, KNOBS, hint)[0] == ["b"]


def test_a_stale_hint_counts_only_where_the_stored_prompt_kv_still_is():
    """Past the router's memory horizon the hint vouches for nothing by itself: the replica must still hold (or
    have been sent lately) the stored prompt's 75 full blocks. Without them the tie goes to the lower id."""
    stale = Hint(replica="b", fresh=False, **STORED)
    assert rank([Candidate("a"), Candidate("b")], CHAIN, PROMPT, KNOBS, stale)[0] == ["a"]
    holding = Candidate("b", known=frozenset(CHAIN[:75]))
    assert predict(holding, CHAIN, PROMPT, KNOBS, stale).checkpointed == 379
    assert rank([Candidate("a"), holding], CHAIN, PROMPT, KNOBS, stale)[0] == ["b"]
    evicted = Candidate("b", known=frozenset(CHAIN[:40]))
    assert predict(evicted, CHAIN, PROMPT, KNOBS, stale).checkpointed == 0


def test_a_prompt_cache_key_keeps_its_requests_on_one_replica_while_the_queue_there_costs_less_than_its_credit():
    """No common prefix: the key alone decides. Its replica is credited two prompts' prefill (0.8 s): it keeps the
    requests until the queue ahead of them there passes 800 tokens."""
    key = Hint(key=7)
    assert rank([Candidate("a"), Candidate("b", keys=frozenset({7}))], CHAIN, PROMPT, KNOBS, key)[0] == ["b"]
    assert rank([Candidate("a"), Candidate("b", keys=frozenset({7}), queued=700)], CHAIN, PROMPT, KNOBS,
                key)[0] == ["b"]
    assert rank([Candidate("a"), Candidate("b", keys=frozenset({7}), queued=900)], CHAIN, PROMPT, KNOBS,
                key)[0] == ["a"]
    assert rank([Candidate("a"), Candidate("b", keys=frozenset({8}))], CHAIN, PROMPT, KNOBS, key)[0] == ["a"]
    assert rank([Candidate("a"), Candidate("b", keys=frozenset({7}))], CHAIN, PROMPT, KNOBS)[0] == ["a"]  # no key


def test_the_router_remembers_where_it_sent_a_key_for_remember_s_beside_the_keys_replicas_publish():
    clock = _Clock()
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=clock)
    memory.routed("a", CHAIN, 400, key=7)
    assert memory.candidate("a", None, None).keys == {7} and memory.candidate("b", None, None).keys == frozenset()
    clock.now = 111.0
    assert memory.candidate("a", None, None).keys == frozenset()
    assert memory.candidate("b", {"version": 1, "keys": [7, 9]}, None).keys == {7, 9}


def test_a_host_tier_entry_counts_where_it_lies_deeper_than_the_pools_with_its_load_cost():
    """A replica whose host tier holds the prompt's first 300 tokens (100 kB) resumes there after loading them:
    at its measured 1 GB/s that costs 0.1 ms and wins over a cold peer; at 1 MB/s (0.1 s) it still wins over
    prefilling 300 tokens (0.3 s at 1 ms a token), and at 10 kB/s (10 s) it loses. Pool marks as deep win."""
    h, r, tail = checkpoint_mark(PROMPT[:300], 4)
    host = {h: ((r, tail, 100_000),)}
    fast = Candidate("b", host_marks=host, host_s_per_byte=1e-9)
    p = predict(fast, CHAIN, PROMPT, KNOBS)
    assert p.checkpointed == 300 and abs(p.ttft_s - (100 * 1e-3 + 1e-4)) < 1e-9
    assert rank([Candidate("a"), fast], CHAIN, PROMPT, KNOBS)[0] == ["b"]
    assert rank([Candidate("a"), replace(fast, host_s_per_byte=1e-6)], CHAIN, PROMPT, KNOBS)[0] == ["b"]
    assert rank([Candidate("a"), replace(fast, host_s_per_byte=1e-4)], CHAIN, PROMPT, KNOBS)[0] == ["a"]
    pooled = replace(fast, marks={h: ((r, tail),)}, host_s_per_byte=1e-4)  # the pools hold it too: no load
    assert predict(pooled, CHAIN, PROMPT, KNOBS).ttft_s == 100 * 1e-3


def test_the_router_reads_host_marks_from_the_stats():
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    h, r, tail = checkpoint_mark(PROMPT[:300], 4)
    c = memory.candidate("a", {"version": 1, "host_marks": [(h, r, tail, 5000)], "host_s_per_byte": 2e-9}, None)
    assert c.host_marks == {h: ((r, tail, 5000),)} and c.host_s_per_byte == 2e-9


def test_a_disk_tier_entry_counts_with_its_read_and_load_cost():
    """Tier marks in digests (issue 40): a disk-tier entry of the prompt's first 300 tokens (100 kB) resumes there
    after a read and a load: at 1 GB/s each (0.2 ms) it wins over a cold peer; at a 10 kB/s disk (10 s) it loses.
    A host-tier or pool mark as deep is taken first, without the read."""
    h, r, tail = checkpoint_mark(PROMPT[:300], 4)
    disk = Candidate("b", disk_marks={h: ((r, tail, 100_000),)}, disk_s_per_byte=1e-9, host_s_per_byte=1e-9)
    p = predict(disk, CHAIN, PROMPT, KNOBS)
    assert p.checkpointed == 300 and abs(p.ttft_s - (100 * 1e-3 + 2e-4)) < 1e-9
    assert rank([Candidate("a"), disk], CHAIN, PROMPT, KNOBS)[0] == ["b"]
    assert rank([Candidate("a"), replace(disk, disk_s_per_byte=1e-4)], CHAIN, PROMPT, KNOBS)[0] == ["a"]
    hosted = replace(disk, host_marks={h: ((r, tail, 100_000),)}, disk_s_per_byte=1e-4)
    assert abs(predict(hosted, CHAIN, PROMPT, KNOBS).ttft_s - (100 * 1e-3 + 1e-4)) < 1e-9
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    c = memory.candidate("b", {"version": 1, "disk_marks": [(h, r, tail, 100_000)], "disk_s_per_byte": 3e-9}, None)
    assert c.disk_marks == {h: ((r, tail, 100_000),)} and c.disk_s_per_byte == 3e-9
