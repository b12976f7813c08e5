"""The reliability suite's pure parts (loadtest/reliability.py, loadtest/faults/): request bytes and response
parsing, answer classes, the bad-input catalogue's coverage, fuzzing caps, soak growth, request fates, config
merging, scenario selection and the doc block. Network only to an in-process asyncio server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadtest import reliability
from loadtest.faults.background import fate
from loadtest.faults.catalogue import BIG, CHAT, COMMON, COMPLETIONS, LABEL, ONLY, Raw, _extremes, cases, dumps
from loadtest.faults.client import (
    Answer,
    Outcome,
    RawRequest,
    classify,
    encode_request,
    is_openai_error,
    parse_response,
    send,
    sse_events,
)
from loadtest.faults.cluster import app_args, merge
from loadtest.faults.fuzz import cheap, plan
from loadtest.faults.soak import growth

REPO = Path(__file__).resolve().parents[2]
ERR = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}


def test_encode_request_frames_the_body_three_ways():
    body = b'{"a": 1}'
    length = encode_request(RawRequest("x", "/p", body), "h:1")
    assert length.startswith(b"POST /p HTTP/1.1\r\nhost: h:1\r\nconnection: close\r\n")
    assert b"content-length: 8\r\n\r\n" + body == length[length.index(b"content-length"):]
    chunked = encode_request(RawRequest("x", "/p", body, framing="chunked", chunk=3), "h")
    assert b"transfer-encoding: chunked" in chunked and b"content-length" not in chunked
    assert chunked.endswith(b'\r\n\r\n3\r\n{"a\r\n3\r\n": \r\n2\r\n1}\r\n0\r\n\r\n')
    none = encode_request(RawRequest("x", "/p", body, framing="none"), "h")
    assert b"content-length" not in none and b"transfer-encoding" not in none and none.endswith(body)
    lie = encode_request(RawRequest("x", "/p", body, content_length=3), "h")
    assert b"content-length: 3\r\n" in lie
    with pytest.raises(ValueError):
        RawRequest("x", "/p", framing="gzip")


def test_parse_response_reads_length_chunked_and_nothing():
    a = parse_response(b"HTTP/1.1 400 Bad\r\nContent-Length: 2\r\nX-A: b\r\n\r\n{}junk")
    assert (a.status, a.body, a.headers["x-a"]) == (400, b"{}", "b")
    c = parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n1;x=y\r\nc\r\n0\r\n\r\n")
    assert (c.status, c.body) == (200, b"abc")
    assert parse_response(b"").status == 0 and parse_response(b"garbage\r\n\r\n").status == 0


def _answer(status, body, ctype="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Answer(status, {"content-type": ctype}, data)


def test_classify_names_every_kind_of_answer():
    sse = "text/event-stream"
    assert classify(Answer(hung=True)) == "hang"
    assert classify(Answer()) == "no_answer"
    assert classify(_answer(500, ERR)) == "5xx"
    assert classify(_answer(400, ERR)) == "rejected"
    assert classify(_answer(400, {"detail": "x"})) == "not_json"
    assert classify(_answer(500, b"Internal Server Error", "text/plain")) == "5xx"
    assert classify(_answer(400, b"Invalid HTTP request", "text/plain")) == "not_json"
    assert classify(_answer(200, {"choices": []})) == "ok"
    assert classify(_answer(200, b'data: {"choices": []}\n\ndata: [DONE]\n\n', sse)) == "ok"
    assert classify(_answer(200, b'data: {"choices": []}\n\n', sse)) == "not_json"
    boom = {"error": {**ERR["error"], "type": "server_error"}}
    assert classify(_answer(200, f"data: {json.dumps(boom)}\n\ndata: [DONE]\n\n".encode(), sse)) == "stream_error"


def test_openai_error_shape():
    assert is_openai_error(ERR)
    assert not is_openai_error({**ERR, "detail": 1})
    assert not is_openai_error({"error": {"message": "m", "type": "t"}})
    assert not is_openai_error({"error": "m"}) and not is_openai_error([ERR])
    assert sse_events(b'data: {"a": 1}\n\nevent: x\ndata: [DONE]\n\n') == [{"a": 1}, "[DONE]"]


def test_catalogue_tries_every_field_at_every_extreme_on_both_endpoints():
    names = [c.request.name for c in cases("m")]
    assert len(names) == len(set(names))
    labels = [label for label, _ in _extremes()]
    for path in (COMPLETIONS, CHAT):
        for field in COMMON + ONLY[path]:
            for label in labels:
                assert f"{LABEL[path]}:{field}={label}" in names
    framings = {c.request.framing for c in cases("m")}
    assert framings == {"length", "chunked", "none"}
    over = [c.request for c in cases("m") if c.request.name.startswith("size:over_limit")]
    assert {r.framing for r in over} == {"length", "chunked"} and all(len(r.body) > 1 << 20 for r in over)
    assert {"encoding:utf16", "encoding:invalid_utf8", "encoding:raw_surrogate"} <= set(names)
    assert {c.request.name for c in cases("m") if c.protocol} == {"header:length_nan", "header:length_neg",
                                                                  "header:auth_junk"}


def test_catalogue_bodies_hold_what_json_dumps_would_not_write():
    text = dumps({"a": Raw("NaN"), "b": [Raw("1" + "0" * 5000)], "c": "\ud800", "d": "x" * 3}).decode()
    assert text == '{"a": NaN, "b": [1' + "0" * 5000 + '], "c": "\\ud800", "d": "xxx"}'
    seeded = [c for c in cases("m") if c.request.name == "completions:seed=18446744073709551616:stream=True"]
    assert json.loads(seeded[0].request.body) == {"model": "m", "prompt": "hello", "max_tokens": 2,
                                                  "seed": 2**64, "stream": True}
    huge = [c for c in cases("m") if c.request.name == "chat:messages=huge_str"][0]
    assert BIG < len(huge.request.body) < 1 << 20


def test_fuzz_caps_only_valid_generation_lengths():
    assert cheap({"max_tokens": 900, "n": 16, "x": 1}) == {"max_tokens": 8, "n": 2, "x": 1}
    kept = {"max_tokens": 5000, "n": 17, "max_completion_tokens": -3, "top_k": 900}
    assert cheap(kept) == kept and cheap({"n": True}) == {"n": True} and cheap([1]) == [1]
    rows = plan([("GET", "/health"), ("POST", "/a"), ("POST", "/b")], 600)
    assert ("GET", "/health", "positive", 5) in rows
    assert sum(n for m, _, _, n in rows if m == "POST") >= 590


def test_soak_growth_starts_after_warmup_and_flags_a_replaced_process():
    samples = [(0, {"a": 50, "b": 10}), (60, {"a": 100, "b": 10}), (300, {"a": 105, "b": 9}), (600, {"a": 108})]
    assert growth(samples, 60) == {"a": pytest.approx(0.08), "b": None}
    assert growth(samples[:2], 60) == {}


def test_request_fates():
    assert fate(200, 3, True, False) == "ok"
    assert fate(200, 3, True, True) == "failed_after_token"
    assert fate(200, 0, False, False) == "failed_before_token"
    assert fate(503, 0, False, False) == "failed_before_token"
    assert fate(429, 0, False, False) == "failed_before_token"
    assert fate(400, 0, False, False) == "rejected"


def test_app_args_come_from_the_serve_config_with_overrides():
    args = app_args(REPO / "configs" / "config.yaml", {"controller": {"enabled": False}, "replicas": 3})
    assert args["controller"]["enabled"] is False and args["controller"]["window_s"] == 10.0
    assert args["replicas"] == 3 and args["model"] == "kda-tiny"
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 5}, "d": 1}) == {"a": {"b": 5, "c": 2}, "d": 1}


def test_scenarios_selection_and_groups():
    assert [s.name for s in reliability.select("soak, fuzz")] == ["soak", "fuzz"]
    with pytest.raises(SystemExit):
        reliability.select("fuzz,nope")
    groups = reliability._groups(reliability.select(None))
    assert [g for g, _ in groups] == ["main", "tp", "two_node", "disk", "disk_tiny", "fetch"]
    assert {s.name for _, ss in groups for s in ss} == set(reliability.SCENARIOS)
    assert reliability.options(reliability.SCENARIOS["soak"], short=True).duration_s < 600
    assert reliability.options(reliability.SCENARIOS["soak"], short=False).duration_s == 600


def test_render_and_outcome():
    out = Outcome(figures={"n": 3})
    out.check("no 5xx", True, "0", 0)
    out.check("no hang", False, "0", 2)
    out.find(request="POST /v1/completions | x")
    assert not out.passed and out.as_dict()["criteria"]["no hang"]["pass"] is False
    text = reliability.render(out)
    assert "| no hang | 0 | 2 | **FAIL** |" in text and "POST /v1/completions \\| x" in text
    assert reliability.render(Outcome(skipped="needs Ray")) == "Skipped: needs Ray"
    assert not Outcome(skipped="x").passed


def test_a_scenario_that_raises_is_a_failed_outcome():
    def boom(target, opts):
        raise RuntimeError("down")

    s = reliability.Scenario("x", "X", boom, "http", {}, {})
    out = reliability.run_one(s, reliability.Target("http://127.0.0.1:1"), short=False)
    assert not out.passed and "RuntimeError('down')" in out.criteria["ran to the end"]["got"]
    assert reliability.run_one(s, None, short=False).skipped


def test_send_reads_an_early_answer_and_reports_a_hang():
    """Against an in-process server: one answers 413 before reading an 8 MB body and closes; one never answers."""
    async def main():
        async def early(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Too Large\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(json.dumps(ERR))).encode() + b"\r\n\r\n" + json.dumps(ERR).encode())
            await writer.drain()
            writer.close()

        async def silent(reader, writer):
            await asyncio.sleep(30)

        servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (early, silent)]
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
        big = await send(urls[0], RawRequest("big", "/v1/completions", b"x" * (8 << 20)), 30)
        hung = await send(urls[1], RawRequest("x", "/v1/completions", b"{}"), 0.5)
        for s in servers:
            s.close()
        return big, hung

    big, hung = asyncio.run(main())
    assert big.status == 413 and classify(big) == "rejected"
    assert hung.hung and classify(hung) == "hang"
