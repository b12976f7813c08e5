"""The cache fields of a replica's telemetry window (`replica.cache_window`), from two snapshots of a real engine:
the tuner's interval trigger reads `replayed`, which must not count the nr recompute tail a hit replays by design."""

from __future__ import annotations

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from deployments.replica import cache_window
from tests.engine.test_lookback import HEADER, QUERY, _workload
from tests.helpers import load_zoo

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def test_replayed_counts_only_what_a_hit_recomputes_beyond_the_nr_tail():
    model, tok = load_zoo("kda-tiny")
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=16, policy="nr"))
    tail = eng.cfg.tail
    prompt = tok.encode(open(__file__).read())[:300]
    eng.generate([prompt], ONE)
    before = eng.snapshot()
    eng.generate([prompt], ONE)  # a repeat: loads the prompt-end checkpoint `tail` tokens early, replays the tail
    after = eng.snapshot()
    assert tail > 0 and after["replayed_tokens"] - before["replayed_tokens"] >= tail
    window = cache_window(after, before, tail)
    assert window["replayed"] == 0.0 and window["hit_rate"] > 0.5 and window["compression"] > 1.0
    assert cache_window(after, before, 0)["replayed"] >= tail  # what the window said before the tail came off
    longer = prompt + tok.encode(" and then some more text that runs past the stored prompt end")
    eng.generate([longer], ONE)  # past the prompt end: the KV match ends a token after it (the first answer's)
    assert cache_window(eng.snapshot(), after, tail)["replayed"] == 1.0


def test_lost_counts_requests_resuming_behind_an_eviction_and_replayed_leaves_their_tokens_out():
    """Two checkpoint slots: new prompts evict each other's checkpoints (evictions, but nobody lost anything: no
    request asked for an evicted one); a repeat of the first prompt then resumes from scratch although its KV is
    cached and its checkpoint once was: lost 1.0, and those tokens are not the replay an interval would shorten."""
    model, tok = load_zoo("kda-tiny")
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=2))
    text = tok.encode(open(__file__).read())
    first, others = text[:200], [[7] + text[200:400], [9] + text[400:600]]
    eng.generate([first], ONE)
    start = eng.snapshot()
    for prompt in others:
        eng.generate([prompt], ONE)
    fresh = eng.snapshot()
    window = cache_window(fresh, start, 0)
    assert window["evictions"] > 0 and window["lost"] == 0.0
    eng.generate([first], ONE)
    after = eng.snapshot()
    window = cache_window(after, fresh, 0)
    assert window["lost"] == 1.0 and window["hit_rate"] == 0.0
    assert after["replayed_tokens"] - fresh["replayed_tokens"] >= 150 and window["replayed"] < 8


def test_branching_requests_and_lookback_reuse_show_in_the_window():
    """A new header's first query leaves the warm-up's path 29 tokens before its stored prompt end: without
    lookback every such query branched (bucket 32, which lookback 64 covers); with it they load the warm-ups'
    lookback checkpoints (reused, per window); once repeats of the warm-ups load the prompt ends below them,
    those lookback checkpoints are dispensable (eviction takes them first). A later query that resumes at the
    branch checkpoint an earlier one cut replays nothing and does not count as branched."""
    model, tok = load_zoo("kda-tiny")
    work = _workload(tok)[:2]
    for lookback in (0, 64):
        eng = Engine(model, tok, EngineConfig(lookback=lookback, checkpoint_slots=32))
        for warm, _ in work:
            eng.generate([warm], ONE)
        start = eng.snapshot()
        for _, query in work:
            eng.generate([query], ONE)
        queried = eng.snapshot()
        window = cache_window(queried, start, 0)
        assert window["branched"] == 1.0 and window["branch_back"] == 32.0
        assert window["lookback_reused"] == (2 if lookback else 0) and window["dispensable"] == 0.0
    assert cache_window(start, start, 0)["lookback_stored"] == 0
    third = work[0][0][:HEADER] + work[1][1][-QUERY:]  # header 0's next query resumes at the branch q1 cut
    eng.generate([third], ONE)
    assert cache_window(eng.snapshot(), queried, 0)["branched"] == 0.0
    queried = eng.snapshot()
    for warm, _ in work:
        eng.generate([warm], ONE)
    window = cache_window(eng.snapshot(), queried, 0)
    assert window["dispensable"] == 2 / 32 and window["branched"] == 0.0 and window["hit_rate"] > 0.9


def test_a_prompt_sharing_only_a_short_prefix_with_a_stored_one_does_not_count_as_branched():
    """Unrelated prompts under one 24-token system prompt: the second one replays the system prompt, but the stored
    prompt end lies 400 tokens below where they part; a lookback reaching that far would sit in the system prompt's
    neighbourhood and serve nobody, so the window does not ask for one."""
    model, tok = load_zoo("kda-tiny")
    ids = tok.encode(open(__file__).read() * 4)
    system = ids[:24]
    eng = Engine(model, tok, EngineConfig(lookback=0))
    eng.generate([system + ids[100:500]], ONE)
    before = eng.snapshot()
    eng.generate([system + ids[600:1000]], ONE)
    after = eng.snapshot()
    assert after["replayed_tokens"] - before["replayed_tokens"] >= 16
    assert cache_window(after, before, 0)["branched"] == 0.0


def test_replays_after_a_layout_change_are_not_counted_as_replayed():
    """A codec change discards every checkpoint: the next repeat of a prompt replays it from scratch although its KV
    is cached. That is the retune's one-off cost, not a placement interval checkpoints would improve: bench_controller's
    overflow situation tried an interval after every rejected W_max trial (the replica went back to its old layout and
    its next window replayed ~500 tokens a request). Nor is it cache pressure (`lost`)."""
    model, tok = load_zoo("kda-tiny")
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8))
    prompt = tok.encode(open(__file__).read())[:300]
    eng.generate([prompt], ONE)
    eng.retune(w_max=16, policy="nr")
    before = eng.snapshot()
    eng.generate([prompt], ONE)
    after = eng.snapshot()
    assert after["replayed_tokens"] - before["replayed_tokens"] >= 250
    window = cache_window(after, before, eng.cfg.tail)
    assert window["replayed"] == 0.0 and window["lost"] == 0.0
    eng.generate([prompt], ONE)  # stored again under the new layout: a plain hit
    assert cache_window(eng.snapshot(), after, eng.cfg.tail)["hit_rate"] > 0.5


def test_a_replica_reports_its_flat_fields_and_the_disk_tier_block(tmp_path, monkeypatch):
    """/status and /metrics behind Serve see what `reported` keeps of a snapshot: the disk tier's counters went
    missing before (only flat fields and the acceptance histogram were kept)."""
    from app.engine.engine import DISK_SECRET_ENV
    from deployments.replica import reported

    monkeypatch.setenv(DISK_SECRET_ENV, "s")
    model, tok = load_zoo("kda-tiny")
    snap = Engine(model, tok, EngineConfig(checkpoint_slots=2, disk_dir=str(tmp_path))).snapshot()
    out = reported(snap)
    assert out["disk_tier"] == snap["disk_tier"] and "writes" in out["disk_tier"]
    assert out["spec_accepted_per_verify"] == snap["spec_accepted_per_verify"]
    assert {k for k, v in snap.items() if not isinstance(v, dict)} <= out.keys()
    assert not {k for k, v in out.items() if isinstance(v, dict)} - {"disk_tier", "spec_accepted_per_verify"}
