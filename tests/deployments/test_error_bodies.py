"""What a client reads when a request fails behind real Ray Serve (loopback, one engine replica): every error path
answers OpenAI-style JSON (or an SSE error event) whose message is one line with no traceback, file path, pid,
actor or node id or IP address; 503s carry Retry-After. Ray hands the ingress a remote exception whose text is the
remote traceback (with the replica's pid, actor id, node IP and file paths): the API reads the reason from the
exception it wraps, and the whole detail goes to the server's log.

Paths driven, in order: a step that fails (generation failed; the reason given to `fail_next_step` itself holds a
path, an address and a pid), a request that waits past its queue deadline (queue_timeout), a replica killed
mid-stream (the stream's error event; and a request sent before Serve replaced it: an answer or a 503 with
Retry-After, never a reset connection), a replica whose engine cannot step (engine_unavailable, and /health)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import ray
from ray import serve

from tests.deployments.test_serve import (  # noqa: F401 - `cluster` is a fixture used here
    KEY,
    HeldStream,
    _get,
    _replicas,
    _wait_for,
    cluster,
    served,
)

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
# what no error body may hold
MARKERS = {
    "traceback": re.compile(r"Traceback|File \"|line \d+, in "),
    "path": re.compile(r"(?<![\w.])(?:/[\w.@+\-]+){2,}"),
    "ip": re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b"),
    "pid": re.compile(r"\bpid\s*[=:]?\s*\d+", re.IGNORECASE),
    "actor id": re.compile(r"\b[0-9a-f]{16,}\b|actor_id|ActorID", re.IGNORECASE),
}


@pytest.fixture(scope="module")
def app(cluster):  # noqa: F811 - the imported fixture
    with served(cluster, {
        "model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5,
        "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
        "engine": {"max_running": 1, "compile_decode": False, "compile_prefill": False},
        "router": {"stats_period_s": 0.5},
        "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": KEY, "max_tokens_limit": 2000, "queue_timeout_s": 3.0},
    }, replicas=1):
        yield cluster


def _assert_clean(body: dict) -> dict:
    """`body` is an OpenAI error object whose message is one line holding none of the markers; returns the error."""
    error = body["error"]
    message = error["message"]
    assert message and "\n" not in message, body
    for name, pattern in MARKERS.items():
        assert not pattern.search(json.dumps(body)), f"the error body holds a {name}: {body}"
    return error


def _complete(url: str, prompt: str = "def add(a, b):", stream: bool = False) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "kda-tiny", "prompt": prompt, "max_tokens": 4,
                                                     "stream": stream}, headers=AUTH, timeout=120)


def test_a_failed_step_is_a_503_whose_message_names_the_failure_not_its_traceback(app):
    handle = serve.get_deployment_handle("EngineReplica", "dasc")
    handle.fail_next_step.remote("CUDA error at /opt/secret/kernels/attn.cu:88 on 10.3.4.5 (pid=4242)").result()
    r = _complete(app)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    error = _assert_clean(r.json())
    assert error["type"] == "server_error" and error["message"].startswith("generation failed: RuntimeError")
    assert _complete(app).status_code == 200  # the engine serves on


def test_a_request_past_its_queue_deadline_is_a_503_queue_timeout(app):
    stream = HeldStream(app, "hold the only slot", max_tokens=2000)  # max_running 1: the next request waits
    try:
        _wait_for(stream.started.is_set, "the stream streams")
        r = _complete(app, "wait behind it")
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert _assert_clean(r.json())["code"] == "queue_timeout"
    finally:
        stream.close()


def test_a_stream_cut_by_a_dead_replica_ends_with_a_clean_error_event(app):
    stream = HeldStream(app, "a stream to cut", max_tokens=2000)
    try:
        _wait_for(stream.started.is_set, "the stream streams")
        victim = next(iter(_replicas(app)))
        ray.kill(ray.get_actor(f"SERVE_REPLICA::dasc#EngineReplica#{victim}", namespace="serve"), no_restart=True)
        _wait_for(stream.finished.is_set, "the stream ends")
    finally:
        stream.close()
    assert stream.events[-1] == "[DONE]"
    _assert_clean(json.loads(stream.events[-2]))
    # while no replica can serve (the dead one not replaced yet): an answer, or a 503 with Retry-After, never a
    # connection reset (httpx would raise)
    r = _complete(app, "while it is replaced")
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert r.headers["retry-after"] and _assert_clean(r.json())["code"] in ("queue_timeout", "engine_unavailable")
    _wait_for(lambda: _get(f"{app}/health").status_code == 200 and len(_replicas(app)) == 1 or None,
              "Serve replaces the replica")


def test_a_replica_that_cannot_step_is_a_503_engine_unavailable_and_health_says_so_cleanly(app):
    serve.get_deployment_handle("EngineReplica", "dasc").stop_engine.remote().result()
    r = _complete(app)  # retried once, on the same replica (the only one): refused again
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert _assert_clean(r.json())["code"] == "engine_unavailable"
    health = _wait_for(lambda: (h := _get(f"{app}/health")).status_code == 503 and h or None, "/health says 503", 120)
    assert health.headers["retry-after"]
    _assert_clean(health.json())
    _wait_for(lambda: _get(f"{app}/health").status_code == 200 or None, "Serve replaces the replica")
