"""What an engine tells the router about its load (`app/engine/load.py`): the prefill waiting, counted after the
checkpoint each waiting request would resume from (plus what a compressed hit recomputes), the sequences
decoding, and a step cost fitted to the steps it ran."""

from __future__ import annotations

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.load import StepCost, load_report
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_step_cost_fits_fixed_and_per_token_parts():
    cost = StepCost(min_tokens=1)
    assert cost.fit() is None
    for tokens in (1, 64, 4, 256, 16) * 8:
        cost.add(tokens, 0.004 + 2e-5 * tokens)
    fixed, per_token = cost.fit()
    assert abs(fixed - 0.004) < 1e-9 and abs(per_token - 2e-5) < 1e-12
    flat = StepCost(min_tokens=1)
    for _ in range(5):
        flat.add(8, 0.016)  # one size only: no slope to fit, the time is taken as per-token cost
    fixed, per_token = flat.fit()
    assert fixed == 0.0 and abs(per_token - 0.002) < 1e-12


def test_decode_steps_stay_out_of_the_prefill_cost():
    """Steps below min_tokens (decodes, 1 ms a token here) do not move the fit of prefill steps (20 us a token)."""
    cost = StepCost()
    for _ in range(50):
        cost.add(8, 0.008)
    assert cost.fit() is None
    for tokens in (64, 256, 512) * 4:
        cost.add(tokens, 0.004 + 2e-5 * tokens)
        cost.add(4, 0.004)
    fixed, per_token = cost.fit()
    assert abs(fixed - 0.004) < 1e-9 and abs(per_token - 2e-5) < 1e-12


def test_a_replicas_first_prefill_steps_do_not_make_its_cost():
    """A cold first prefill step (100 tokens in 90 ms, 6x the warm cost) is left out, and there is no fit before
    4 warm steps: a replica that has prefilled once is priced at its peers' cost by the router, not at 0.9 ms a
    token (the serve test of a hot prefix sent 16 requests to the peer on such a fit)."""
    cost = StepCost()
    cost.add(100, 0.090)
    for tokens in (128, 256, 64):
        cost.add(tokens, 0.004 + 1.5e-4 * tokens)
        assert cost.fit() is None
    cost.add(512, 0.004 + 1.5e-4 * 512)
    fixed, per_token = cost.fit()
    assert abs(fixed - 0.004) < 1e-9 and abs(per_token - 1.5e-4) < 1e-12


def test_waiting_prefill_counts_from_the_checkpoint_each_request_would_resume_at():
    model, tok = load_zoo("kda-tiny")
    prompt = tok.encode("def add(a, b):\n    return a + b\n" * 12)
    for knobs in ({}, {"w_max": 16}, {"w_max": 16, "policy": "wr"}):
        engine = Engine(model, tok, EngineConfig(kv_slots=4096, **knobs))
        engine.generate([prompt], GREEDY)
        longer, fresh = prompt + tok.encode("x = 1\n"), tok.encode("class Stack:\n    pass\n")
        engine.add_request(longer, GREEDY)
        engine.add_request(fresh, GREEDY)
        report = load_report(engine)
        # nr loads its checkpoint `tail` tokens back (it was stored there); wr replays its window after the load
        ckpt = engine.cache.match(longer, len(longer) - 1 - engine.cfg.tail).checkpoint_len
        resume = report["resume_tokens"]
        assert ckpt > 0 and (resume > 0) == (knobs.get("policy") == "wr")
        assert report["prefill_tokens"] == (len(longer) - ckpt + resume) + len(fresh), knobs
        assert report["decoding"] == 0
        assert report["step_token_s"] is None  # one prefill step, the warm-up: no cost to publish yet
        engine.step()  # both prefill in one step and emit their first token: decoding, nothing left to prefill
        assert (load_report(engine)["decoding"], load_report(engine)["prefill_tokens"]) == (2, 0)
    for i in range(4):  # four more prefill steps: fitted
        engine.generate([tok.encode(f"v{i} = " + "1 + " * 40)], SamplingParams(max_tokens=1))
    report = load_report(engine)
    assert report["step_token_s"] > 0 and report["step_fixed_s"] >= 0
