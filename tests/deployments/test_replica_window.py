"""The cache fields of a replica's telemetry window (`replica.cache_window`), from two snapshots of a real engine:
the tuner's interval trigger reads `replayed`, which must not count the nr recompute tail a hit replays by design."""

from __future__ import annotations

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from deployments.replica import cache_window
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
