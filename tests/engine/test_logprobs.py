"""Output-token logprobs (`SamplingParams.logprobs`) against a reference on the model's logits: one forward over
prompt + output from zero state, nothing cached, log_softmax at each position. They are the raw model's, so
greedy and sampled requests alike, cold runs and cache hits alike, must match it."""

from __future__ import annotations

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

TOL = 1e-4


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-probabilities of each output position."""
    with torch.no_grad():
        logits = model.forward_train(torch.tensor([prompt + output]))[0]
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


def _assert_matches(model, prompt: list[int], outs: list, k: int) -> None:
    for out in outs:
        got = [lp for o in out for lp in o.new_logprobs]
        ids = [t for o in out for t in o.new_token_ids]
        assert len(got) == len(ids)
        ref = _reference(model, prompt, ids)
        for pos, (token, (chosen, top)) in enumerate(zip(ids, got, strict=True)):
            assert abs(chosen - ref[pos, token].item()) < TOL, (pos, chosen, ref[pos, token].item())
            want_v, want_i = ref[pos].topk(k)
            assert len(top) == k
            assert max(abs(v - w) for (_, v), w in zip(top, want_v.tolist())) < TOL if k else top == []
            # ids in order, except where two alternatives are within float noise of each other
            assert all(i == w or abs(v - ref[pos, w].item()) < TOL
                       for (i, v), w in zip(top, want_i.tolist())), (pos, top, want_i.tolist())


def _stream(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    """Every output of the request, by sample index."""
    rid = engine.add_request(prompt, params)
    outs: dict[int, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                outs.setdefault(o.index, []).append(o)
    return [outs[i] for i in sorted(outs)]


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_output_logprobs_match_the_models_log_softmax(name):
    model, tok = load_zoo(name)
    engine = Engine(model, tok, EngineConfig(max_running=4))
    prompt = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    _assert_matches(model, prompt, _stream(engine, prompt, greedy), 5)
    hit = _stream(engine, prompt, greedy)  # the prompt-end checkpoint of the first run serves this one
    assert hit[0][-1].cached_tokens > 0
    _assert_matches(model, prompt, hit, 5)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True, logprobs=0)
    _assert_matches(model, prompt, _stream(engine, prompt, sampled), 0)
    engine.check_integrity()


def test_logprobs_change_no_tokens_and_are_absent_unless_asked():
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, EngineConfig())
    prompt = tok.encode("import os\nimport sys\n")
    for temperature, seed in ((0.0, None), (1.0, 11)):
        plain = SamplingParams(max_tokens=10, temperature=temperature, seed=seed, ignore_eos=True)
        without = _stream(engine, prompt, plain)[0]
        with_lp = _stream(engine, prompt, SamplingParams(**{**plain.__dict__, "logprobs": 3}))[0]
        assert [o.new_token_ids for o in with_lp] == [o.new_token_ids for o in without]
        assert all(o.new_logprobs is None for o in without)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_prompt_logprobs_are_exact_and_never_resume_inside_the_prompt(name):
    """Every prompt token's entry from the first on equals the reference, in pieces of a small chunk size, also
    when the prompt is cached (the request recomputes it: cached_tokens 0), and with max_tokens 0."""
    model, tok = load_zoo(name)
    engine = Engine(model, tok, EngineConfig(max_running=4, chunk_size=48))
    prompt = tok.encode(open(__file__).read()[:600])
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # caches the prompt's checkpoints
    ref = _reference(model, prompt[:1], prompt[1:])  # row j: token j + 1 of the prompt
    for max_tokens in (0, 3):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=2, logprobs=2)
        outs = _stream(engine, prompt, params)[0]
        entries = outs[0].prompt_logprobs
        assert outs[-1].cached_tokens == 0 and entries[0] is None and len(entries) == len(prompt)
        assert all(o.prompt_logprobs is None for o in outs[1:])
        for j, (chosen, top) in enumerate(entries[1:]):
            assert abs(chosen - ref[j, prompt[j + 1]].item()) < TOL
            assert max(abs(v - w) for (_, v), w in zip(top, ref[j].topk(2).values.tolist(), strict=True)) < TOL
        assert sum(len(o.new_token_ids) for o in outs) == max_tokens and outs[-1].finish_reason == "length"
    engine.check_integrity()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
