"""The digests replicas publish and the tuning controller's algorithm, driven by scripted inputs (the routing
decision itself: test_routing_policy.py)."""

from __future__ import annotations

import torch

from app.cache.digest import block_hashes, matched_blocks, prefix_digest, tail_hash
from app.cache.radix import RadixTree
from deployments.tuner import Setting, Tuner, TunerKnobs, Window
from tests.deployments.test_tuner import ANY


def test_block_hashes_chain_and_digest_of_kv_and_checkpoints():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes(list(range(8)) + [99, 9, 10, 11], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert matched_blocks(b, set(a)) == 2
    tree = RadixTree()
    res = tree.insert(list(range(10)), torch.arange(10))
    tree.set_checkpoint(res.node, 1)
    digest, marks = prefix_digest(tree, 4)
    assert digest == block_hashes(list(range(10)), 4) and marks == [(a[1], 2, tail_hash(a[1], [8, 9]))]
    long = list(range(10)) + [7] * 10
    deeper = tree.insert(long, torch.arange(20))
    tree.set_checkpoint(deeper.node, 2)
    tree.insert([5] * 9, torch.arange(20, 29))  # KV without a checkpoint: in the digest, no mark
    digest, marks = prefix_digest(tree, 4)
    full = block_hashes(long, 4)
    # every full block held as KV, each once (the edges split at 10 and the chain runs on across them)
    assert sorted(digest) == sorted(full + block_hashes([5] * 9, 4))
    # each checkpoint's last full block, the tokens past it, and their tail hash
    assert sorted(marks) == sorted([(full[1], 2, tail_hash(full[1], [8, 9])), (full[4], 0, tail_hash(full[4], []))])
    tree.evict_checkpoint(lambda nodes: next(n for n in nodes if n is deeper.node))
    digest, marks = prefix_digest(tree, 4)  # an evicted checkpoint takes its mark; its KV stays
    assert sorted(digest) == sorted(full + block_hashes([5] * 9, 4)) and [m[0] for m in marks] == [full[1]]
    assert prefix_digest(tree, 4, limit=3)[0] in (full[:3], block_hashes([5] * 9, 4) + full[:1])  # cut at the limit


def _window(replica, version, ttft, evictions=3, requests=10, occupancy=1.0):
    return Window(replica, version, requests, ttft, 0.5, occupancy, evictions, lost=0.5 if evictions else 0.0)


def test_tuner_trials_under_pressure_and_promotes_a_winner():
    t = Tuner(TunerKnobs(allowed=ANY, max_w_nr=64, max_w_wr=512, trial_windows=2, warmup_windows=0, hysteresis=0.05))
    v, s = t.assignment("r0")
    t.assignment("r1")
    assert s == Setting(None) and v == 1
    t.report(_window("r0", 1, 0.20))
    t.report(_window("r1", 1, 0.20))
    assert t.tick() == "trial nr-W16"
    v, trial = t.assignment("r0")
    assert v == 2 and trial == Setting(16, "nr") and t.assignment("r1")[1] == Setting(None)
    for _ in range(2):
        t.report(_window("r0", 2, 0.10))
        t.report(_window("r1", 2, 0.20))
        decision = t.tick()
    assert decision == "promote nr-W16"
    assert t.assignment("r1") == (3, Setting(16, "nr"))
    t.report(_window("r0", 3, 0.10))  # still under pressure: climb to the next rung
    assert t.tick() == "trial nr-W64"


def test_tuner_rejects_a_loser_with_cooldown_and_ignores_stale_windows():
    t = Tuner(TunerKnobs(allowed=ANY, trial_windows=2, warmup_windows=0, cooldown_windows=3))
    t.assignment("r0"), t.assignment("r1")
    t.report(_window("r0", 1, 0.2))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 1, 0.01))  # stale version: ignored
    for _ in range(2):
        t.report(_window("r0", 2, 0.21))
        t.report(_window("r1", 2, 0.20))
        decision = t.tick()
    assert decision == "reject nr-W16" and t.current == Setting(None)
    t.report(_window("r0", 3, 0.2))
    assert t.tick() == "trial nr-W64"  # W16 cools down, the next rung is tried


def test_tuner_respects_operator_caps_and_needs_pressure():
    knobs = TunerKnobs(allowed=ANY, max_w_nr=16, max_w_wr=128)
    assert [s.label for s in knobs.ladder()] == ["dense", "nr-W16", "wr-W64", "wr-W128"]
    t = Tuner(knobs)
    t.assignment("r0")
    t.report(_window("r0", 1, 0.2, evictions=0, occupancy=0.1))
    assert t.tick() is None and t.trial is None


def test_trial_warmup_window_is_not_judged():
    """The window right after the switch refills an emptied cache (slow); only the windows after it count."""
    t = Tuner(TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=1))
    t.assignment("r0")
    t.report(_window("r0", 1, 0.30))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 2, 0.60))  # refilling: worse than dense, ignored
    assert t.tick() is None and t.trial is not None
    t.report(_window("r0", 2, 0.10))
    assert t.tick() == "promote nr-W16"


def test_trial_waits_while_its_hit_rate_is_refilling():
    """After the warm-up window, windows whose hit rate is still below the pre-trial one, or still rising by more
    than refill_rise over the window before, are not judged either, for at most refill_windows; then the trial is
    judged whatever its hit rate."""
    t = Tuner(TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=1, refill_windows=2))
    t.assignment("r0")
    t.report(Window("r0", 1, 10, 0.30, 0.5, 1.0, 3, lost=0.5))
    assert t.tick() == "trial nr-W16"
    t.report(Window("r0", 2, 10, 0.90, 0.0, 0.3, 0))  # warm-up
    assert t.tick() is None
    t.report(Window("r0", 2, 10, 0.50, 0.2, 0.6, 0))  # still refilling: hit rate below 0.5
    assert t.tick() is None
    t.report(Window("r0", 2, 10, 0.10, 0.9, 1.0, 0))  # above 0.5, but still rising (from 0.2)
    assert t.tick() is None
    t.report(Window("r0", 2, 10, 0.10, 0.9, 1.0, 0))  # settled
    assert t.tick() == "promote nr-W16"
    capped = Tuner(TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=1, refill_windows=1))
    capped.assignment("r0")
    capped.report(Window("r0", 1, 10, 0.30, 0.5, 1.0, 3, lost=0.5))
    capped.tick()
    for hit, decision in ((0.1, None), (0.5, None), (0.9, "promote nr-W16")):  # rising every window: cap spent
        capped.report(Window("r0", 2, 10, 0.10, hit, 1.0, 0))
        assert capped.tick() == decision
    slow = Tuner(TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=1, refill_windows=1))
    slow.assignment("r0")
    slow.report(Window("r0", 1, 10, 0.30, 0.5, 1.0, 3, lost=0.5))
    slow.tick()
    for _ in range(2):
        slow.report(Window("r0", 2, 10, 0.60, 0.1, 1.0, 3, lost=0.5))
        assert slow.tick() is None
    slow.report(Window("r0", 2, 10, 0.60, 0.1, 1.0, 3, lost=0.5))  # refill allowance spent: judged, and it loses
    assert slow.tick() == "reject nr-W16"


def test_single_replica_compares_with_its_own_history():
    t = Tuner(TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=0))
    t.assignment("r0")
    t.report(_window("r0", 1, 0.30))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 2, 0.10))
    assert t.tick() == "promote nr-W16"


def test_a_codec_change_takes_every_mark_from_the_digest_and_leaves_the_kv():
    """What a replica publishes right after the controller changes its setting: the old checkpoints are gone (one
    pool never mixes layouts), so no mark promises a resume there; the KV stays, and so does the prefix's digest."""
    from app.engine.config import EngineConfig
    from app.engine.engine import Engine
    from app.engine.request import SamplingParams
    from tests.helpers import load_zoo

    model, tok = load_zoo("kda-tiny")
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8))
    prompt = tok.encode(open(__file__).read())[:200]
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    digest, marks = prefix_digest(eng.cache.tree, 16)
    assert digest[: len(prompt) // 16] == block_hashes(prompt, 16) and marks
    eng.retune(w_max=16.0)
    after, marks = prefix_digest(eng.cache.tree, 16)
    assert marks == [] and set(block_hashes(prompt, 16)) <= set(after)
