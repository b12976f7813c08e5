"""Structured output (app/engine/grammar.py): the grammar's masks on their own, then the engine generating under
JSON schemas at temperature 1 beside unconstrained requests in the same steps, through preemption and n > 1.
Every output that ends with "stop" must parse and validate; one cut by max_tokens says "length"."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.grammar import JSON_OBJECT, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, for_tokenizer
from app.engine.request import SamplingParams
from app.engine.sampling import sample_rows
from tests.helpers import load_zoo

NAME = {"type": "string", "minLength": 1, "maxLength": 10}
SCHEMA = {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME},
                                                    "required": ["name"], "additionalProperties": False},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["user", "tags"], "additionalProperties": False}
PROMPT = "Reply with one JSON object.\n"


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def test_the_mask_ends_only_a_complete_value_and_never_allows_control_bytes(zoo):
    _, tok = zoo
    grammars = for_tokenizer(tok)
    state = grammars.state(json.dumps(SCHEMA))
    ids = tok.encode('{"name":"')
    inside = state.allowed(ids)
    assert not inside[list(tok.stop_token_ids)].any()
    controls = [i for i in range(tok.vocab_size) if any(b < 0x20 for b in tok.token_bytes(i))]
    assert controls and not inside[controls].any()  # xgrammar alone allows them in bounded strings
    assert inside[tok.encode("x")[0]]
    done = state.allowed(tok.encode('{"name":"x","age":7,"ok":true}'))
    assert set(done.nonzero().flatten().tolist()) == set(tok.stop_token_ids)
    state.sync(tok.encode('{"name":"y'))  # not an extension of what it consumed: starts over
    assert state.consumed == tok.encode('{"name":"y')
    assert grammars.compile(JSON_OBJECT) is grammars.compile(JSON_OBJECT)  # cached by text


@pytest.mark.parametrize("schema, message", [
    ('{"type": "frobnicate"}', "cannot be compiled"),
    ('{"$ref": "#/$defs/missing"}', "cannot be compiled"),
    ('{"type": "string", "minLength": 5, "maxLength": 2}', "cannot be compiled"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not JSON"),
    ('{"a":' * MAX_SCHEMA_DEPTH + "1" + "}" * MAX_SCHEMA_DEPTH, "nests deeper"),
    ('{"description": "' + "x" * MAX_SCHEMA_CHARS + '"}', "over the limit"),
], ids=["bad-type", "missing-ref", "min-over-max", "not-object", "not-json", "too-deep", "too-long"])
def test_bad_schemas_are_value_errors_at_validation(zoo, schema, message):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig())
    with pytest.raises(ValueError, match=message):
        engine.add_request(tok.encode(PROMPT), SamplingParams(guided_json=schema))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field, value", [("stop", ("}",)), ("stop_token_ids", (5,)), ("ignore_eos", True),
                                          ("min_tokens", 3)])
def test_fields_that_could_end_the_output_elsewhere_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(guided_json=JSON_OBJECT, max_tokens=16, **{field: value})


@pytest.mark.parametrize("allowed", [1, 2, 300])
def test_no_sampling_setting_picks_a_masked_token(allowed):
    """A grammar row is mostly -inf; min_p, top-k, top-p and temperature must still pick an allowed token."""
    gen = torch.Generator().manual_seed(allowed)
    rows = torch.randn(4, 4096, generator=gen) * 3
    ok = torch.zeros(4096, dtype=torch.bool)
    ok[torch.randperm(4096, generator=gen)[:allowed]] = True
    rows[:, ~ok] = float("-inf")
    for temperature, top_p, top_k, min_p in [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.0, 0.95, 50, 0.1),
                                             (1.5, 0.5, 0, 0.05), (0.01, 0.999, 0, 0.0)]:
        picks = sample_rows(rows.clone(), [temperature] * 4, [top_p] * 4, [top_k] * 4,
                            [torch.Generator().manual_seed(i) for i in range(4)], [min_p] * 4)
        assert all(ok[t] for t in picks), (temperature, top_p, top_k, min_p, picks)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]):
    """Step until done; -> final outputs by (request id, index), and whether some step mixed grammar rows with
    unconstrained ones."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final, mixed, run = {}, [], engine.run_works

    def recording(works):
        kinds = {w.seq.params.guided_json is not None for w in works if w.end == w.seq.num_tokens}
        mixed.append(kinds == {True, False})
        return run(works)

    engine.run_works = recording
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[(out.request_id, out.index)] = out
        engine.check_integrity()
    return ids, final, any(mixed)


def _check(outs, schema) -> int:
    """Every "stop" output parses and validates; the others are "length" at max_tokens. -> how many stopped."""
    stopped = 0
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            stopped += 1
        else:
            assert out.finish_reason == "length", out
    return stopped


def test_guided_rows_batched_with_plain_rows_all_stops_validate(zoo):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig())
    prompt = tok.encode(PROMPT)
    schemas = [SCHEMA, SCHEMA, NESTED]
    requests = [(prompt, SamplingParams(max_tokens=32, temperature=1.0, seed=s, n=2, guided_json=json.dumps(schema)))
                for s, schema in enumerate(schemas)]
    requests += [(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=9)),
                 (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    ids, final, mixed = _run(engine, requests)
    assert mixed  # constrained and unconstrained rows in the same step
    stopped = sum(_check([final[(rid, i)] for i in range(2)], schema) for rid, schema in zip(ids, schemas))
    assert stopped >= 3, stopped  # the tiny model closes most of these small objects within 32 tokens
    plain = final[(ids[-1], 0)]
    assert plain.output_ids == engine.generate([prompt], requests[-1][1])[0][0].output_ids  # unaffected
    short = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=1.0, guided_json=json.dumps(SCHEMA)))
    assert short[0][0].finish_reason == "length" and short[0][0].text.startswith("{")


def test_grammar_state_follows_outputs_through_preemption(zoo):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(max_running=3, kv_slots=80, chunk_size=16))
    requests = [(tok.encode(f"Request {s}: {PROMPT}"), SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                                                      guided_json=json.dumps(SCHEMA)))
                for s in range(3)]  # distinct prompts: 3 x ~43 tokens compete for 80 KV slots
    ids, final, _ = _run(engine, requests)
    assert engine.snapshot()["preemptions"] > 0
    assert _check([final[(rid, 0)] for rid in ids], SCHEMA) >= 1
