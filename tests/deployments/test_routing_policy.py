"""The routing decision by predicted cost (`routing_policy.predict` and `rank`), a pure function driven by
scripted candidates: a hot prefix stays on its holder until the queue there costs more than its checkpoint saves,
an evicted checkpoint no longer attracts, unequal queues and the dasc resume cost (nr tail, wr replay window)
count, and a new prefix sticks to the replica its first request went to."""

from __future__ import annotations

import random
from dataclasses import replace

from app.cache.digest import block_hashes, checkpoint_mark
from deployments.routing_policy import Candidate, RouterKnobs, expected_marks, predict, rank

KNOBS = RouterKnobs(block_size=4, affinity_credit=0.5, work_weight=4.0, token_s=1e-3, fixed_s=0.0, step_tokens=10_000)
PROMPT = list(range(400))
CHAIN = block_hashes(PROMPT, 4)  # 100 blocks


def _marks(*prefixes: list[int]) -> dict:
    """Marks of checkpoints after each of `prefixes`, as a replica publishes them and the router files them."""
    out: dict = {}
    for tokens in prefixes:
        h, r, tail = checkpoint_mark(tokens, 4)
        out[h] = out.get(h, ()) + ((r, tail),)
    return out


def _holder(rid: str, depth_blocks: int, **load) -> Candidate:
    """A replica with a checkpoint `depth_blocks` blocks into PROMPT (its digest: the path to it)."""
    return Candidate(rid, known=frozenset(CHAIN[:depth_blocks]), marks=_marks(PROMPT[: 4 * depth_blocks]), **load)


def test_prediction_counts_queue_uncached_tokens_steps_and_decodes():
    c = _holder("a", 90, queued=100, decoding=3, token_s=1e-3, fixed_s=0.01, step_tokens=53)
    p = predict(c, CHAIN, 400, KNOBS)
    assert p.checkpointed == 360 and p.uncached == 40
    # 140 tokens of work at 50 prefill tokens a step (3 of 53 decode): 3 steps, each with 3 decode tokens
    assert abs(p.ttft_s - (3 * 0.01 + 1e-3 * (140 + 9))) < 1e-12


def test_the_deepest_checkpoint_counts_not_the_kv_match():
    """KV shared beyond the checkpoint saves this request nothing: the prediction resumes at the checkpoint, and
    only the score's affinity credit sees the KV."""
    kv_only = Candidate("a", known=frozenset(CHAIN))
    shallow = Candidate("b", known=frozenset(CHAIN), marks=_marks(PROMPT[:40]))
    assert predict(kv_only, CHAIN, 400, KNOBS).uncached == 400
    assert predict(shallow, CHAIN, 400, KNOBS).uncached == 360
    assert rank([kv_only, shallow], CHAIN, 400, KNOBS)[0] == ["b"]


def test_a_checkpoint_between_block_ends_counts_only_if_the_prompt_reaches_it():
    """A checkpoint 42 tokens deep (block 10 plus 2 tokens): a prompt with those 2 tokens resumes there; one that
    shares the 40 tokens of the full blocks but not the 2 after them cannot, and falls back to a shallower
    checkpoint (or none)."""
    c = Candidate("a", marks=_marks(PROMPT[:42], PROMPT[:20]))
    assert predict(c, CHAIN, PROMPT, KNOBS).checkpointed == 42
    other = PROMPT[:41] + [9999] + PROMPT[42:]
    assert predict(c, block_hashes(other, 4), other, KNOBS).checkpointed == 20
    assert predict(c, CHAIN, 400, KNOBS).checkpointed == 20  # without the ids, only block-aligned marks count


def test_a_hot_prefix_stays_on_its_holder_until_the_queue_there_costs_more_than_it_saves():
    """The checkpoint saves 360 of 400 tokens. Own TTFT alone (work_weight 0): the holder wins while the prefill
    queued there is less than the other replica's queue plus 360 tokens. With work_weight w the prefill a request
    adds counts w more times (it delays that replica's later requests): the holder wins up to (1 + w) x 360."""
    cold = Candidate("b", queued=0)
    ttft_only = replace(KNOBS, work_weight=0.0)
    for queued, winner in ((0, "a"), (300, "a"), (350, "a"), (370, "b")):  # a: queued + 40, b: 400
        assert rank([_holder("a", 90, queued=queued), cold], CHAIN, 400, ttft_only)[0] == [winner], queued
    for queued, winner in ((370, "a"), (1400, "a"), (1800, "a"), (1830, "b")):  # a: queued + 5 x 40, b: 5 x 400
        assert rank([_holder("a", 90, queued=queued), cold], CHAIN, 400, KNOBS)[0] == [winner], queued


def test_an_evicted_checkpoint_no_longer_attracts():
    """After the replica's digest drops the checkpoint (its marks and path), the request goes by load."""
    before = [_holder("a", 90, queued=200), Candidate("b", queued=0)]
    assert rank(before, CHAIN, 400, KNOBS)[0] == ["a"]
    after = [Candidate("a", queued=200), Candidate("b", queued=0)]
    assert rank(after, CHAIN, 400, KNOBS)[0] == ["b"]


def test_unequal_queues_and_step_costs_decide_without_a_match():
    """No checkpoint anywhere: the shorter predicted wait wins, in time, not tokens (a replica measured twice as
    slow per token loses with half the queue)."""
    assert rank([Candidate("a", queued=500), Candidate("b", queued=100)], CHAIN, 400, KNOBS) == [["b"], ["a"]]
    slow = Candidate("a", queued=100, token_s=2e-3)
    fast = Candidate("b", queued=300, token_s=1e-3)
    assert rank([slow, fast], CHAIN, 400, KNOBS)[0] == ["b"]  # 1.0 s against 0.7 s
    decodes = Candidate("a", queued=0, decoding=40, fixed_s=0.02, step_tokens=64)
    assert rank([decodes, Candidate("b", queued=150, fixed_s=0.02)], CHAIN, 400, KNOBS)[0] == ["b"]


def test_the_dasc_resume_cost_counts_against_a_hit():
    """A compressed checkpoint resumes `resume` tokens earlier (the nr tail, the wr replay window): two replicas
    with the same checkpoint differ by it, and a dense holder of a shallower checkpoint can win."""
    dense, wr = _holder("a", 80), _holder("b", 90, resume=128)
    assert predict(wr, CHAIN, 400, KNOBS).uncached == 40 + 128
    assert predict(dense, CHAIN, 400, KNOBS).uncached == 80
    assert rank([dense, wr], CHAIN, 400, KNOBS)[0] == ["a"]
    assert rank([dense, _holder("b", 90, resume=16)], CHAIN, 400, KNOBS)[0] == ["b"]
    assert predict(_holder("c", 10, resume=100), CHAIN, 400, KNOBS).uncached == 400  # no better than none


def test_equal_scores_tie_to_the_less_used_then_the_lower_id():
    cands = [Candidate("c", recent=1), Candidate("a", recent=1), Candidate("b", recent=0)]
    assert rank(cands, CHAIN, 400, KNOBS) == [["b"], ["a", "c"]]
    for order in (cands, cands[::-1], cands[1:] + cands[:1]):
        assert rank(order, CHAIN, 400, KNOBS) == [["b"], ["a", "c"]]
    near = [Candidate("a", queued=3, recent=2), Candidate("b", queued=0, recent=0)]
    assert rank(near, CHAIN, 400, KNOBS)[0] == ["b"]  # 3 tokens apart: within one block, a tie


def test_skewed_traffic_spreads_by_queued_work():
    """90% of requests share one prefix and arrive faster than one replica prefills them: each replica's queue
    grows with the uncached work sent to it and drains at a fixed rate. The hot prefix spills to the second
    replica, which then holds it too, and the replicas' request counts stay within 1.5x."""
    rng = random.Random(0)
    hot = list(range(64))
    queued, marks, known, counts = {"a": 0, "b": 0}, {"a": {}, "b": {}}, {"a": set(), "b": set()}, {}
    for i in range(400):
        prompt = hot + [5000 + i] * 8 if rng.random() < 0.9 else [1000 + i] * 72
        chain = block_hashes(prompt, 4)
        cands = [Candidate(r, known=frozenset(known[r]), marks=marks[r], queued=queued[r]) for r in ("a", "b")]
        chosen = rank(cands, chain, prompt, KNOBS)[0][0]
        queued[chosen] += predict(cands[chosen == "b"], chain, prompt, KNOBS).uncached
        known[chosen].update(chain)
        marks[chosen] = _marks(hot)  # the branch checkpoint where the hot prompts part
        counts[chosen] = counts.get(chosen, 0) + 1
        for r in queued:
            queued[r] = max(0, queued[r] - 8)  # each replica prefills 8 tokens per arrival: fewer than come
    assert max(counts.values()) <= 1.5 * min(counts.values()), counts
    assert marks["a"] == marks["b"] == _marks(hot)  # both hold the hot prefix now


def test_the_checkpoints_a_request_will_have_a_replica_store_are_its_branch_and_prompt_end():
    """The branch where it leaves the KV shared beyond the checkpoint (whole blocks) and its prompt end, both `tail`
    tokens early under an nr tail; a replica that admits only prompts seen before expects no prompt end."""
    c = Candidate("a", known=frozenset(CHAIN[:60]), marks=_marks(PROMPT[:40]))
    p = predict(c, CHAIN, PROMPT, KNOBS)
    assert (p.checkpointed, p.kv) == (40, 240)
    want = [checkpoint_mark(PROMPT[:240], 4), checkpoint_mark(PROMPT[:399], 4)]
    assert expected_marks(c, CHAIN, PROMPT, p, 4) == want
    tailed = replace(c, tail=10)
    assert expected_marks(tailed, CHAIN, PROMPT, predict(tailed, CHAIN, PROMPT, KNOBS), 4) == [
        checkpoint_mark(PROMPT[:228], 4), checkpoint_mark(PROMPT[:389], 4)]  # (240 - 10) // 4 whole blocks
    deep = replace(c, marks=_marks(PROMPT[:240]), prompt_ends=False)
    assert expected_marks(deep, CHAIN, PROMPT, predict(deep, CHAIN, PROMPT, KNOBS), 4) == []  # KV ends at the mark
    cold = Candidate("b")
    assert expected_marks(cold, CHAIN, PROMPT, predict(cold, CHAIN, PROMPT, KNOBS), 4) == [
        checkpoint_mark(PROMPT[:399], 4)]
    assert expected_marks(cold, CHAIN, 400, predict(cold, CHAIN, 400, KNOBS), 4) == []  # no ids: no tail hash


def test_a_replica_with_lookback_is_expected_to_store_a_checkpoint_that_far_before_the_prompt_end():
    """With `lookback` the engine also checkpoints each prompt lookback tokens (aligned down) before its prompt-end
    checkpoint; the router expects it, so the next query on a new header (the same 380 tokens, a new end) is
    predicted to resume there on the replica the first one went to, and goes there."""
    cold = Candidate("a", lookback=16, lookback_align=8)
    first = expected_marks(cold, CHAIN, PROMPT, predict(cold, CHAIN, PROMPT, KNOBS), 4)
    assert first == [checkpoint_mark(PROMPT[:399], 4), checkpoint_mark(PROMPT[:376], 4)]  # (399 - 16) // 8 * 8
    marks = {}
    for h, r, tail in first:
        marks[h] = marks.get(h, ()) + ((r, tail),)
    query = PROMPT[:380] + [9000 + i for i in range(20)]  # shares the header, not the old query
    chain = block_hashes(query, 4)
    holder = replace(cold, known=frozenset(CHAIN), marks=marks)
    assert predict(holder, chain, query, KNOBS).checkpointed == 376
    assert predict(Candidate("b"), chain, query, KNOBS).checkpointed == 0
    assert rank([holder, Candidate("b")], chain, query, KNOBS)[0] == ["a"]


def test_a_replica_yet_to_measure_its_step_cost_is_priced_like_its_peers():
    """A just-started replica's cost is its measured peers' median, not the knobs' guess (1 ms a token here, 5x
    what the peers measure): with equal queues and no match, it is not shunned."""
    busier = [Candidate(r, queued=1000, token_s=2e-4, fixed_s=0.0, recent=3) for r in ("a", "b")]
    fresh = Candidate("c", queued=1000)
    assert rank(busier + [fresh], CHAIN, 400, KNOBS)[0] == ["c"]  # a tie, and c had fewer recent decisions
    assert rank(busier + [replace(fresh, queued=1200)], CHAIN, 400, KNOBS)[0] == ["a"]  # 200 tokens more queued
    assert rank([replace(fresh, queued=900)] + busier, CHAIN, 400, KNOBS)[0] == ["c"]
