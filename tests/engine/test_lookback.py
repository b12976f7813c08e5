"""Lookback checkpoints (`EngineConfig.lookback`): a few-shot header's first query after the request that brought
the header resumes most of the way into it, and equals a cold run.

Before them, the first request on header + query stored its checkpoint at its own prompt end, past where the next
query leaves the header; that query replayed the whole header and cut a branch checkpoint, and only the query
after it hit."""

from __future__ import annotations

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

HEADER, QUERY, HEADERS = 500, 30, 4
ONE = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _ids(tok) -> list[int]:
    text = open(__file__.replace("test_lookback.py", "test_graphs.py")).read()
    ids = tok.encode(text * 8)
    assert len(ids) >= HEADERS * (HEADER + 3 * QUERY)
    return ids


def _workload(tok):
    """Per header: the warm-up (header + query 0), then the next query (header + query 1)."""
    ids, at = _ids(tok), 0
    out = []
    for _ in range(HEADERS):
        header, q0, q1 = (ids[at : at + HEADER], ids[at + HEADER : at + HEADER + QUERY],
                          ids[at + HEADER + QUERY : at + HEADER + 2 * QUERY])
        out.append((header + q0, header + q1))
        at += HEADER + 3 * QUERY
    return out


def _first_queries(engine: Engine, work) -> list:
    for warm, _ in work:
        engine.generate([warm], ONE)
    return [engine.generate([query], ONE)[0][0] for _, query in work]


def test_a_new_headers_first_query_resumes_inside_the_header_and_equals_a_cold_run():
    model, tok = load_zoo("kda-tiny")
    work = _workload(tok)
    engine = Engine(model, tok, EngineConfig(lookback=64, max_running=4))
    outs = _first_queries(engine, work)
    cold = Engine(model, tok, EngineConfig(enable_cache=False))
    for (_, query), out in zip(work, outs):
        assert out.cached_tokens >= 0.75 * HEADER
        assert out.output_ids == cold.generate([query], ONE)[0][0].output_ids
    reuse = engine.snapshot()["checkpoint_reuse_by_kind"]
    # the warm-ups stored one each; the queries, which resumed from them, cut a branch at the header's end instead
    assert reuse["lookback"] == {"stored": HEADERS, "reused": HEADERS, "never_reused": 0, "evicted_unused": 0,
                                 "unused_in_pool": 0}
    assert reuse["branch"]["stored"] == HEADERS
    assert reuse["prompt_end"]["reused"] == 0 and reuse["prompt_end"]["unused_in_pool"] == 2 * HEADERS


def test_without_lookback_the_first_query_misses():
    """The defect: with only prompt-end checkpoints the first query gets nothing cached."""
    model, tok = load_zoo("kda-tiny")
    outs = _first_queries(Engine(model, tok, EngineConfig(lookback=0, max_running=4)), _workload(tok))
    assert [o.cached_tokens for o in outs] == [0] * HEADERS
