"""Integration: configs/tp2.yaml on a real local Ray Serve (loopback): two replicas, each a TP=2 engine over gloo
(the replica's process is rank 0 and starts rank 1 beside it). The official openai client gets the same greedy
answer as an in-process TP=1 engine; then one replica's rank 1 is killed: that replica fails at its next engine
call and its health check (no hang on a collective), the ingress retries the request on the other replica, and
Serve replaces the broken one, after which the service serves from two replicas again.

Waits poll an observable condition until a generous deadline; nothing is timed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import yaml
from ray import serve

from app.engine.config import EngineConfig
from app.engine.request import SamplingParams
from app.engine.tp import build_engine
from deployments.builder import build_app
from tests.deployments.test_serve import (  # noqa: F401 - `cluster` is a fixture used here
    KEY,
    _client,
    _get,
    _kill_controller,
    _wait_for,
    _wait_ready,
    cluster,
)

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).parents[2] / "configs" / "tp2.yaml"
PROMPT = "def fibonacci(n):\n    "


def _args() -> dict:
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    args["engine"]["checkpoint_budget_mb"] = 4  # four kda-tiny ranks on a 2-core machine: keep them small
    args["engine"]["kv_slots"] = 16384
    args["controller"] = {**args["controller"], "enabled": False}
    args["api"] = {**args["api"], "api_key": KEY}
    args.update(health_check_period_s=1.0, health_check_timeout_s=10.0)
    return args


@pytest.fixture(scope="module")
def app(cluster):  # noqa: F811 - the imported fixture
    serve.run(build_app(_args()), name="dasc", route_prefix="/")
    _wait_ready(cluster)
    yield cluster
    serve.delete("dasc")
    _kill_controller()


def _replica_processes() -> dict[int, list[int]]:
    """{rank-0 pid: [pids of its rank processes]} of the engine replicas of this machine."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "EngineReplica" in cmd and "ServeReplica" in cmd:
            try:
                out[p.pid] = [c.pid for c in p.children() if "spawn" in " ".join(c.cmdline())]
            except psutil.NoSuchProcess:
                pass
    return out


def _greedy(url: str) -> str:
    out = _client(url).completions.create(model="kda-tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    return out.choices[0].text


def test_tp2_serves_like_tp1_and_survives_a_killed_rank(app):
    engine = build_engine("kda-tiny", EngineConfig(kv_slots=4096, checkpoint_budget_mb=4))
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0][0].text
    assert _greedy(app) == want

    procs = _wait_for(lambda: (p := _replica_processes()) and len(p) == 2 and all(p.values()) and p,
                      "two replicas, each with its rank-1 process")
    victim, ranks = next(iter(procs.items()))
    os.kill(ranks[0], signal.SIGKILL)
    # requests keep being answered: the broken replica fails before any token and the ingress retries elsewhere
    for _ in range(4):
        assert _greedy(app) == want
    _wait_for(lambda: victim not in _replica_processes(), "Serve stops the replica whose rank died")
    _wait_for(lambda: len(p := _replica_processes()) == 2 and all(p.values()), "Serve starts a replacement")
    _wait_ready(app)
    assert _get(f"{app}/health").status_code == 200
    assert _greedy(app) == want
