"""The synchronous engine under bad requests and faults: seeds at and past the 64-bit range, a request that
fails while being added leaves nothing behind, a step that raises (in the forward, loading a checkpoint,
storing one) leaks no KV, checkpoint or state slot; and cache salts keep prefixes apart."""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

PROMPT = list(range(3, 40))
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(kv_slots=2048, checkpoint_slots=8, max_running=4)


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def _bypass(params: SamplingParams, **fields) -> SamplingParams:
    """Params carrying values `SamplingParams` refuses, as a caller that skips validation would send them."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _idle_and_clean(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine._seqs
    engine.check_integrity()


def test_sampling_params_refuse_seeds_outside_64_bits():
    for seed in (2**63, 2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_per_sample_seeds_never_overflow(zoo):
    """seed + index is taken modulo 2**64: the largest seed torch takes, 2**64 - 1, with n = 2 used to raise in
    add_request for the second sample, after the first had entered the scheduler. -1 is the same seed to torch."""
    engine = Engine(*zoo, CONFIG)
    top = _bypass(SamplingParams(**{**SAMPLED.__dict__}), seed=2**64 - 1)
    got = [o.output_ids for o in engine.generate([PROMPT], top)[0]]
    same = [o.output_ids for o in engine.generate([PROMPT], SamplingParams(**{**SAMPLED.__dict__, "seed": -1}))[0]]
    assert got == same and len(got[1]) == 6
    _idle_and_clean(engine)


def test_subnormal_temperatures_and_top_p_do_not_fail_the_step(zoo):
    """Found by schema fuzzing: temperature 5e-324 divided the logits into inf and failed the engine step (a 503,
    and the step's other requests aborted). Below 1e-5 a temperature is greedy; a tiny top_p keeps the top token."""
    engine = Engine(*zoo, CONFIG)
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0][0].output_ids
    for temperature, top_p in ((5e-324, 5e-324), (5e-324, 1.0), (1e-6, 1.0), (1.0, 5e-324)):
        out = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, seed=0))
        assert out[0][0].finish_reason == "length"
        if temperature < 1e-5 or top_p < 1e-5:
            assert out[0][0].output_ids == greedy, (temperature, top_p)
    _idle_and_clean(engine)


def test_a_request_that_fails_in_add_request_leaves_nothing(zoo):
    engine = Engine(*zoo, CONFIG)
    with pytest.raises(RuntimeError):
        engine.add_request(PROMPT, _bypass(SamplingParams(**{**SAMPLED.__dict__}), seed=0.5), "bad")
    assert not engine.scheduler.waiting
    _idle_and_clean(engine)
    assert engine.generate([PROMPT], GREEDY)[0][0].finish_reason == "length"


class _Fault:
    """Makes the next call of a worker verb (or the model's forward, as a hook) raise once."""

    def __init__(self, fn=None) -> None:
        self.fn, self.armed = fn, True

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected fault")
        return self.fn(*args) if self.fn is not None else None


def test_a_step_whose_forward_raises_gives_back_its_slots(zoo):
    model, tok = zoo
    engine = Engine(model, tok, CONFIG)
    engine.add_request(PROMPT, GREEDY, "a")
    engine.step()  # a decodes from here on
    engine.add_request(PROMPT[::-1], GREEDY, "b")
    hook = model.register_forward_pre_hook(_Fault())
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()  # a's decode piece and b's prefill piece had their KV slots allocated
    finally:
        hook.remove()
    _idle_and_clean(engine)  # both requests had a piece in the failed step: aborted
    assert engine.generate([PROMPT], GREEDY)[0][0].finish_reason == "length"


def test_a_failed_checkpoint_load_requeues_the_request_holding_nothing(zoo):
    engine = Engine(*zoo, CONFIG)
    want = engine.generate([PROMPT], GREEDY)[0][0]  # stores a prompt-end checkpoint
    engine.add_request(PROMPT, GREEDY, "hit")
    engine.worker.load = _Fault(engine.worker.load)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["hit"]
    engine.check_integrity()
    got = None
    while engine.has_unfinished():
        got = next((o for o in engine.step() if o.finished), got)
    assert got.output_ids == want.output_ids and got.cached_tokens > 0
    _idle_and_clean(engine)


def test_a_failed_checkpoint_store_returns_its_slot(zoo):
    engine = Engine(*zoo, CONFIG)
    engine.worker.store_snapshot = _Fault(engine.worker.store_snapshot)  # the prompt-end checkpoint
    engine.add_request(PROMPT, GREEDY, "a")
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished():
            engine.step()
    _idle_and_clean(engine)
    assert engine.cache.checkpoints.num_used == 0


def test_cache_salts_never_share_a_prefix(zoo):
    engine = Engine(*zoo, CONFIG)

    def cached(salt: str | None) -> int:
        params = SamplingParams(**{**GREEDY.__dict__, "cache_salt": salt})
        return engine.generate([PROMPT + [5, 6]], params)[0][0].cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") > 0 and cached("tenant-b") > 0 and cached(None) > 0
    _idle_and_clean(engine)
    assert set(engine.cache.tree.roots) == {None, "tenant-a", "tenant-b"}
    torch.testing.assert_close(engine.cache.tree.match(PROMPT, salt="tenant-c").kv_slots, torch.zeros(0).long())
