"""The router's memory (`RouterMemory`, driven by a scripted clock): what the router knows of each replica between
digests (the prefixes and the prefill it sent there), and when it forgets."""

from __future__ import annotations

from app.cache.digest import block_hashes, checkpoint_mark
from deployments.router_memory import RouterMemory
from deployments.routing_policy import RouterKnobs, predict, rank

KNOBS = RouterKnobs(block_size=4, share_window=20)
CHAIN = block_hashes(list(range(40)), 4)  # 10 blocks


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_routed_hashes_are_known_for_remember_s_then_forgotten():
    clock = _Clock()
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=clock)
    memory.routed("a", CHAIN)
    assert memory.candidate("a", None, None).known == frozenset(CHAIN)
    assert memory.candidate("b", None, None).known == frozenset()
    clock.now = 110.0  # exactly remember_s later: still known
    assert memory.candidate("a", None, None).known == frozenset(CHAIN)
    clock.now = 110.5
    assert memory.candidate("a", None, None).known == frozenset()
    clock.now = 111.0  # forgotten for good, not only hidden
    assert memory.candidate("a", None, None).known == frozenset()


def test_routing_a_prefix_again_refreshes_its_hashes():
    clock = _Clock()
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=clock)
    memory.routed("a", CHAIN)
    clock.now = 108.0
    memory.routed("a", CHAIN[:4])
    clock.now = 115.0  # the first 4 blocks were sent 7 s ago, the rest 15 s ago
    assert memory.candidate("a", None, None).known == frozenset(CHAIN[:4])


def test_the_digest_is_reread_only_when_its_version_changes():
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    first = memory.candidate("a", {"version": 1, "digest": CHAIN[:3], "marks": [(CHAIN[2], 1, 7), (CHAIN[2], 3, 8)],
                                   "queue": 2}, None)
    assert first.known == frozenset(CHAIN[:3]) and first.marks == {CHAIN[2]: ((1, 7), (3, 8))} and first.queue_len == 2
    same = memory.candidate("a", {"version": 1, "digest": CHAIN, "queue": 5, "prefill_tokens": 7}, None)
    assert same.known == frozenset(CHAIN[:3]) and same.queue_len == 5 and same.queued == 7  # the load: always
    assert memory.candidate("a", {"version": 2, "digest": CHAIN[5:], "queue": 0}, None).known == frozenset(CHAIN[5:])
    memory.routed("a", CHAIN[:2])
    assert memory.candidate("a", {"version": 2, "digest": CHAIN[5:]}, None).known == frozenset(CHAIN[:2] + CHAIN[5:])


def test_a_sent_prefix_a_later_digest_does_not_hold_is_forgotten():
    """Within settle_s of sending, a digest may predate the request, so the memory keeps the prefix; a digest first
    seen later than that which lacks it (evicted, or dropped by a codec change) makes the router forget it."""
    clock = _Clock()
    memory = RouterMemory(remember_s=30.0, share_window=8, settle_s=2.0, clock=clock)
    memory.routed("a", CHAIN)
    clock.now += 1.0
    assert memory.candidate("a", {"version": 1, "digest": []}, None).known == frozenset(CHAIN)  # too soon to tell
    clock.now += 2.0
    assert memory.candidate("a", {"version": 2, "digest": CHAIN[:4]}, None).known == frozenset(CHAIN[:4])
    memory.routed("a", CHAIN)
    clock.now += 3.0
    assert memory.candidate("a", {"version": 3, "digest": CHAIN}, None).known == frozenset(CHAIN)  # held: kept


def test_prefill_sent_since_the_last_stats_adds_to_the_reported_queue():
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    stats = {"version": 1, "prefill_tokens": 100, "decoding": 2, "step_token_s": 1e-4, "resume_tokens": 64}
    assert memory.candidate("a", stats, None).queued == 100
    memory.routed("a", CHAIN, 300)
    memory.routed("a", CHAIN, 50)
    c = memory.candidate("a", stats, None)
    assert (c.queued, c.decoding, c.token_s, c.resume) == (450, 2, 1e-4, 64)
    assert memory.candidate("a", stats, 1).queued == 150  # one request in flight: the latest send
    assert memory.candidate("a", stats, 0).queued == 100  # none in flight: both finished
    assert memory.candidate("a", {**stats, "version": 2, "prefill_tokens": 80}, None).queued == 80  # counted there


def test_queue_length_prefers_the_fresher_value():
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    assert memory.candidate("a", {"version": 1, "queue": 3}, 1).queue_len == 1
    assert memory.candidate("a", {"version": 1, "queue": 3}, 0).queue_len == 0
    assert memory.candidate("a", {"version": 1, "queue": 3}, None).queue_len == 3
    assert memory.candidate("b", None, None).queue_len == 0


def test_recent_counts_cover_the_last_share_window_decisions():
    memory = RouterMemory(remember_s=10.0, share_window=3, clock=_Clock())
    for rid in ("a", "a", "b", "a", "b"):
        memory.routed(rid, [])
    assert [memory.candidate(r, None, None).recent for r in ("a", "b", "c")] == [1, 2, 0]  # window: a b ... b


def test_a_new_prefix_sticks_to_its_replica_until_remember_s_passes():
    """No digest shows the prefix: only the memory keeps its repeats on the replica the first one went to (the
    affinity credit for KV sent there)."""
    knobs = KNOBS
    clock = _Clock()
    memory = RouterMemory(remember_s=10.0, share_window=knobs.share_window, clock=clock)
    stats = {"version": 1, "digest": [], "queue": 0}

    def route() -> str:
        chosen = rank([memory.candidate(r, stats, None) for r in ("a", "b")], CHAIN, 40, knobs)[0][0]
        memory.routed(chosen, CHAIN)
        return chosen

    assert route() == "a"  # no match anywhere: least loaded, then lowest id
    clock.now += 5.0
    assert route() == "a"  # b is less used, but a is known to hold the prefix
    clock.now += 10.0  # the second routing was 10 s ago: still remembered
    assert route() == "a"
    clock.now += 10.5
    assert route() == "b"  # forgotten: back to load, where b has the fewer recent decisions


def test_the_checkpoints_a_sent_request_will_store_show_until_the_digest_can():
    """Sent with the marks it will have the replica store (its branch, its prompt end), the request makes the
    next request of that prefix, or the next turn of that conversation, see them at once, until a digest first
    seen settle_s after the send (which shows the real marks, or that none were stored) takes over."""
    clock = _Clock()
    memory = RouterMemory(remember_s=30.0, share_window=8, settle_s=2.0, clock=clock)
    prompt = list(range(40))
    memory.routed("a", CHAIN, 40, marks=[checkpoint_mark(prompt[:24], 4), checkpoint_mark(prompt[:39], 4)])
    c = memory.candidate("a", {"version": 1, "digest": []}, None)
    assert predict(c, CHAIN, prompt, KNOBS).checkpointed == 39
    assert predict(c, CHAIN, prompt[:30] + [7] * 10, KNOBS).checkpointed == 24  # leaves it before the prompt end
    assert predict(memory.candidate("b", None, None), CHAIN, prompt, KNOBS).checkpointed == 0
    clock.now += 1.0
    assert predict(memory.candidate("a", {"version": 2, "digest": []}, None), CHAIN, prompt, KNOBS).checkpointed == 39
    clock.now += 2.0  # version 3 is first seen 3 s after the send: the digest decides
    assert memory.candidate("a", {"version": 3, "digest": CHAIN, "marks": []}, None).marks == {}


def test_a_decision_counts_toward_the_queue_before_ray_reports_the_request_sent():
    """Ray counts a request in a replica's queue length once it is sent, and a burst of requests is routed before
    the first is sent: unconfirmed decisions count on top of the queue length."""
    memory = RouterMemory(remember_s=10.0, share_window=8, clock=_Clock())
    stats = {"version": 1, "prefill_tokens": 0}
    memory.candidate("a", stats, 0)
    memory.routed("a", CHAIN, 300, confirmed=False)
    memory.routed("a", CHAIN, 200, confirmed=False)
    assert memory.candidate("a", stats, 0).queued == 500  # neither is in Ray's count yet
    memory.confirmed("a")
    assert memory.candidate("a", stats, 1).queued == 500  # one sent and counted, one still unconfirmed
    memory.confirmed("a")
    memory.confirmed("a")  # a stray confirmation does not go below zero
    assert memory.candidate("a", stats, 1).queued == 200  # only the latest is in flight
