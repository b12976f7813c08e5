"""Engine.retune seen from outside: a change of what a checkpoint holds (W_max, quantization, layout,
selector, pool size) drops every stored checkpoint, so the next request of a cached prompt misses and still
gets the cold output; any other change (policy, interval, admission, or the same W_max again) keeps them, and
a policy change takes effect on the next hit. The engines load with wr where they can: the prompt is shorter
than the wr window, so a hit gives the cold output too."""

from __future__ import annotations

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("gdn-tiny")


def _serve(engine: Engine, prompt: list[int]):
    return engine.generate([prompt], GREEDY)[0][0]


@pytest.mark.parametrize("start, change", [
    (dict(), dict(w_max=64)),
    (dict(w_max=64), dict(w_max=None)),
    (dict(w_max=64), dict(w_max=16)),
    (dict(w_max=64), dict(quant="int8")),
    (dict(w_max=64), dict(layout="padded")),
    (dict(w_max=64), dict(selector="random:0")),
    (dict(w_max=64), dict(checkpoint_slots=6)),
    (dict(checkpoint_slots=None, checkpoint_budget_mb=1.0), dict(checkpoint_budget_mb=2.0)),
])
def test_a_codec_change_drops_every_checkpoint(zoo, start, change):
    model, tok = zoo
    prompt = tok.encode(PROMPT)
    engine = Engine(model, tok, EngineConfig(**{"checkpoint_slots": 8, "policy": "wr", **start}))
    cold = _serve(engine, prompt)
    assert cold.cached_tokens == 0 and engine.snapshot()["checkpoint_slots_used"] > 0
    engine.retune(**change)
    assert engine.snapshot()["checkpoint_slots_used"] == 0
    again = _serve(engine, prompt)
    assert again.cached_tokens == 0 and again.output_ids == cold.output_ids
    hit = _serve(engine, prompt)  # the new pool stores and serves checkpoints of the new kind
    assert hit.cached_tokens == len(prompt) - 1 and hit.output_ids == cold.output_ids
    engine.check_integrity()


@pytest.mark.parametrize("change", [dict(w_max=64), dict(interval=8), dict(admission="second_hit")])
def test_other_changes_keep_the_checkpoints(zoo, change):
    model, tok = zoo
    prompt = tok.encode(PROMPT)
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=64, policy="wr"))
    cold = _serve(engine, prompt)
    used = engine.snapshot()["checkpoint_slots_used"]
    engine.retune(**change)
    assert used > 0 and engine.snapshot()["checkpoint_slots_used"] == used
    hit = _serve(engine, prompt)
    assert hit.cached_tokens == len(prompt) - 1 and hit.output_ids == cold.output_ids
    engine.check_integrity()


def test_a_policy_change_keeps_the_checkpoints_and_takes_effect(zoo):
    """nr -> wr: the checkpoint stored under nr is hit and refreshed by a replay, giving the dense output
    (gdn-tiny's nr hit on this prompt gives other tokens); wr -> nr: the next hit replays nothing."""
    model, tok = zoo
    prompt = tok.encode(PROMPT)
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=64, policy="nr", recompute_tail=0))
    cold = _serve(engine, prompt)
    nr_hit = _serve(engine, prompt)
    assert nr_hit.cached_tokens == len(prompt) - 1 and nr_hit.output_ids != cold.output_ids
    used = engine.snapshot()["checkpoint_slots_used"]
    engine.retune(policy="wr")
    wr_hit = _serve(engine, prompt)
    assert engine.snapshot()["checkpoint_slots_used"] == used
    assert wr_hit.cached_tokens == len(prompt) - 1 and wr_hit.output_ids == cold.output_ids
    assert engine.telemetry.wr_replay_tokens == len(prompt) - 1
    engine.retune(policy="nr")
    assert _serve(engine, prompt).output_ids == nr_hit.output_ids
    assert engine.telemetry.wr_replay_tokens == len(prompt) - 1
