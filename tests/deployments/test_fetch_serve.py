"""Peer fetches behind real Ray Serve on loopback (issue 40): one replica holds a long prefix; a burst of requests
sharing it, each with its own long question, queues there, so the router has the other replica pull the prefix's
checkpoint from the holder (through Ray's object store) instead of recomputing it. Requests answered there report
the prefix as cached although that replica never computed it; /status shows the fetches. Then the holder is killed
while a burst runs: fetches from it fail over to recomputing and no request is lost."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.deployments.test_serve import (  # noqa: F401 - `cluster` is a fixture used here
    _client,
    _replicas,
    _wait_digests,
    _wait_for,
    cluster,
    served,
)

pytestmark = pytest.mark.slow
PREFIX = "\n".join(f"shared_{i} = {random.Random(i).randint(0, 99999)}" for i in range(220))


def _question(k: int) -> str:
    rng = random.Random(1000 + k)
    return PREFIX + "\n" + "\n".join(f"ask_{k}_{i} = {rng.randint(0, 999)}" for i in range(50))


@pytest.fixture(scope="module")
def app(cluster):  # noqa: F811 - the imported fixture
    with served(cluster, {
        "model": "kda-tiny", "replicas": 2, "replica_cpus": 0.5,
        "engine": {"checkpoint_budget_mb": 8, "peer_fetch": True, "compile_decode": False, "compile_prefill": False},
        "router": {"stats_period_s": 0.5, "fetch_fixed_s": 0.0},
        "controller": {"enabled": False, "window_s": 0.5},
        "api": {"api_key": "test-key", "max_prompt_tokens": 4096, "queue_timeout_s": 900.0},  # bursts: never 503
    }):
        yield cluster


def _burst(url: str, ks: list[int]) -> list:
    c = _client(url)
    with ThreadPoolExecutor(len(ks)) as pool:
        return list(pool.map(lambda k: c.completions.create(model="kda-tiny", prompt=_question(k), max_tokens=2,
                                                            temperature=0), ks))


def _fetches(url: str) -> int:
    return sum((s.get("peer_fetch") or {}).get("fetches", 0) for s in _replicas(url).values())


def test_a_busy_holders_prefix_is_fetched_by_the_idle_replica(app):
    c = _client(app)
    warm = c.completions.create(model="kda-tiny", prompt=PREFIX, max_tokens=1, temperature=0)
    holder = warm.system_fingerprint
    prefix_tokens = warm.usage.prompt_tokens
    for _ in range(2):  # two telemetry windows after it, each on the routing stats' period: those publish its mark
        _wait_digests(app, {holder.removeprefix("dasc-")}, since=time.time())
    answers = _burst(app, list(range(12)))
    elsewhere = [r for r in answers if r.system_fingerprint != holder]
    assert elsewhere, "the burst stayed on the holder"
    fetched = [r for r in elsewhere if r.usage.prompt_tokens_details.cached_tokens >= prefix_tokens - 64]
    assert fetched, [(r.system_fingerprint, r.usage.prompt_tokens_details.cached_tokens) for r in answers]
    assert _wait_for(lambda: _fetches(app) or None, "the fetches reported") >= 1


def _kill_replica(replica: str) -> None:
    """Kill the replica actor named `replica` (its unique id ends the actor's name) a moment into the burst."""
    from ray._private.state import actors

    time.sleep(0.3)
    for a in actors(actor_state_name="ALIVE").values():
        if a["ActorClassName"].endswith("EngineReplica") and a["Name"].endswith(replica):
            ray.kill(ray.get_actor(a["Name"], namespace="serve"), no_restart=True)
            return


def test_a_pinned_request_with_a_fetch_resumes_on_the_other_replica_from_the_holders_checkpoint(app):
    """Through a handle (as the benchmark does): a request pinned (`route_to`) to the replica that never saw the
    prompt, told to fetch from the one that did, resumes from the fetched checkpoint with the holder's answer."""
    from ray import serve

    from app.engine.request import SamplingParams
    from app.models.loader import resolve_model_dir
    from app.models.tokenizer import Tokenizer
    from deployments.messages import FetchStatusRequest, GenerateRequest

    handle = serve.get_deployment_handle("EngineReplica", "dasc").options(stream=True)
    holder, fetcher = sorted(_replicas(app))
    text = "\n".join(f"pinned_{i} = {random.Random(7 + i).randint(0, 99999)}" for i in range(200))
    prompt = Tokenizer.from_dir(resolve_model_dir("kda-tiny")).encode(text)  # shares nothing with PREFIX
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def ask(replica: str, fetch: str | None = None) -> dict:
        outs = list(handle.generate.remote(GenerateRequest(prompt, params, route_to=replica,
                                                           fetch={replica: (fetch, 0)} if fetch else None)))
        assert {o["replica"] for o in outs} == {replica}
        return {"cached": outs[0]["cached_tokens"], "ids": [t for o in outs for t in o["new_token_ids"]]}

    def status() -> dict:
        out = serve.get_deployment_handle("EngineReplica", "dasc").peer_fetch_status.remote(
            FetchStatusRequest(route_to=fetcher)).result(timeout_s=10)
        assert out["replica"] == fetcher and out["in_flight"] == 0
        assert 2**20 < out["max_bytes"] < 2**40  # a share of its node's object store (Ray's default: 30% of RAM)
        return out

    before = status()["fetches"]
    cold = ask(holder)
    assert cold["cached"] == 0
    fetched = ask(fetcher, fetch=holder)
    assert fetched["cached"] >= len(prompt) - 64 and fetched["ids"] == cold["ids"]
    assert status()["fetches"] == before + 1  # the live counters, from the replica it names


def test_a_holder_killed_during_a_burst_loses_no_request(app):
    c = _client(app)
    holder = c.completions.create(model="kda-tiny", prompt=PREFIX + "\nagain", max_tokens=1,
                                  temperature=0).system_fingerprint.removeprefix("dasc-")
    with ThreadPoolExecutor(1) as killer:
        pending = killer.submit(lambda: _kill_replica(holder))
        answers = _burst(app, list(range(100, 112)))
        pending.result()
    assert len(answers) == 12 and all(r.choices[0].text is not None for r in answers)
