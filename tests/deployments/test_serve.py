"""Integration: the built app on a real local Ray Serve (loopback), real HTTP, the official openai client.

Two replicas of kda-tiny behind the prefix-aware router. Checks the OpenAI API (completion, chat,
streaming, cached_tokens), errors (400/401/413), /metrics, prefix affinity after the stats refresh and the
request ratio under skew; then a second deployment whose working set exceeds dense capacity, where the
tuning controller must move off dense within a bounded number of windows.
"""

from __future__ import annotations

import os
import random
import socket
import time

import httpx
import pytest
import ray
from openai import BadRequestError, OpenAI
from ray import serve

from deployments import controller as controller_mod
from deployments.builder import build_app

KEY = "test-key"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def server(cluster):
    app = build_app({
        "model": "kda-tiny", "replicas": 2, "replica_cpus": 0.5,
        "engine": {"checkpoint_budget_mb": 8},
        "router": {"stats_period_s": 0.5, "min_match_tokens": 16},
        "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": KEY, "max_prompt_tokens": 2048, "max_tokens_limit": 64},
    })
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    yield cluster
    serve.delete("dasc")
    _kill_controller()


def _kill_controller() -> None:
    try:
        ray.kill(controller_mod.lookup(), no_restart=True)
    except ValueError:  # not running
        pass


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _prompt(seed: int, n: int = 300) -> str:
    rng = random.Random(seed)
    return "\n".join(f"value_{seed}_{i} = {rng.randint(0, 999)}" for i in range(n // 6))


def test_completion_chat_and_streaming(server):
    c = _client(server)
    r = c.completions.create(model="kda-tiny", prompt="def add(a, b):\n    return", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
    chat = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason is not None
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    again = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                      temperature=0)
    assert text == again.choices[0].message.content  # greedy: streaming and not agree
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="kda-tiny", prompt="import os\n", max_tokens=6, temperature=0, stream=True))
    assert streamed == c.completions.create(model="kda-tiny", prompt="import os\n", max_tokens=6,
                                            temperature=0).choices[0].text
    assert [m.id for m in c.models.list().data] == ["kda-tiny"]


def test_repeated_prefix_reports_cached_tokens(server):
    c = _client(server)
    prompt = _prompt(1)
    first = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.system_fingerprint == first.system_fingerprint  # the router kept the prefix's replica


def test_bad_inputs_get_openai_errors(server):
    h = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/v1/completions"
    cases = [({"prompt": "x", "max_tokens": -1}, 400), ({"prompt": "x", "temperature": 9}, 400),
             ({"prompt": ""}, 400), ({"prompt": "x", "max_tokens": 65}, 400), ({"max_tokens": 3}, 400),
             ({"prompt": "x " * 2100}, 413), ({"prompt": "x", "top_p": 0}, 400), ({"prompt": [[]]}, 400)]
    for body, status in cases:
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["message"], body
    r = httpx.post(url, content=b"{oops", headers={**h, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": "x"}, timeout=30).status_code == 401
    wrong_key = {"Authorization": "Bearer nope"}
    assert httpx.post(url, json={"prompt": "x"}, headers=wrong_key, timeout=30).status_code == 401
    big = httpx.post(url, content=b"x" * (2 << 20), headers={**h, "content-type": "application/json"}, timeout=30)
    assert big.status_code == 413
    with pytest.raises(BadRequestError):
        _client(server).chat.completions.create(model="kda-tiny", messages=[], max_tokens=4)


def test_metrics_expose_hit_rate_slots_and_ttft(server):
    c = _client(server)
    c.completions.create(model="kda-tiny", prompt=_prompt(2), max_tokens=2, temperature=0)
    time.sleep(1.5)  # replicas push a telemetry window every window_s
    text = httpx.get(f"{server}/metrics", timeout=30).text
    for name in ("dasc_engine_hit_rate", "dasc_engine_checkpoint_slots", "dasc_ttft_seconds_bucket"):
        assert name in text, name
    status = httpx.get(f"{server}/status", timeout=30).json()
    assert len(status["replicas"]) == 2


def test_prefix_affinity_after_stats_refresh(server):
    c = _client(server)
    a, b = _prompt(10, 400), _prompt(11, 400)
    home = {}
    for p in (a, b):
        home[p] = c.completions.create(model="kda-tiny", prompt=p, max_tokens=1, temperature=0).system_fingerprint
    time.sleep(1.5)  # digests now show both prefixes
    for i in range(6):
        p = (a, b)[i % 2]
        r = c.completions.create(model="kda-tiny", prompt=p + f"\nextra_{i} = {i}", max_tokens=1, temperature=0)
        assert r.system_fingerprint == home[p], i
        assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_skewed_workload_stays_balanced(server):
    c = _client(server)
    hot = _prompt(20, 300)
    counts: dict[str, int] = {}
    rng = random.Random(0)
    for i in range(40):
        p = hot + f"\nq_{i} = {i}" if rng.random() < 0.8 else _prompt(100 + i, 120)
        fp = c.completions.create(model="kda-tiny", prompt=p, max_tokens=1, temperature=0).system_fingerprint
        counts[fp] = counts.get(fp, 0) + 1
    assert len(counts) == 2 and max(counts.values()) <= 1.5 * min(counts.values()), counts


def test_controller_moves_off_dense_under_pressure(cluster, server):
    serve.delete("dasc")
    _kill_controller()
    app = build_app({
        "model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5,
        "engine": {"checkpoint_budget_mb": 0.6},  # 3 dense kda-tiny checkpoints
        "controller": {"enabled": True, "window_s": 1.0, "trial_windows": 1, "min_requests": 2, "max_w_nr": 64},
    })
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    c = OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = [_prompt(200 + i, 240) for i in range(8)]  # working set: 8 prefixes > 3 dense slots
    deadline = time.time() + 90
    moved, state = False, None
    while time.time() < deadline and not moved:
        for p in prompts:
            c.completions.create(model="kda-tiny", prompt=p, max_tokens=1, temperature=0)
        try:  # the replica creates the controller with its first telemetry window
            state = ray.get(controller_mod.lookup().state.remote())
        except ValueError:
            continue
        moved = state["current_label"] != "dense"
    assert moved, state
    promoted = [d for d in state["decisions"] if d["decision"] == "promote"]
    assert state["window"] <= 60 and promoted
    assert promoted[0]["trial_ttft"] < promoted[0]["control_ttft"]  # promoted because TTFT improved, live
