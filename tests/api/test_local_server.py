"""`python -m app.api.local` as a user runs it, in a process of its own on loopback: started and stopped three times
it leaves the temporary directory as it found it; with a disk tier, a SIGINT persists what it holds, so a restart
on the same directory resumes the prompts served before; after a SIGKILL (nothing persisted) the checkpoints that
had been reused once resume, written behind while serving."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest
from openai import OpenAI

from loadtest.local_server import local_server

pytestmark = pytest.mark.slow
START_S = 120  # a generous bound on a start (a warm or eager one takes seconds), not a timing check


def _prompt(i: int) -> str:
    rng = random.Random(i)
    return "\n".join(f"entry_{i}_{j} = {rng.randint(0, 99999)}" for j in range(50))


def _cached(url: str, prompt: str) -> tuple[int, int]:
    r = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120).completions.create(
        model="kda-tiny", prompt=prompt, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def _status(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=30).json()["replicas"]["local"]


def test_three_starts_and_stops_leave_the_temporary_directory_as_it_was(compiled_kda, tmp_path):
    """Warm starts on the session's package cache (tests/conftest.py): each loads both packages (extracting each
    into a scratch directory of the cache, removed at once) and answers."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    root = compiled_kda[0]
    engine = {"max_running": 1, "chunk_size": 16, "compile_cache_dir": str(root)}
    for _ in range(3):
        with local_server(engine, tmp) as url:
            assert _cached(url, "def add(a, b):")[1] > 0
            compile = _status(url)["compile"]
            assert compile["state"] == "ready" and compile["in_force"] == 2
    assert sorted(os.listdir(tmp)) == []
    assert not list(root.glob(".load-*")) and not list(root.glob(".work-*"))


DISK = {"compile_decode": False, "compile_prefill": False, "checkpoint_budget_mb": 0.4, "host_mb": 64}


def test_a_sigint_persists_the_pools_and_the_host_tier_for_the_next_start(tmp_path):
    """The issue's probe: a 0.4 MB pool, a 64 MB host tier and a disk directory; 24 prompts served, SIGINT (which
    stopped cleanly and wrote nothing before), a restart on the directory: at least 90% of them resume."""
    engine = {**DISK, "disk_dir": str(tmp_path / "tier")}
    prompts = [_prompt(i) for i in range(24)]
    with local_server(engine, tmp_path) as url:
        assert all(_cached(url, p)[0] == 0 for p in prompts)
    with local_server(engine, tmp_path) as url:
        resumed = [c >= n - 64 for c, n in (_cached(url, p) for p in prompts)]
        assert _status(url)["disk_tier"]["hits"] >= sum(resumed) > 0
    assert sum(resumed) >= 0.9 * len(prompts), resumed


def test_after_a_sigkill_the_checkpoints_reused_once_resume(tmp_path):
    """A pool that evicts nothing and no host tier: only reuses write behind. Each of 8 prompts is asked twice; once
    the write-behind has drained, SIGKILL: every reused prompt resumes on the restart; prompts asked once do not
    (nothing wrote them: what a crash still loses)."""
    engine = {**DISK, "checkpoint_budget_mb": 16, "host_mb": 0, "disk_dir": str(tmp_path / "tier")}
    reused, once = [_prompt(100 + i) for i in range(8)], [_prompt(200 + i) for i in range(4)]
    with local_server(engine, tmp_path, stop=signal.SIGKILL) as url:
        for p in reused + reused + once:
            _cached(url, p)
        end = time.monotonic() + START_S
        while (disk := _status(url)["disk_tier"])["writes"] < len(reused) or disk["queued"]:
            assert time.monotonic() < end, disk
            time.sleep(0.2)
    with local_server(engine, tmp_path) as url:
        assert all(c >= n - 64 for c, n in (_cached(url, p) for p in reused))
        assert all(c == 0 for c, _ in (_cached(url, p) for p in once))
