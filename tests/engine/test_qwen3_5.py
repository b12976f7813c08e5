"""The engine on Qwen3.5 checkpoints: random weights in the hub's vision-language layout (`loadtest.synth_model`,
with vision-tower and MTP tensors the loader skips), one dense and one MoE.

- Cache hits equal cold runs: dense checkpoints exactly (tokens, and logits within 1e-4), wr on prompts its replay
  window covers exactly; nr's deviation is what the allowance calibration measures on the same checkpoint, and
  the record allows exactly the settings within the rule.
- TP=2 equals TP=1 (dense and balanced dasc W16 checkpoints), speculative decoding equals plain decoding, and the
  host tier (dense, dasc, INT8) and the disk tier round-trip checkpoints.
"""

from __future__ import annotations

import json

import pytest
import torch

from app import calibrate
from app.dasc.policy import wr_window
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.speculative import NgramDrafter, SpecState
from app.engine.tp import build_engine
from app.models.loader import load_model
from app.models.qwen3_5 import Qwen3_5ForCausalLM
from app.models.tokenizer import Tokenizer
from loadtest.synth_model import qwen3_5_config, write
from tests.engine.test_disk_tier import assert_restart_resumes
from tests.engine.test_engine import _prompts
from tests.engine.test_host_tier import BASE, assert_round_trip
from tests.engine.test_host_tier import _prompts as tier_prompts
from tests.helpers import record_logits

LOGIT_TOL = 1e-4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# hidden 64, 4 layers (3 GDN, 1 gated attention), 4 heads on 2 KV heads, GDN 2 key x 4 value heads of 16
SHAPE = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, linear_k_heads=2, linear_v_heads=4,
             linear_head_dim=16, intermediate=96)


@pytest.fixture(scope="module", params=["dense", "moe"])
def qwen(request, tmp_path_factory):
    """(checkpoint directory, model, tokenizer) of a random Qwen3.5 checkpoint."""
    torch.set_num_threads(2)
    config = qwen3_5_config(**SHAPE, experts=4 if request.param == "moe" else 0)
    out, _ = write(tmp_path_factory.mktemp(f"qwen3.5-{request.param}"), config, seed=1)
    model = load_model(out)
    assert isinstance(model, Qwen3_5ForCausalLM) and model.config.is_sparse(0) == (request.param == "moe")
    return out, model, Tokenizer.from_dir(out)


def _served(engine: Engine, prompts: list[list[int]]):
    """Each prompt alone, in order (later prompts may hit what earlier ones stored): outputs and logits."""
    seen = record_logits(engine)
    return [engine.generate([p], GREEDY)[0][0] for p in prompts], seen


def test_dense_hits_equal_cold_runs(qwen):
    _, model, tok = qwen
    prompts = _prompts(tok, 12)
    cold, cold_logits = _served(Engine(model, tok, EngineConfig(enable_cache=False)), prompts)
    hot_engine = Engine(model, tok, EngineConfig(interval=32, chunk_size=48, checkpoint_slots=64))
    hot, hot_logits = _served(hot_engine, prompts)
    assert [o.output_ids for o in hot] == [o.output_ids for o in cold]
    assert sum(o.cached_tokens for o in hot) > 0 and hot_engine.cache.counters.loads >= 6
    for (rid, idx, pos), want in cold_logits.items():
        assert (hot_logits[(rid, idx, pos)] - want).abs().max().item() < LOGIT_TOL
    hot_engine.check_integrity()


def test_wr_hits_inside_the_replay_window_are_exact_and_nr_hits_are_not(qwen):
    _, model, tok = qwen
    engine = {p: Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=64, policy=p, recompute_tail=0))
              for p in ("nr", "wr")}
    assert engine["wr"].plan.retained_units < engine["wr"].plan.total_units
    prompt = tok.encode("def add(a, b):\n    return a + b\n")
    assert len(prompt) < wr_window(engine["wr"].plan)
    cold, cold_logits = _served(Engine(model, tok, EngineConfig(enable_cache=False)), [prompt])
    key = (cold[0].request_id, 0, len(prompt))
    gap = {}
    for policy, eng in engine.items():
        outs, seen = _served(eng, [prompt, prompt])
        assert outs[1].cached_tokens == len(prompt) - 1
        gap[policy] = (seen[(outs[1].request_id, 0, len(prompt))] - cold_logits[key]).abs().max().item()
        if policy == "wr":
            assert outs[1].output_ids == cold[0].output_ids
    assert gap["wr"] <= LOGIT_TOL < gap["nr"], gap


def test_the_allowance_is_measured_and_follows_the_rule(qwen, tmp_path, monkeypatch):
    """nr and wr at W16 against dense on held-out prompts: dense hits reproduce the cold NLL and tokens, and the
    record allows a setting exactly when its measured NLL and agreement are within the rule."""
    out_dir, _, _ = qwen
    monkeypatch.setattr(calibrate, "PREFIX_TOKENS", (40, 56, 72))
    out = tmp_path / "allowance.json"
    calibrate.main([str(out_dir), "--prompts", "3", "--w-max", "16", "--out", str(out)])
    record = json.loads(out.read_text())
    settings = record["settings"]
    assert list(settings) == ["dense", "nr-W16", "wr-W16"]
    assert settings["dense"]["nll_ratio"] == 1.0 and settings["dense"]["agreement"] == 1.0
    dense_nll = settings["dense"]["nll"]
    assert record["allowed"] == [label for label, f in settings.items()
                                 if calibrate.judge(f["nll"], dense_nll, f["agreement"])]


@pytest.mark.slow
@pytest.mark.parametrize("placement,w_max", [("off", None), ("balanced", 16)])
def test_tp2_equals_tp1(qwen, placement, w_max):
    out_dir, _, tok = qwen
    cfg = EngineConfig(checkpoint_slots=8, interval=32, w_max=w_max, max_running=8, kv_slots=4096, recompute_tail=1)
    base = tok.encode(open(__file__).read())[:180]
    prompts = [base + tok.encode(f"case_{i} = {i}\n") for i in range(3)] + [base[:90]]
    one_outs, one_logits = _served(build_engine(str(out_dir), cfg, 1), prompts)
    two = build_engine(str(out_dir), cfg, 2, placement)
    try:
        two_outs, two_logits = _served(two, prompts)
    finally:
        two.tp_group.close()
    assert [o.output_ids for o in two_outs] == [o.output_ids for o in one_outs]
    assert [o.cached_tokens for o in two_outs] == [o.cached_tokens for o in one_outs]
    assert sum(o.cached_tokens for o in two_outs) > 0
    assert max((one_logits[k] - two_logits[k]).abs().max().item() for k in one_logits) < 1e-5


class OracleDrafter(NgramDrafter):
    """Drafts plain decoding's next tokens for the sequence, every fifth one wrong: a random model never copies its
    prompt, so prompt lookup would propose nothing; these drafts are accepted up to a wrong one, which is rejected
    and rolled back. If speculation changed a token, the drafts (plain decoding's) would no longer match."""

    def __init__(self, cfg: EngineConfig, plain: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(cfg)
        self.plain, self.vocab = plain, vocab

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        if seq.spec is None:
            seq.spec = SpecState()
        done = seq.num_tokens - len(seq.prompt_ids)
        ahead = self.plain[tuple(seq.prompt_ids)][done : done + limit]
        return tuple((t + 1) % self.vocab if (done + j) % 5 == 4 else t for j, t in enumerate(ahead))


@pytest.mark.parametrize("knobs", [{"interval": 32}, {"w_max": 16, "policy": "wr", "interval": 32}],
                         ids=["dense", "wr-W16"])
def test_speculation_equals_plain_decoding(qwen, knobs):
    _, model, tok = qwen
    prompts = [tok.encode(f"v{i} = [{i}, {i + 1}]\n" * 12)[:120] for i in range(4)]
    batches = [prompts, [p[:100] for p in prompts]]  # the second hits the first's checkpoints
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(spec: str, plain=None) -> tuple[list, Engine]:
        # verify steps priced as decode steps: every step drafts, to the full depth
        engine = Engine(model, tok, EngineConfig(kv_slots=8192, max_running=8, spec=spec, spec_verify_cost=0,
                                                 spec_draft_cost=0, **knobs))
        if plain is not None:
            engine.scheduler.drafter = OracleDrafter(engine.cfg, plain, tok.vocab_size)
        outs = [[o[0].output_ids for o in engine.generate(b, params)] for b in batches]
        engine.check_integrity()
        return outs, engine

    want, _ = run("off")
    plain = {tuple(p): ids for b, outs in zip(batches, want) for p, ids in zip(b, outs)}
    got, engine = run("ngram", plain)
    assert got == want
    snap = engine.snapshot()
    assert snap["spec_accepted_tokens"] > 20 and snap["spec_drafted_tokens"] > snap["spec_accepted_tokens"]
    assert snap["cached_tokens"] > 0


@pytest.mark.parametrize("codec", [dict(), dict(w_max=16.0), dict(w_max=16.0, quant="int8")],
                         ids=["dense", "dasc", "int8"])
def test_the_host_tier_round_trips_bit_exact(qwen, codec):
    _, model, tok = qwen
    assert_round_trip(Engine(model, tok, EngineConfig(checkpoint_slots=4, **BASE, **codec)), tier_prompts(tok, 1)[0])


def test_a_restart_resumes_from_the_disk_tier(qwen, tmp_path, monkeypatch):
    from app.engine.engine import DISK_SECRET_ENV

    _, model, tok = qwen
    monkeypatch.setenv(DISK_SECRET_ENV, "test-deployment-secret")
    assert_restart_resumes((model, tok), tmp_path, tier_prompts(tok, 4), host_mb=0.0)
