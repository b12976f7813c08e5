"""The recompute tail (`EngineConfig.recompute_tail`): after loading a lossy checkpoint the engine recomputes the
last prompt tokens with the full model, which rebuilds the short-horizon units nr left zeroed; dense checkpoints
need none and are loaded where they were before.

The fidelity case is fixed and deterministic: kda-tiny (the zoo model whose nr hits drift the most) at W_max 16,
a few prompts cut from this repository's code, greedy tokens compared with a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo, record_logits

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SOURCE = Path(__file__).resolve().parents[2] / "app" / "engine" / "scheduler.py"


@pytest.fixture(scope="module")
def kda():
    return load_zoo("kda-tiny")


def _prompts(tok, n: int, length: int) -> list[list[int]]:
    ids = tok.encode(SOURCE.read_text())
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def test_a_lossy_hit_recomputes_the_tail(kda):
    """recompute_tail 1.5 at W_max 16: the repeat loads the prompt-end checkpoint 24 tokens before
    `prompt_len - 1` and recomputes the tail (whose KV the tree already holds from the first run's generation-end
    insert: `replayed`)."""
    model, tok = kda
    prompt = _prompts(tok, 1, 120)[0]
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=16, recompute_tail=1.5))
    assert engine.cfg.tail == 24
    first, again = (engine.generate([prompt], GREEDY)[0][0] for _ in range(2))
    assert first.cached_tokens == 0 and again.cached_tokens == len(prompt) - 1 - 24 and again.compressed_hit
    snap = engine.snapshot()
    assert snap["checkpoint_stores_by_kind"]["prompt_end"] >= 1 and snap["replayed_tokens"] == 24
    assert engine.telemetry.recent[-1].replayed == 24
    engine.check_integrity()


def test_branch_checkpoints_sit_a_tail_before_the_branch(kda):
    """A shared header, then suffixes. The first two requests' long suffixes put their prompt-end checkpoints
    past the header, so the second finds no checkpoint on its path and misses; it stores its branch checkpoint
    `tail` tokens before the branch (the header's end). The third, with a short suffix, loads it and still
    recomputes a whole tail; a checkpoint at the branch itself would be too close to its end to use."""
    model, tok = kda
    header, one, two, short = _prompts(tok, 4, 100)
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=16, recompute_tail=2, checkpoint_min_gap=0))
    tail = engine.cfg.tail
    outs = [engine.generate([header + s], GREEDY)[0][0] for s in (one, two, short[:8])]
    assert outs[1].cached_tokens == 0
    assert outs[2].compressed_hit and outs[2].cached_tokens == len(header) - tail
    assert engine.snapshot()["checkpoint_stores_by_kind"]["branch"] >= 1
    engine.check_integrity()


def test_dense_checkpoints_are_loaded_where_they_were(kda):
    """An exact checkpoint needs no tail: the knob is ignored, the repeat recomputes one token and answers as a cold
    run."""
    model, tok = kda
    prompt = _prompts(tok, 1, 120)[0]
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=8, recompute_tail=1.5))
    assert engine.cfg.tail == 0
    first, again = (engine.generate([prompt], GREEDY)[0][0] for _ in range(2))
    assert again.cached_tokens == len(prompt) - 1 and not again.compressed_hit
    assert again.output_ids == first.output_ids and engine.snapshot()["replayed_tokens"] == 0


def test_a_tail_of_four_w_max_is_no_less_faithful_than_none(kda):
    """nr at W16: hits with a tail of 4 W_max (64 tokens) agree with the cold greedy tokens at least as long as hits
    with none (one token recomputed, the default), and their first-token logits are closer to the cold ones (on
    this case: 81 vs 41 of 96 tokens agree; logits within 0.06 vs 2.7)."""
    model, tok = kda
    prompts = _prompts(tok, 6, 96)
    cold_engine = Engine(model, tok, EngineConfig(enable_cache=False))
    cold_logits = record_logits(cold_engine)
    cold = [o[0] for o in cold_engine.generate(prompts, GREEDY)]
    agree, gap = {}, {}
    for tail in (0.0, 4.0):
        engine = Engine(model, tok, EngineConfig(checkpoint_slots=16, w_max=16, recompute_tail=tail))
        tail = engine.cfg.tail
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        logits = record_logits(engine)
        hits = [o[0] for o in engine.generate(prompts, GREEDY)]
        assert all(h.cached_tokens == len(p) - 1 - tail for h, p in zip(hits, prompts))
        agree[tail] = sum(_agreeing(h.output_ids, c.output_ids) for h, c in zip(hits, cold))
        gap[tail] = max((logits[(h.request_id, 0, len(p))] - cold_logits[(c.request_id, 0, len(p))]).abs().max().item()
                        for h, c, p in zip(hits, cold, prompts))
    tail = 64
    assert agree[tail] >= agree[0] and agree[0] < len(prompts) * GREEDY.max_tokens  # the old placement drifts
    assert gap[tail] < gap[0]


def _agreeing(a: list[int], b: list[int]) -> int:
    """Tokens before the first disagreement."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
