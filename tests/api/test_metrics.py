"""/metrics with vLLM's names under `dasc:` through the local backend on a real kda-tiny engine of its own (so the
counts start at 0), checked against the responses' usage; the speculative decoding counters of a spec engine,
checked against its telemetry; and the prefix cache counters' handling of replicas that restart or leave.
tests/deployments/test_serve.py checks the same names through the Ray ingress."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.api.local import LocalBackend
from app.api.metrics import ApiMetrics
from app.api.routes import ApiSettings, build_api
from app.engine.engine import DISK_SECRET_ENV, Engine
from tests.api.common import AUTH, KEY, client, sse_events
from tests.api.conftest import CONFIG
from tests.helpers import load_zoo, metric_samples

pytestmark = pytest.mark.anyio
MODEL = {"model_name": "kda-tiny", "engine": "local"}


@pytest.fixture(scope="module")
def app():
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, CONFIG), model_name="kda-tiny")
    yield build_api(local, ApiSettings(model_name="kda-tiny", api_key=KEY))
    local.engine.shutdown()


def value(page: dict, name: str, **labels: str) -> float:
    return page[(name, frozenset(labels.items()))]


async def test_vllm_names_count_what_the_responses_report(app):
    prompt = "\n".join(f"row_{i} = {i * 37 % 101}" for i in range(40))
    greedy = {"temperature": 0, "ignore_eos": True}
    async with client(app) as http:
        bodies = [{"prompt": prompt, "max_tokens": 5, **greedy},
                  {"prompt": prompt, "max_tokens": 3, **greedy},  # the same prompt again: served from the cache
                  {"prompt": ["x = 1", "def f(a):"], "max_tokens": 4, **greedy}]  # two prompts: two generations
        usages = [(await http.post("/v1/completions", json=b, headers=AUTH)).json()["usage"] for b in bodies]
        chat = await http.post("/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, **greedy})
        usages.append(sse_events(chat.text)[-2]["usage"])
        page = metric_samples((await http.get("/metrics")).text)
    generations, outputs = 5, 5 + 3 + 4 + 4 + 6
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert sum(u["completion_tokens"] for u in usages) == outputs
    assert value(page, "dasc:prompt_tokens_total", **MODEL) == prompt_tokens
    assert value(page, "dasc:generation_tokens_total", **MODEL) == outputs
    assert value(page, "dasc:request_success_total", **MODEL, finished_reason="length") == generations
    for name in ("dasc:time_to_first_token_seconds", "dasc:e2e_request_latency_seconds"):
        assert value(page, f"{name}_count", **MODEL) == generations, name
        assert value(page, f"{name}_sum", **MODEL) > 0, name
    # one gap per output after a generation's first: every output carries one token
    for name in ("dasc:inter_token_latency_seconds", "dasc:time_per_output_token_seconds"):
        assert value(page, f"{name}_count", **MODEL) == outputs - generations, name
    assert value(page, "dasc:prefix_cache_queries_total", **MODEL) == prompt_tokens  # n = 1 throughout
    assert value(page, "dasc:prefix_cache_hits_total", **MODEL) == cached
    assert value(page, "dasc:num_requests_running", **MODEL) == 0
    assert value(page, "dasc:num_requests_waiting", **MODEL) == 0
    assert value(page, "dasc_ttft_seconds_count") == generations  # our own names keep working


async def test_response_store_operations_are_timed_by_op(app):
    """Each Responses request that stores (put), continues (get) or deletes times its store operation."""
    async with client(app) as http:
        before = metric_samples((await http.get("/metrics")).text)
        first = (await http.post("/v1/responses", headers=AUTH, json={
            "input": "hello", "max_output_tokens": 3, "temperature": 0})).json()
        await http.post("/v1/responses", headers=AUTH, json={
            "input": "and again", "previous_response_id": first["id"], "max_output_tokens": 3, "temperature": 0})
        await http.delete(f"/v1/responses/{first['id']}", headers=AUTH)
        page = metric_samples((await http.get("/metrics")).text)

    def count(p: dict, op: str) -> float:
        return p.get(("dasc_response_store_seconds_count", frozenset({("op", op)})), 0.0)

    assert [count(page, op) - count(before, op) for op in ("put", "get", "delete")] == [2, 1, 1]
    assert value(page, "dasc_response_store_seconds_sum", op="get") > 0


@pytest.fixture(scope="module")
def spec_backend():
    """A LocalBackend over a kda-tiny engine of its own with prompt lookup speculation (spec_tokens 4)."""
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, replace(CONFIG, spec="ngram")), model_name="kda-tiny")
    yield local
    local.engine.shutdown()


SPEC_SERIES = ("dasc:spec_decode_num_drafts_total", "dasc:spec_decode_num_draft_tokens_total",
               "dasc:spec_decode_num_accepted_tokens_total", "dasc:spec_decode_acceptance_length_count",
               "dasc:spec_decode_acceptance_length_sum")
SEEDS = ("def area(radius):\n", "import os\n\n\nclass Cache:\n")


async def test_spec_decode_counters_and_acceptance_histogram_match_the_engine(spec_backend):
    """Per seed: its greedy continuation, then seed + continuation + seed, which the model continues as before, so
    prompt lookup drafts it and the drafts are accepted. After each seed /metrics shows the engine's verify pieces,
    drafts and accepted drafts (its telemetry, read right after the scrape with the engine idle), the acceptance
    histogram is the engine's per-verify distribution bucket by bucket (count: verifies, sum: accepted); the
    counters never decrease, and a scrape with no traffic in between adds nothing."""
    app = build_api(spec_backend, ApiSettings(model_name="kda-tiny", api_key=KEY))
    greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": 32}
    pages, snaps = [], []
    async with client(app) as http:
        for seed in SEEDS:
            first = await http.post("/v1/completions", json={"prompt": seed, **greedy}, headers=AUTH)
            again = seed + first.json()["choices"][0]["text"] + "\n\n" + seed
            second = await http.post("/v1/completions", json={"prompt": again, **greedy}, headers=AUTH)
            assert second.json()["usage"]["completion_tokens"] == 32
            pages.append(metric_samples((await http.get("/metrics")).text))
            snaps.append(spec_backend.engine.snapshot())
        pages.append(metric_samples((await http.get("/metrics")).text))  # nothing ran since the last scrape
    for page, snap in zip(pages, snaps + snaps[-1:]):
        drafts = value(page, "dasc:spec_decode_num_drafts_total", **MODEL)
        draft_tokens = value(page, "dasc:spec_decode_num_draft_tokens_total", **MODEL)
        accepted = value(page, "dasc:spec_decode_num_accepted_tokens_total", **MODEL)
        assert (drafts, draft_tokens, accepted) == (snap["spec_verifies"], snap["spec_drafted_tokens"],
                                                    snap["spec_accepted_tokens"])
        assert 0 < drafts <= draft_tokens <= 4 * drafts  # 1 to spec_tokens drafts per verify piece
        assert 0 < accepted <= draft_tokens
        hist = {int(a): n for a, n in snap["spec_accepted_per_verify"].items()}
        assert value(page, "dasc:spec_decode_acceptance_length_count", **MODEL) == drafts == sum(hist.values())
        assert value(page, "dasc:spec_decode_acceptance_length_sum", **MODEL) == accepted == sum(
            a * n for a, n in hist.items())
        buckets = {float(dict(labels)["le"]): v for (name, labels), v in page.items()
                   if name == "dasc:spec_decode_acceptance_length_bucket"}
        assert buckets.pop(float("inf")) == drafts
        assert len(buckets) == 17  # le 0 .. 16, MAX_SPEC_TOKENS
        for le, v in buckets.items():
            assert v == sum(n for a, n in hist.items() if a <= le), le
    assert snaps[0]["spec_accepted_tokens"] > 10  # the repeated prompts' drafts were mostly accepted
    for name in SPEC_SERIES:
        seen = [value(page, name, **MODEL) for page in pages]
        assert seen[0] <= seen[1] == seen[2], name
    assert value(pages[1], "dasc:spec_decode_num_drafts_total", **MODEL) > value(
        pages[0], "dasc:spec_decode_num_drafts_total", **MODEL)


def test_prefix_cache_counters_never_decrease_when_replicas_restart_or_leave():
    m = ApiMetrics("m")

    def hits() -> dict[str, float]:
        page = metric_samples(m.render(snaps))
        return {dict(labels)["engine"]: v for (name, labels), v in page.items()
                if name == "dasc:prefix_cache_hits_total"}

    snaps = {"a": {"prompt_tokens": 100, "cached_tokens": 40}}
    assert hits() == {"a": 40}
    snaps = {"a": {"prompt_tokens": 150, "cached_tokens": 70}, "b": {"prompt_tokens": 10, "cached_tokens": 0}}
    assert hits() == {"a": 70, "b": 0}
    snaps = {"b": {"prompt_tokens": 30, "cached_tokens": 20}}  # a left: its series stays at its last value
    assert hits() == {"a": 70, "b": 20}
    snaps = {"a": {"prompt_tokens": 8, "cached_tokens": 5}, "b": {"prompt_tokens": 30, "cached_tokens": 20}}
    assert hits() == {"a": 75, "b": 20}  # a came back restarted from 0: its 5 are new
    page = metric_samples(m.render(snaps))
    assert value(page, "dasc:prefix_cache_queries_total", model_name="m", engine="a") == 158
    assert ("dasc:num_requests_running", frozenset({"model_name": "m", "engine": "a"}.items())) in page
    page = metric_samples(m.render({}))
    assert not any(name == "dasc:num_requests_running" for name, _ in page)  # gauges leave with their replica


async def test_host_tier_series_show_what_the_engine_holds_and_moved():
    """A one-slot pool and a host tier: two prompts demote the first one's checkpoint, asking it again promotes it.
    /metrics shows the tier's entries and bytes by kind as the engine holds them, and its counters as the engine
    counted them; /status carries the same fields."""
    model, tok = load_zoo("kda-tiny")
    local = LocalBackend(Engine(model, tok, replace(CONFIG, checkpoint_slots=1, host_mb=16.0)), model_name="kda-tiny")
    app = build_api(local, ApiSettings(model_name="kda-tiny", api_key=KEY))
    prompts = ["\n".join(f"alpha_{i} = {i * 7}" for i in range(40)), "\n".join(f"beta_{i} = {i}" for i in range(40))]
    try:
        async with client(app) as http:
            for prompt in prompts + prompts[:1]:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=AUTH)
                assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            page = metric_samples((await http.get("/metrics")).text)
            status = (await http.get("/status", headers=AUTH)).json()["replicas"]["local"]
        snap = local.engine.snapshot()
        tier = {**MODEL, "tier": "host"}
        entries = value(page, "dasc:cache_tier_entries", **tier)
        assert entries == snap["host_tier_entries"] == status["host_tier_entries"]
        for kind in ("state", "kv"):
            assert value(page, "dasc:cache_tier_bytes", **tier, kind=kind) == snap[f"host_tier_{kind}_bytes"] > 0
        for name in ("demotions", "promotions", "hits", "promoted_tokens"):
            assert value(page, f"dasc:cache_tier_{name}_total", **tier) == snap[f"host_tier_{name}"] > 0
    finally:
        local.engine.shutdown()


async def test_disk_tier_series_show_its_writes_hits_rejections_and_queue(tmp_path, monkeypatch):
    """The host tier off and a one-slot pool: each prompt's checkpoint goes to disk when the next one evicts it,
    asking the first again is a disk hit; a file damaged meanwhile is refused. /metrics counts what /status shows."""
    monkeypatch.setenv(DISK_SECRET_ENV, "metrics-secret")
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, replace(CONFIG, checkpoint_slots=1, disk_dir=str(tmp_path)))
    local = LocalBackend(engine, model_name="kda-tiny")
    app = build_api(local, ApiSettings(model_name="kda-tiny", api_key=KEY))
    prompts = ["\n".join(f"{name}_{i} = {i * 7}" for i in range(40)) for name in ("alpha", "beta", "gamma")]
    try:
        async with client(app) as http:
            for prompt in prompts:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=AUTH)
                assert r.status_code == 200
            engine.cache.disk.flush()
            files = sorted(tmp_path.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
            files[-1].write_bytes(files[-1].read_bytes()[:100])  # the latest (beta's): torn
            for prompt in prompts[:2]:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=AUTH)
            engine.cache.disk.flush()  # the writes those evictions queued are done: both pages see the same
            page = metric_samples((await http.get("/metrics")).text)
            status = (await http.get("/status", headers=AUTH)).json()["replicas"]["local"]["disk_tier"]
        assert status == engine.snapshot()["disk_tier"] | {"queued": status["queued"]}
        assert status["hits"] >= 1 and status["writes"] >= 2 and status["rejected"] == {"torn": 1}
        assert value(page, "dasc:cache_tier_hits_total", **MODEL, tier="disk") == status["hits"]
        assert value(page, "dasc:disk_tier_writes_total", **MODEL) == status["writes"]
        assert value(page, "dasc:disk_tier_written_bytes_total", **MODEL) == status["written_bytes"] > 0
        assert value(page, "dasc:disk_tier_rejected_total", **MODEL, reason="torn") == 1
        assert value(page, "dasc:disk_tier_queue_length", **MODEL) == status["queued"]
        assert value(page, "dasc:disk_tier_files", **MODEL) >= 2
    finally:
        local.engine.shutdown()
