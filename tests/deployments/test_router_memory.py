"""The router's memory (`RouterMemory`, driven by a scripted clock) and the tie-breaks of `rank`: what the
router knows of each replica between digests, when it forgets, and which replica wins among equals."""

from __future__ import annotations

from app.cache.digest import block_hashes
from deployments.routing_policy import Candidate, RouterKnobs, RouterMemory, rank

KNOBS = RouterKnobs(block_size=4, min_match_tokens=8, max_queue_gap=2, max_ratio=1.4, share_window=20)
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
    first = memory.candidate("a", {"version": 1, "digest": CHAIN[:3], "queue": 2}, None)
    assert first.known == frozenset(CHAIN[:3]) and first.queue_len == 2
    same = memory.candidate("a", {"version": 1, "digest": CHAIN, "queue": 5}, None)
    assert same.known == frozenset(CHAIN[:3]) and same.queue_len == 5  # the queue is always read
    assert memory.candidate("a", {"version": 2, "digest": CHAIN[5:], "queue": 0}, None).known == frozenset(CHAIN[5:])
    memory.routed("a", CHAIN[:2])
    assert memory.candidate("a", {"version": 2, "digest": CHAIN[5:]}, None).known == frozenset(CHAIN[:2] + CHAIN[5:])


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
    """No digest shows the prefix: only the memory keeps its repeats on the replica the first one went to
    (max_ratio high enough that the share limit does not interfere)."""
    knobs = RouterKnobs(block_size=4, min_match_tokens=8, max_ratio=10.0)
    clock = _Clock()
    memory = RouterMemory(remember_s=10.0, share_window=knobs.share_window, clock=clock)
    stats = {"version": 1, "digest": [], "queue": 0}

    def route() -> str:
        chosen = rank([memory.candidate(r, stats, None) for r in ("a", "b")], CHAIN, knobs)[0][0]
        memory.routed(chosen, CHAIN)
        return chosen

    assert route() == "a"  # no match anywhere: least loaded, then lowest id
    clock.now += 5.0
    assert route() == "a"  # b is less used, but a is known to hold the prefix
    clock.now += 10.0  # the second routing was 10 s ago: still remembered
    assert route() == "a"
    clock.now += 10.5
    assert route() == "b"  # forgotten: back to load, where b has the fewer recent decisions


def test_rank_ties_on_saved_tokens_go_to_the_shorter_queue_then_the_less_used():
    full = frozenset(CHAIN)
    by_queue = [Candidate("a", 1, full, 0), Candidate("b", 0, full, 0)]
    assert rank(by_queue, CHAIN, KNOBS) == [["b"], ["a"]]
    by_recent = [Candidate("a", 0, full, 1), Candidate("b", 0, full, 0)]
    assert rank(by_recent, CHAIN, KNOBS) == [["b"], ["a"]]
    more_saved = [Candidate("a", 1, full, 1), Candidate("b", 0, frozenset(CHAIN[:5]), 0)]
    assert rank(more_saved, CHAIN, KNOBS)[0] == ["a"]  # tokens saved come before the tie-breaks


def test_rank_without_a_match_orders_by_queue_then_recent_then_id():
    cands = [Candidate("c", 1, frozenset(), 0), Candidate("a", 0, frozenset(), 1), Candidate("b", 0, frozenset(), 0),
             Candidate("d", 0, frozenset(), 1)]
    assert rank(cands, CHAIN, KNOBS) == [["b"], ["a", "d", "c"]]


def test_rank_among_full_ties_does_not_depend_on_candidate_order():
    for known in (frozenset(CHAIN), frozenset()):
        cands = [Candidate(r, 0, known, 0) for r in ("a", "b", "c")]
        assert rank(cands, CHAIN, KNOBS) == rank(cands[::-1], CHAIN, KNOBS) == rank(cands[1:] + cands[:1], CHAIN, KNOBS)
