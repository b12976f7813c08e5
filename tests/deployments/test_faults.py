"""Faults under a running app on a real local Ray Serve (loopback): the tuning controller killed, a replica whose
engine cannot step, a replica killed mid-stream, a Responses continuation whose replica or ingress was killed. Each
scenario checks what a client and an operator see (/metrics, /status, /health, the answers) and that the service
comes back by itself.

One deployment serves the module (two replicas of kda-tiny, telemetry every 0.5 s, Serve's health check every
second), then a smaller one the admission test. Waits poll an observable condition until a generous deadline;
nothing is timed.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx
import openai
import pytest
import ray
from ray import serve

from app.api.response_store import key_digest
from deployments import controller as controller_mod
from deployments import response_store
from deployments.builder import build_app
from tests.deployments.test_serve import (  # noqa: F401 - `cluster` is a fixture used here
    HeldStream,
    _client,
    _get,
    _kill_controller,
    _prompt,
    _replicas,
    _wait_for,
    _wait_ready,
    cluster,
    served,
)

pytestmark = pytest.mark.slow
PINNED = {"w_max": 64, "policy": "nr", "interval": 0, "lookback": 64}


@pytest.fixture(scope="module")
def app(cluster):  # noqa: F811 - the imported fixture
    with served(cluster, {
        "model": "kda-tiny", "replicas": 2, "replica_cpus": 0.5,
        "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
        "engine": {"checkpoint_budget_mb": 8},
        "router": {"stats_period_s": 0.5},
        "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": "test-key", "max_tokens_limit": 2000},
    }):
        yield cluster


def _reported_after(url: str, since: float, n: int = 2) -> dict:
    """/status's replicas once `n` of them reported telemetry taken after `since` (same machine's clock)."""
    def fresh():
        replicas = _replicas(url)
        return replicas if sum(s["reported_at"] > since for s in replicas.values()) >= n else None

    return _wait_for(fresh, f"{n} replicas report")


def _now(url: str) -> float:
    return max(s["reported_at"] for s in _replicas(url).values())


def test_a_recreated_controller_adopts_the_running_setting(app):
    """Defect 4: after the controller actor dies, /metrics and /status answer again (the ingress re-resolves and
    recreates it), and the new controller adopts the setting the replicas run instead of resetting them to the
    config's (which would drop every checkpoint)."""
    ray.get(controller_mod.lookup().pin.remote(PINNED))
    _wait_for(lambda: all(s["setting"] == PINNED for s in _replicas(app).values()), "replicas run the pinned setting")
    c = _client(app)
    for i in range(6):
        c.completions.create(model="kda-tiny", prompt=_prompt(300 + i), max_tokens=2, temperature=0)
    before = _reported_after(app, _now(app))
    assert sum(s["checkpoint_slots_used"] for s in before.values()) > 0

    ray.kill(controller_mod.lookup(), no_restart=True)
    # one telemetry window is 0.5 s here; 60 s is generous
    _wait_for(lambda: _get(f"{app}/metrics").status_code == 200, "/metrics answers after the controller died", 60)
    assert _get(f"{app}/status").status_code == 200
    _reported_after(app, 0.0)  # the new controller heard from both replicas
    after = _reported_after(app, _now(app))  # and they have since applied its assignment and reported again
    state = _get(f"{app}/status").json()
    assert state["adopted"] == PINNED and state["current"] == PINNED
    for replica, snap in after.items():
        assert snap["setting"] == PINNED, replica
        assert snap["checkpoint_slots_used"] >= before[replica]["checkpoint_slots_used"], replica  # not flushed
        assert snap["checkpoint_stores"] >= before[replica]["checkpoint_stores"], replica


def test_a_replica_that_cannot_step_is_retried_reported_and_replaced(app):
    """Health and retries: a replica whose engine stopped fails Serve's health check and is replaced; /health
    says 503 until then and 200 after; requests that reach it fail before their first token and are retried on
    the other replica, so every client gets its answer."""
    assert _get(f"{app}/health").status_code == 200
    stopped = serve.get_deployment_handle("EngineReplica", "dasc").stop_engine.remote().result()
    c = _client(app)

    def ask(i: int) -> str:
        out = c.completions.create(model="kda-tiny", prompt=f"retry {i}", max_tokens=2, temperature=0)
        return out.system_fingerprint

    def retried() -> int:
        text = _get(f"{app}/metrics").text
        return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dasc_retries_total"))))

    with ThreadPoolExecutor(8) as pool:
        for batch in range(5):  # the stopped replica has the shortest queue: the router soon sends it some
            served = list(pool.map(ask, range(8 * batch, 8 * batch + 8)))
            assert f"dasc-{stopped}" not in served
            if retried():
                break
    assert retried() > 0
    _wait_for(lambda: _get(f"{app}/health").status_code == 503, "/health reports the replica that cannot step", 120)
    _wait_for(lambda: _get(f"{app}/health").status_code == 200, "/health recovers once Serve replaced it")
    _wait_for(lambda: stopped not in _replicas(app) and len(_replicas(app)) == 2, "the replacement reports")
    assert ask(99).startswith("dasc-")


def test_a_killed_replica_ends_its_stream_cleanly_and_leaves_the_metrics(app):
    """Defect 6 and streams cut by a replica death: the stream in flight on a killed replica ends with an error
    event and [DONE]; the replica's gauges leave /metrics and /status while its counters stay at their last
    values (sums over replicas never drop); Serve replaces it."""
    stream = HeldStream(app, "a stream to cut: " + "xyz " * 20)
    _wait_for(stream.started.is_set, "the stream streams")
    busy = _wait_for(lambda: [r for r, s in _replicas(app).items() if s["running"] > 0], "its replica shows it")
    victim = busy[0]
    assert f'replica="{victim}"' in _get(f"{app}/metrics").text
    ray.kill(ray.get_actor(f"SERVE_REPLICA::dasc#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    _wait_for(stream.finished.is_set, "the stream ends")
    stream.close()
    assert stream.events[-1] == "[DONE]"
    assert "error" in json.loads(stream.events[-2]), stream.events[-2:]
    _wait_for(lambda: f'replica="{victim}"' not in _get(f"{app}/metrics").text, "the dead replica leaves /metrics",
              60)  # 3 windows of 0.5 s
    assert victim not in _replicas(app)
    page = _get(f"{app}/metrics").text
    assert f'dasc:prefix_cache_queries_total{{engine="{victim}"' in page
    assert f'dasc:num_requests_running{{engine="{victim}"' not in page
    _wait_for(lambda: len(_replicas(app)) == 2 and _get(f"{app}/health").status_code == 200, "Serve replaces it")


def test_a_request_not_streamed_survives_its_replica_dying_mid_generation(app):
    """Defect found by `make reliability`'s holder_kill: a request that is not streamed, whose replica died after
    its first token, got a 503 although its client had seen nothing; now the ingress holds its outputs until the
    end and retries it from the start on the other replica."""
    c = _client(app)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(c.completions.create, model="kda-tiny", prompt=_prompt(700 + i, 60), max_tokens=400,
                               temperature=0, extra_body={"ignore_eos": True}) for i in range(4)]
        victim = _wait_for(lambda: next((rid for rid, s in _replicas(app).items() if s.get("running")), None),
                           "a replica generating")
        ray.kill(ray.get_actor(f"SERVE_REPLICA::dasc#EngineReplica#{victim}", namespace="serve"), no_restart=True)
        answers = [f.result() for f in futures]
    assert all(a.usage.completion_tokens == 400 for a in answers)
    _wait_for(lambda: len(_replicas(app)) == 2 or None, "the replica replaced")


def test_a_continuation_outlives_its_replica_and_a_stored_response_its_ingress(app):
    """Issue 37: a continuation whose stored response's replica was killed is computed again from the stored ids on
    another replica (slower, never an error); stored responses live in a named actor, so an ingress replica's death
    loses none of them."""
    c, owner = _client(app), key_digest("test-key")
    r = c.responses.create(model="kda-tiny", input=_prompt(37, 200), max_output_tokens=8, temperature=0)
    store = response_store.lookup()  # started by the first Responses request
    victim = ray.get(store.get.remote(r.id, owner)).replica
    assert victim is not None
    ray.kill(ray.get_actor(f"SERVE_REPLICA::dasc#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    more = c.responses.create(model="kda-tiny", previous_response_id=r.id, input="and then?", max_output_tokens=4,
                              temperature=0)
    assert more.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens and more.output_text
    assert ray.get(store.get.remote(more.id, owner)).replica not in (None, victim)
    ingress = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"]]
    assert len(ingress) == 1
    ray.kill(ray.get_actor(ingress[0], namespace="serve"), no_restart=True)

    def retrieved():
        try:
            return c.responses.retrieve(more.id)
        except openai.APIError:  # the proxy has no ingress until Serve replaces it
            return None

    assert _wait_for(retrieved, "a new ingress serves the stored response").output_text == more.output_text
    _wait_for(lambda: len(_replicas(app)) == 2 and _get(f"{app}/health").status_code == 200, "Serve replaces both")


def test_a_client_leaving_a_multi_prompt_stream_stops_every_generation(app):
    """The prompts' handle calls have routing ids of their own (deployments/ingress.py, `_own_routing_id`), so
    Serve's cancellation of a parent request's calls no longer reaches them; the ingress stops each call its
    reader leaves. A client that disconnects from a 3-prompt stream leaves no sequence running."""
    def running() -> int:
        return sum(s["running"] for s in _replicas(app).values())

    stream = HeldStream(app, [f"leave {i}: " + "abc " * (i + 3) for i in range(3)])
    _wait_for(stream.started.is_set, "the stream streams")
    _wait_for(lambda: running() >= 3, "its 3 generations run")
    stream.close()
    _wait_for(lambda: running() == 0, "every generation stops", 60)


def test_a_full_engine_queue_is_refused_at_once(app):
    """Admission: past the engine replicas' `max_ongoing_requests` and the handle's `max_queued_requests`, Ray's
    BackPressureError reaches the API (counted as rejected; the API answers it 429) instead of the request
    waiting. Redeploys the app small: one replica running one request, one more queued."""
    serve.run(build_app({
        "model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5, "max_ongoing_requests": 1, "max_queued_requests": 1,
        "engine": {"max_running": 1}, "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": "test-key", "max_tokens_limit": 2000},
    }), name="dasc", route_prefix="/")
    _wait_ready(app)
    stream = HeldStream(app, "hold the only slot")
    try:
        _wait_for(stream.started.is_set, "the stream streams")
        with ThreadPoolExecutor(3) as pool:
            body = {"model": "kda-tiny", "prompt": "one too many", "max_tokens": 2}
            answers = [pool.submit(httpx.post, f"{app}/v1/completions", json=body, timeout=300,
                                   headers={"Authorization": "Bearer test-key"}) for _ in range(3)]
            refused = next(a.result() for a in as_completed(answers))  # one queues; the others are refused
            assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
            assert refused.json()["error"]["message"], refused.text
            assert 'dasc_requests_total{outcome="rejected",route="generate"}' in _get(f"{app}/metrics").text
            stream.close()  # frees the slot: the queued request is served
            assert sum(a.result().status_code == 200 for a in answers) >= 1
    finally:
        stream.close()


def test_shutdown_lets_a_stream_in_flight_finish(app):
    """Graceful shutdown: deleting the app while a stream runs lets it finish (Serve waits up to
    graceful_shutdown_timeout_s, then the replica drains its engine) instead of cutting it off."""
    serve.run(build_app({
        "model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5, "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": "test-key", "max_tokens_limit": 2000},
    }), name="dasc", route_prefix="/")
    _wait_ready(app)
    stream = HeldStream(app, "a stream that outlives its app", max_tokens=300)
    try:
        _wait_for(stream.started.is_set, "the stream streams")
        serve.delete("dasc", _blocking=False)
        _wait_for(stream.finished.is_set, "the stream ends")
        last = json.loads(next(e for e in reversed(stream.events) if e != "[DONE]"))
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", stream.events[-3:]
    finally:
        stream.close()
