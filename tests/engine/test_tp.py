"""Tensor parallelism on CPU (gloo, 2 ranks as processes): TP=2 equals TP=1 for both families under every
placement, cache hits through dasc checkpoints and n > 1 samples agree, per-rank checkpoint bytes equal the
placement plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.layout import slot_bytes
from app.dasc.placement import plan_placement
from app.dasc.selection import make_plan
from app.engine.config import EngineConfig
from app.engine.request import SamplingParams
from app.engine.tp import build_engine
from app.models.loader import load_model
from app.models.shard import check_divisible
from deployments.builder import ServeArgs, _replica_resources
from tests.helpers import record_logits

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CASES = [("kda-tiny", "off", None), ("kda-tiny", "storage", 16), ("kda-tiny", "balanced", 16),
         ("gdn-tiny", "off", None), ("gdn-tiny", "storage", 128), ("gdn-tiny", "balanced", 128)]


def _prompts(tok):
    base = tok.encode(open(__file__).read())[:180]
    return [base + tok.encode(f"case_{i} = {i}\n") for i in range(3)] + [base[:90]]


@pytest.mark.parametrize("model,placement,w_max", CASES, ids=[f"{m}-{p}-W{w}" for m, p, w in CASES])
def test_tp2_equals_tp1(model, placement, w_max):
    # a one-W_max tail, so that these 180-token prompts still hit at W128
    cfg = EngineConfig(checkpoint_slots=8, interval=32, w_max=w_max, max_running=8, kv_slots=4096, recompute_tail=1)
    one = build_engine(model, cfg, 1)
    prompts = _prompts(one.tokenizer)
    logits1 = record_logits(one)
    outs1 = [one.generate([p], GREEDY)[0][0] for p in prompts]  # one at a time: later prompts hit
    two = build_engine(model, cfg, 2, placement)
    try:
        logits2 = record_logits(two)
        outs2 = [two.generate([p], GREEDY)[0][0] for p in prompts]
        assert [o.output_ids for o in outs2] == [o.output_ids for o in outs1]
        assert [o.cached_tokens for o in outs2] == [o.cached_tokens for o in outs1]
        assert sum(o.cached_tokens for o in outs2) > 0  # hits went through the (compressed) checkpoints
        assert logits1.keys() == logits2.keys()
        assert max((logits1[k] - logits2[k]).abs().max().item() for k in logits1) < 1e-5
        fork = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)  # copy_state on every rank
        forked = prompts[1] + one.tokenizer.encode("forked = True\n")
        samples = [s.output_ids for s in two.generate([forked], fork)[0]]
        assert samples == [s.output_ids for s in one.generate([forked], fork)[0]] and samples[0] == samples[1]
        if w_max is not None:  # rank 0's bytes per slot equal the placement plan's bottleneck figure
            full = load_model(model)
            plan = make_plan(model_geometry(full), model_horizons(full), w_max)
            conv = sum(c.numel() * c.element_size() for c in full.empty_states(1).conv)
            want = slot_bytes(plan, "ragged", "none", conv, 2, placement).total
            assert two.codec.bytes_per_slot == want
            p = plan_placement(plan, 2, placement)
            if placement != "off":
                assert p.width <= math.ceil(sum(p.local_units) / 2) + 1
    finally:
        two.tp_group.close()


def test_indivisible_heads_fail_clearly():
    model = load_model("kda-tiny")
    with pytest.raises(ValueError, match=r"4 KDA heads do not divide over tp_size 3"):
        check_divisible(model, 3)
    with pytest.raises(ValueError, match="tp_size 3"):
        build_engine("gdn-tiny", EngineConfig(), 3)


def test_tp2_config_fits_two_cpus():
    """configs/tp2.yaml: 2 replicas x TP=2 on CPU; every rank's bundle together fits a 2-core machine."""
    args = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/tp2.yaml").read_text())
    cfg = ServeArgs(**args["applications"][0]["args"])
    assert (cfg.replicas, cfg.tp_size, cfg.engine.device, cfg.placement, cfg.threads) == (2, 2, "cpu", "off", 1)
    bundles = _replica_resources(cfg)["placement_group_bundles"]
    assert len(bundles) == 2 and cfg.replicas * sum(b["CPU"] for b in bundles) <= 2


def test_tp2_speculative_decoding_equals_tp1_plain():
    """Speculative decoding on two ranks (every rank verifies and rolls its state shards back, and stores
    checkpoints at accepted positions): greedy output equals plain decoding on one rank, drafts were accepted,
    and a repeated prompt hits a checkpoint stored while speculating."""
    cfg = EngineConfig(checkpoint_slots=64, interval=16, max_running=8, kv_slots=4096)
    one = build_engine("kda-tiny", cfg, 1)
    tok = one.tokenizer
    snippet = tok.encode(open(__file__).read())[:120]
    prompts = [snippet + snippet[:8], snippet[40:] + snippet[40:60]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [one.generate([p], params)[0][0].output_ids for p in prompts]
    two = build_engine("kda-tiny", EngineConfig(**{**cfg.__dict__, "spec": "ngram"}), 2)
    try:
        outs = [two.generate([p], params)[0][0] for p in prompts]
        assert [o.output_ids for o in outs] == plain
        assert two.snapshot()["spec_accepted_tokens"] > 0
        again = two.generate([prompts[0] + plain[0]], params)[0][0]
        assert again.cached_tokens >= len(prompts[0]) - 1
        assert again.output_ids == one.generate([prompts[0] + plain[0]], params)[0][0].output_ids
    finally:
        two.tp_group.close()


def test_tp2_host_tier_round_trip_answers_as_tp1():
    """The host tier under TP=2 (each rank demotes and promotes its own shard's bytes through the broadcast verbs):
    a prompt the one-slot pool let go of resumes from the tier, placed dasc included, and answers as TP=1 does."""
    cfg = EngineConfig(checkpoint_slots=1, w_max=16, max_running=4, kv_slots=4096, host_mb=32.0)
    one = build_engine("kda-tiny", cfg, 1)
    first, second, *_ = _prompts(one.tokenizer)

    def replay(engine):
        outs = [engine.generate([p], GREEDY)[0][0] for p in (first, second, first)]
        engine.check_integrity()
        return [(o.output_ids, o.cached_tokens) for o in outs], engine.snapshot()["host_tier_promotions"]

    two = build_engine("kda-tiny", cfg, 2, "balanced")
    try:
        answers, promotions = replay(two)
        assert (answers, promotions) == replay(one) and answers[2][1] == len(first) - 1 - cfg.tail and promotions
    finally:
        two.tp_group.close()
