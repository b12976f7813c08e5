"""`SamplingParams.cache_lossless`: a request that asks for it never resumes from a lossy checkpoint (a dasc
W_max or INT8 storage), and every output says whether a lossy one served it (`compressed_hit`)."""

from __future__ import annotations

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo


# recompute_tail 0: the prompt-end checkpoint sits at the end, so this short prompt resumes from a lossy one
@pytest.mark.parametrize("lossy", [dict(w_max=16, policy="nr", recompute_tail=0), dict(quant="int8")])
def test_a_lossless_request_skips_lossy_checkpoints(lossy):
    model, tok = load_zoo("kda-tiny")
    prompt = tok.encode("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cold = Engine(model, tok, EngineConfig(enable_cache=False)).generate([prompt], params)[0][0]
    engine = Engine(model, tok, EngineConfig(**lossy))
    first = engine.generate([prompt], params)[0][0]
    assert not first.compressed_hit and first.output_ids == cold.output_ids
    hit = engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": 2}))[0]
    assert all(o.cached_tokens > 0 and o.compressed_hit for o in hit)  # n = 2: the sample forks from the hit
    exact = engine.generate([prompt], SamplingParams(**{**params.__dict__, "cache_lossless": True}))[0][0]
    assert exact.cached_tokens == 0 and not exact.compressed_hit and exact.output_ids == cold.output_ids
    engine.check_integrity()


def test_a_lossless_request_uses_exact_checkpoints():
    model, tok = load_zoo("gdn-tiny")
    prompt = tok.encode("for i in range(10):\n    total += i * i\n")
    engine = Engine(model, tok, EngineConfig())
    params = SamplingParams(max_tokens=4, temperature=0, cache_lossless=True)
    engine.generate([prompt], params)
    again = engine.generate([prompt], params)[0][0]
    assert again.cached_tokens > 0 and not again.compressed_hit
