"""The disk tier under the host tier in a real engine (kda-tiny): entries the host tier evicts are written behind,
and a new engine on the same directory and secret (a restart) resumes from them with the cold answer; another salt
never does; a damaged file is ignored; the engine refuses a disk tier without its secret or a host tier."""

from __future__ import annotations

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import DISK_SECRET_ENV, Engine
from app.engine.request import SamplingParams
from tests.engine.test_host_tier import _prompts
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(DISK_SECRET_ENV, "test-deployment-secret")


def _engine(zoo, root, **knobs) -> Engine:
    model, tok = zoo
    knobs = {"compile_decode": False, "compile_prefill": False, "checkpoint_slots": 1, "host_mb": 0.6,
             "disk_dir": str(root), **knobs}
    return Engine(model, tok, EngineConfig(**knobs))


def _ask(engine: Engine, prompt: list[int], salt: str | None = None):
    params = GREEDY if salt is None else SamplingParams(**{**GREEDY.__dict__, "cache_salt": salt})
    return engine.generate([prompt], params)[0][0]


def test_a_restarted_engine_resumes_from_the_disk_tier_as_cold(zoo, tmp_path, secret):
    prompts = _prompts(zoo[1], 4)
    first = _engine(zoo, tmp_path)
    cold = [_ask(first, p, "tenant-a") for p in prompts]
    first.cache.disk.flush()
    assert first.snapshot()["disk_tier"]["writes"] >= 1
    again = _engine(zoo, tmp_path)  # a restart: empty pools and host tier, the same directory and secret
    assert _ask(again, prompts[0], "tenant-b").cached_tokens == 0  # another salt finds nothing
    warm = _ask(again, prompts[0], "tenant-a")
    assert warm.cached_tokens == len(prompts[0]) - 1 and warm.output_ids == cold[0].output_ids
    assert again.snapshot()["disk_tier"]["hits"] == 1
    again.check_integrity()


def test_a_damaged_file_is_ignored_and_the_answer_is_cold(zoo, tmp_path, secret):
    prompts = _prompts(zoo[1], 4)
    first = _engine(zoo, tmp_path)
    cold = [_ask(first, p) for p in prompts]
    first.cache.disk.flush()
    for path in tmp_path.rglob("*.ckpt"):
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    again = _engine(zoo, tmp_path)
    out = _ask(again, prompts[0])
    assert out.cached_tokens == 0 and out.output_ids == cold[0].output_ids
    assert again.snapshot()["disk_tier"]["rejected"].get("unauthenticated", 0) >= 1


def test_the_disk_tier_needs_its_secret_and_a_host_tier(zoo, tmp_path, monkeypatch):
    monkeypatch.delenv(DISK_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=DISK_SECRET_ENV):
        _engine(zoo, tmp_path)
    monkeypatch.setenv(DISK_SECRET_ENV, "s")
    with pytest.raises(ValueError, match="host tier"):
        _engine(zoo, tmp_path, **{"host_mb": 0.0})


def test_a_graceful_stop_persists_the_pools_and_the_host_tier_for_the_next_start(zoo, tmp_path, secret):
    """Without `persist` only what the host tier evicted survives a restart; with it (the replica calls it after
    draining) every prompt resumes after the restart, with its cold answer."""
    prompts = _prompts(zoo[1], 4)
    first = _engine(zoo, tmp_path)
    cold = [_ask(first, p) for p in prompts]
    assert first.persist() >= 2
    again = _engine(zoo, tmp_path)
    warm = [_ask(again, p) for p in prompts]
    assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
    assert all(w.cached_tokens == len(p) - 1 for w, p in zip(warm, prompts))
    again.check_integrity()
