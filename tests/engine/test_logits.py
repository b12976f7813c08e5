"""Penalties, logit_bias, min_tokens and min_p (app/engine/logits.py, app/engine/sampling.py) against a reference
written here from vLLM's definitions, on the model's own logits: one forward over prompt + output from zero
state gives every position's raw row; the reference processes it and its argmax must be the engine's greedy
token at that position."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

PROMPT = "values = [1, 2, 3]\nfor v in values:\n    print(v)\nfor v in values:\n"


def _raw_rows(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model.forward_train(torch.tensor([prompt + output]))[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1]


def _reference(row: torch.Tensor, prompt: list[int], before: list[int], p: SamplingParams, ends) -> torch.Tensor:
    """vLLM's processing of one raw row, element by element, for the token after `before`."""
    x = row.clone()
    for t in set(prompt + before):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(before):
        x[t] -= p.frequency_penalty * before.count(t) + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    if len(before) < p.min_tokens:
        for t in (*p.stop_token_ids, *(() if p.ignore_eos else ends)):
            x[t] = float("-inf")
    return x


def _greedy(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0][0].output_ids


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_penalties_and_bias_follow_the_reference(name):
    model, tok = load_zoo(name)
    engine = Engine(model, tok, EngineConfig())
    prompt = tok.encode(PROMPT)
    plain = _greedy(engine, prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.6, presence_penalty=0.4, logit_bias=((plain[1], -3.0), (7, 1.5)))
    out = _greedy(engine, prompt, params)
    assert out != plain  # the processing changed the answer: the check below is not vacuous
    for k, row in enumerate(_raw_rows(model, prompt, out)):
        ref = _reference(row, prompt, out[:k], params, tok.stop_token_ids)
        assert ref[out[k]] >= ref.max() - 1e-4, (k, out[k], int(ref.argmax()))
    forced = _greedy(engine, prompt, SamplingParams(max_tokens=5, temperature=0, logit_bias=((42, 100.0),)))
    assert forced == [42] * 5
    engine.check_integrity()


def test_min_tokens_holds_stops_back():
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, EngineConfig())
    prompt = tok.encode(PROMPT)
    first = _greedy(engine, prompt, SamplingParams(max_tokens=1, temperature=0))[0]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(first,)))[0][0]
    assert stopped.output_ids == [first] and stopped.finish_reason == "stop"
    held = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(first,), min_tokens=4)
    out = engine.generate([prompt], held)[0][0]
    assert first not in out.output_ids[:4] and len(out.output_ids) >= 5
    for k, row in enumerate(_raw_rows(model, prompt, out.output_ids)):
        ref = _reference(row, prompt, out.output_ids[:k], held, tok.stop_token_ids)
        assert ref[out.output_ids[k]] >= ref.max() - 1e-4
    text_stop = tok.decode(out.output_ids[:1])  # a stop string that the first token's text already contains
    early = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, stop=(text_stop,), min_tokens=3,
                                                     ignore_eos=True))[0][0]
    assert len(early.output_ids) >= 3


def test_min_p_drops_the_unlikely_tokens():
    """Sampled at temperature 1 with min_p 0.3: every token is at least 0.3 times as likely as the row's best
    (raw logprobs are the distribution min_p sees at temperature 1)."""
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, EngineConfig(max_running=8))
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=1.0, min_p=0.3, seed=1, n=8, logprobs=1, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    seen = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.new_logprobs:
                for chosen, top in o.new_logprobs:
                    assert chosen >= top[0][1] + math.log(0.3) - 1e-5
                    seen += 1
    assert seen == 8 * 12


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(repetition_penalty=0.0), dict(min_p=1.5),
                                 dict(logit_bias=((1, 101.0),)), dict(min_tokens=20)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=16, **bad)
