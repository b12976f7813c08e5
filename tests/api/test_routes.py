"""The OpenAI routes in-process (httpx's ASGI transport) over a LocalBackend on a real kda-tiny engine: completion,
chat and their streams, `stream_options.include_usage`, `echo`, `n > 1`, cached tokens, models, /metrics and
/status. tests/deployments/test_serve.py runs the same app behind Ray Serve for what needs Ray."""

from __future__ import annotations

import pytest

from app.api.routes import ApiSettings, build_api
from tests.api.common import AUTH, KEY, client, openai_client, sse_events

pytestmark = pytest.mark.anyio
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, ApiSettings(model_name="kda-tiny", api_key=KEY))


async def test_completion_chat_and_streams_through_the_openai_client(app):
    async with client(app) as http:
        c = openai_client(http)
        r = await c.completions.create(model="kda-tiny", prompt="def add(a, b):\n    return", max_tokens=8,
                                       temperature=0)
        assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
        assert r.system_fingerprint == "dasc-local"
        chat = await c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=8, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        stream = await c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True)
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason is not None
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        again = await c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0)
        assert text == again.choices[0].message.content  # greedy: streaming and not agree
        stream = await c.completions.create(model="kda-tiny", prompt="import os\n", max_tokens=6, temperature=0,
                                            stream=True)
        streamed = "".join([ch.choices[0].text async for ch in stream])
        plain = await c.completions.create(model="kda-tiny", prompt="import os\n", max_tokens=6, temperature=0)
        assert streamed == plain.choices[0].text
        assert [m.id for m in (await c.models.list()).data] == ["kda-tiny"]


async def test_include_usage_adds_a_final_usage_chunk(app):
    prompt = "class Stack:\n    def push(self, x):"
    bodies = {
        "text_completion": ("/v1/completions", {"prompt": prompt}),
        "chat.completion.chunk": ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    }
    async with client(app) as http:
        for kind, (path, body) in bodies.items():
            plain = (await http.post(path, json={**body, **GREEDY}, headers=AUTH)).json()
            with_usage = await http.post(path, json={**body, **GREEDY, "stream": True,
                                                     "stream_options": {"include_usage": True}}, headers=AUTH)
            without = await http.post(path, json={**body, **GREEDY, "stream": True}, headers=AUTH)
            events, plain_events = sse_events(with_usage.text), sse_events(without.text)
            assert events[-1] == "[DONE]" and plain_events[-1] == "[DONE]", kind
            last = events[-2]
            assert last["object"] == kind and last["id"] == events[0]["id"] and last["choices"] == [], kind
            assert last["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"], kind
            assert last["usage"]["completion_tokens"] == GREEDY["max_tokens"], kind
            assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + GREEDY["max_tokens"], kind
            assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, kind  # the plain request's prefix
            assert last["system_fingerprint"] == plain["system_fingerprint"], kind  # the replica that served it
            assert all("usage" not in e for e in events[:-2] + plain_events[:-1]), kind
            assert len(plain_events) == len(events) - 1, kind


async def test_echo_prepends_the_prompt(app, backend):
    prompt = "def fibonacci(n):"
    async with client(app) as http:
        plain = (await http.post("/v1/completions", json={"prompt": prompt, **GREEDY}, headers=AUTH)).json()
        echoed = (await http.post("/v1/completions", json={"prompt": prompt, "echo": True, **GREEDY},
                                  headers=AUTH)).json()
        ids = backend.tokenizer.encode(prompt)
        by_ids = (await http.post("/v1/completions", json={"prompt": ids, "echo": True, **GREEDY},
                                  headers=AUTH)).json()
        stream = await http.post("/v1/completions", json={"prompt": prompt, "echo": True, "stream": True, "n": 2,
                                                          **GREEDY}, headers=AUTH)
    prompt_text = backend.tokenizer.decode(ids)
    assert echoed["choices"][0]["text"] == prompt_text + plain["choices"][0]["text"]
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]
    assert echoed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(ids)
    assert echoed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    events = sse_events(stream.text)[:-1]
    first = [e["choices"][0] for e in events[:2]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in first] == [(0, prompt_text, None),
                                                                           (1, prompt_text, None)]
    for index in (0, 1):
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == index)
        assert text == echoed["choices"][0]["text"], index


async def test_n_choices_are_indexed_per_prompt(app):
    prompts = ["import json\n", "for i in range(10):"]
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    async with client(app) as http:
        one = [(await http.post("/v1/completions", json={"prompt": p, **sampled}, headers=AUTH)).json()
               for p in prompts]
        many = (await http.post("/v1/completions", json={"prompt": prompts, "n": 3, **sampled},
                                headers=AUTH)).json()
        stream = await http.post("/v1/completions", json={"prompt": prompts, "n": 3, "stream": True, **sampled},
                                 headers=AUTH)
        chat = (await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompts[0]}], "n": 4, **sampled}, headers=AUTH)).json()
        chat_stream = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompts[0]}], "n": 4, "stream": True, **sampled}, headers=AUTH)
    assert [c["index"] for c in many["choices"]] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in many["choices"])
    assert many["usage"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in one)
    assert many["usage"]["completion_tokens"] == 6 * sampled["max_tokens"]
    assert many["choices"][0]["text"] == one[0]["choices"][0]["text"]  # sample 0 of a seeded request is n=1's
    assert many["choices"][3]["text"] == one[1]["choices"][0]["text"]
    events = sse_events(stream.text)[:-1]
    for index in range(6):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
        assert "".join(c["text"] for c in mine) == many["choices"][index]["text"], index
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2, 3]
    assert chat["usage"]["completion_tokens"] == 4 * sampled["max_tokens"]
    chat_events = sse_events(chat_stream.text)[:-1]
    for index in range(4):
        mine = [e["choices"][0] for e in chat_events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine) == chat["choices"][index]["message"]["content"]


async def test_repeated_prompt_reports_cached_tokens(app):
    prompt = "\n".join(f"row_{i} = {i * 37 % 101}" for i in range(40))
    async with client(app) as http:
        first = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                                 headers=AUTH)).json()
        second = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                                  headers=AUTH)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_health_metrics_and_status_need_no_key(app):
    async with client(app) as http:
        await http.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2}, headers=AUTH)
        health = await http.get("/health")
        metrics = await http.get("/metrics")
        status = await http.get("/status")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for name in ("dasc_engine_hit_rate", "dasc_engine_checkpoint_slots", "dasc_ttft_seconds_bucket"):
        assert name in metrics.text, name
    assert 'dasc_engine_prompt_tokens{replica="local"}' in metrics.text
    assert list(status.json()["replicas"]) == ["local"]
    assert status.json()["replicas"]["local"]["requests_finished"] >= 1
