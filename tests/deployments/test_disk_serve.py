"""The disk tier behind real Ray Serve on loopback: every replica of the app is stopped (`serve.delete`: each drains
and persists what its pools hold) and the app deployed again on the same directory; the official client then gets
every prompt back from disk, on whichever replica serves it, with the answer it got before the restart. The
replicas read the deployment secret from the environment they inherit (`DASC_DISK_SECRET`; in production, the
application's `runtime_env`). Before any request, the restarted replicas publish the entries on disk as marks in
their routing stats (issue 40's tier marks)."""

from __future__ import annotations

import os

import pytest
from ray import serve

from app.engine.engine import DISK_SECRET_ENV
from tests.deployments.test_serve import (  # noqa: F401 - `cluster` is a fixture used here
    _client,
    _prompt,
    _replicas,
    _wait_for,
    cluster,
    served,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def disk_cluster(request, tmp_path_factory):
    """A cluster whose processes inherit the deployment secret (set before it starts, removed after)."""
    before = os.environ.get(DISK_SECRET_ENV)
    os.environ[DISK_SECRET_ENV] = "serve-test-secret"
    try:
        yield request.getfixturevalue("cluster"), tmp_path_factory.mktemp("disk-tier")
    finally:
        if before is None:
            os.environ.pop(DISK_SECRET_ENV, None)
        else:
            os.environ[DISK_SECRET_ENV] = before


def _args(root) -> dict:
    return {"model": "kda-tiny", "replicas": 2, "replica_cpus": 0.5,
            "engine": {"checkpoint_budget_mb": 8, "disk_dir": str(root), "compile_decode": False,
                       "compile_prefill": False},
            "controller": {"enabled": False, "window_s": 0.5}, "api": {"api_key": "test-key"}}


def test_a_full_restart_resumes_every_prefix_from_disk_with_the_same_answers(disk_cluster):
    url, root = disk_cluster
    prompts = [_prompt(900 + i) for i in range(4)]
    c = _client(url)
    with served(url, _args(root)):  # leaving it: every replica stops gracefully, drains, then persists
        before = [c.completions.create(model="kda-tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts]
        assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in before)
    assert list(root.rglob("*.ckpt")), "the stopped replicas wrote their checkpoints"
    with served(url, _args(root)):
        # tier marks in digests (issue 40): the replicas index the directory from the files' headers and publish
        # every entry to the router before any request reads one
        handle = serve.get_deployment_handle("EngineReplica", "dasc")

        def published() -> list | None:
            marks = handle.record_routing_stats.remote().result().get("disk_marks") or []
            return marks if len(marks) >= len(prompts) else None

        assert all(nbytes > 0 for *_, nbytes in _wait_for(published, "the replicas publish their disk entries"))
        after = [c.completions.create(model="kda-tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts]
        assert [r.choices[0].text for r in after] == [r.choices[0].text for r in before]
        for r in after:
            assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 64, r.usage
        def hits() -> int:
            return sum((s.get("disk_tier") or {}).get("hits", 0) for s in _replicas(url).values())

        _wait_for(lambda: hits() >= len(prompts) or None, "the replicas report a disk hit per prompt")
