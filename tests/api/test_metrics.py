"""/metrics with vLLM's names under `dasc:` through the local backend on a real kda-tiny engine of its own (so the
counts start at 0), checked against the responses' usage; and the prefix cache counters' handling of replicas
that restart or leave. tests/deployments/test_serve.py checks the same names through the Ray ingress."""

from __future__ import annotations

import pytest

from app.api.local import LocalBackend
from app.api.metrics import ApiMetrics
from app.api.routes import ApiSettings, build_api
from app.engine.engine import Engine
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
