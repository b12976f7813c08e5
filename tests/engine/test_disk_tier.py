"""The disk tier under the host tier in a real engine (kda-tiny): entries the host tier evicts (with the host tier
off, those the pools evict) are written behind, and a new engine on the same directory and secret (a restart)
resumes from them with the cold answer; another salt never does; a torn, corrupted, unauthenticated, foreign or
mismatched file is ignored and the answer is cold; a full or unwritable directory leaves the answers as they are
without a disk tier; the engine refuses a disk tier without its secret. Behind an AsyncEngine, a request's disk entry
is read ahead of it, off the step thread."""

from __future__ import annotations

import asyncio
import errno
import shutil
import threading

import pytest

from app.cache import disk_tier
from app.cache.disk_format import read_entry, salt_key, write_entry
from app.cache.disk_tier import DiskTier
from app.engine.async_engine import AsyncEngine
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
    assert_restart_resumes(zoo, tmp_path, _prompts(zoo[1], 4))


def assert_restart_resumes(zoo, tmp_path, prompts: list[list[int]], **knobs) -> None:
    """Prompts served by one engine (one checkpoint slot, a small host tier: the rest goes to disk) resume in a
    restarted engine on the same directory and secret with the cold answer, and only under their own salt."""
    first = _engine(zoo, tmp_path, **knobs)
    cold = [_ask(first, p, "tenant-a") for p in prompts]
    first.cache.disk.flush()
    assert first.snapshot()["disk_tier"]["writes"] >= 1
    again = _engine(zoo, tmp_path, **knobs)  # a restart: empty pools and host tier, the same directory and secret
    assert _ask(again, prompts[0], "tenant-b").cached_tokens == 0  # another salt finds nothing
    warm = _ask(again, prompts[0], "tenant-a")
    assert warm.cached_tokens == len(prompts[0]) - 1 and warm.output_ids == cold[0].output_ids
    assert again.snapshot()["disk_tier"]["hits"] == 1
    again.check_integrity()


def _torn(path, secret, engine):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupted(path, secret, engine):
    path.write_bytes(b"NOTMAGIC" + path.read_bytes()[8:])


def _unauthenticated(path, secret, engine):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewritten(**changes):
    """A file rewritten, authenticated under the secret, with its header changed (another model's, another
    salt's or other tokens' entry where this one's name leads)."""
    def damage(path, secret, engine):
        disk = engine.cache.disk
        header, tensors = read_entry(path, secret, disk.model_fp, disk.codec_fp, salt_key(secret, None))
        write_entry(path, secret, {**header, **{k: v(header) for k, v in changes.items()}}, tensors)
    return damage


DAMAGES = {"torn": _torn, "corrupted": _corrupted, "unauthenticated": _unauthenticated,
           "foreign": _rewritten(model=lambda h: "another model"),
           "mismatched": _rewritten(salt=lambda h: salt_key(b"test-deployment-secret", "another tenant")),
           "mismatched tokens": _rewritten(tokens=lambda h: [t + 1 for t in h["tokens"]])}


@pytest.fixture(scope="module")
def persisted(zoo, tmp_path_factory):
    """A directory a stopped engine persisted two prompts' checkpoints into, and their cold answers (written once;
    each damage case works on a copy)."""
    root = tmp_path_factory.mktemp("persisted") / "tier"
    prompts = _prompts(zoo[1], 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DISK_SECRET_ENV, "test-deployment-secret")
        first = _engine(zoo, root)
        cold = [_ask(first, p) for p in prompts]
        assert first.persist() >= 2
        first.cache.disk.close()
    return root, prompts, cold


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_ignored_and_the_answer_is_cold(zoo, tmp_path, secret, persisted, damage):
    root, prompts, cold = persisted
    shutil.copytree(root, tmp_path / "tier")
    again = _engine(zoo, tmp_path / "tier")
    for path in (tmp_path / "tier").rglob("*.ckpt"):
        DAMAGES[damage](path, b"test-deployment-secret", again)
    out = [_ask(again, p) for p in prompts]
    assert [o.output_ids for o in out] == [c.output_ids for c in cold]
    assert all(o.cached_tokens == 0 for o in out)
    assert again.snapshot()["disk_tier"]["rejected"].get(damage.split()[0], 0) >= 1
    again.check_integrity()


def test_with_the_host_tier_off_the_pools_evictions_are_written_behind(zoo, tmp_path, secret):
    """host_mb 0: entries the pools evict pass through a small staging area to disk; after a restart they resume."""
    prompts = _prompts(zoo[1], 4)
    first = _engine(zoo, tmp_path, host_mb=0.0)
    cold = [_ask(first, p) for p in prompts]
    first.cache.disk.flush()
    assert first.snapshot()["disk_tier"]["writes"] >= 1
    again = _engine(zoo, tmp_path, host_mb=0.0)
    warm = _ask(again, prompts[0])
    assert warm.cached_tokens == len(prompts[0]) - 1 and warm.output_ids == cold[0].output_ids
    again.check_integrity()


def _full_disk(monkeypatch, tmp_path):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_tier, "write_entry", no_space)


def _unwritable(monkeypatch, tmp_path):
    shutil.rmtree(tmp_path, ignore_errors=True)
    tmp_path.write_text("a file where the directory was")  # every mkdir under it fails


@pytest.mark.parametrize("fault", [_full_disk, _unwritable], ids=["full", "unwritable"])
def test_a_full_or_unwritable_directory_leaves_requests_unaffected(zoo, tmp_path, secret, monkeypatch, fault):
    """The fault strikes while serving: every write is skipped and counted, and the answers (and what was cached)
    are those of the same engine without a disk tier."""
    prompts = _prompts(zoo[1], 4)
    plain = _engine(zoo, tmp_path, disk_dir=None)
    want = [(o.output_ids, o.cached_tokens) for o in (_ask(plain, p) for p in prompts + prompts)]
    root = tmp_path / "tier"
    engine = _engine(zoo, root)
    got = [_ask(engine, p) for p in prompts[:1]]
    fault(monkeypatch, root)
    got += [_ask(engine, p) for p in prompts[1:] + prompts]
    engine.persist(timeout_s=5.0)
    assert [(o.output_ids, o.cached_tokens) for o in got] == want
    disk = engine.snapshot()["disk_tier"]
    assert disk["writes"] == 0 and sum(disk["skipped_writes"].values()) >= 2
    engine.check_integrity()


def test_the_disk_tier_needs_its_secret(zoo, tmp_path, monkeypatch):
    monkeypatch.delenv(DISK_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=DISK_SECRET_ENV):
        _engine(zoo, tmp_path)


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


async def _answer(engine: AsyncEngine, prompt: list[int], params: SamplingParams):
    outs = [o async for o in engine.generate(prompt, params)]
    return outs[0].cached_tokens, [t for o in outs for t in o.new_token_ids]


def test_a_disk_entry_is_read_before_the_step_thread_sees_the_request(zoo, tmp_path, secret, monkeypatch):
    prompts = _prompts(zoo[1], 2)
    first = _engine(zoo, tmp_path, host_mb=0.0)
    cold = [_ask(first, p) for p in prompts]
    first.persist()  # the first prompt's checkpoint was written behind already (one pool slot)
    assert first.cache.disk.counters.writes >= 2
    readers = []
    find = DiskTier.find

    def watched(self, *args, **kwargs):
        found = find(self, *args, **kwargs)
        if found is not None:
            readers.append(threading.current_thread().name)
        return found

    monkeypatch.setattr(DiskTier, "find", watched)
    engine = AsyncEngine(_engine(zoo, tmp_path, host_mb=0.0))
    try:
        for prompt, want in zip(prompts, cold):
            cached, ids = asyncio.run(_answer(engine, prompt, GREEDY))
            assert ids == want.output_ids and cached >= len(prompt) - 64
        assert len(readers) == len(prompts) and "engine-loop" not in readers  # read ahead, never by a step
        assert engine.engine.cache.disk.counters.hits == len(prompts)
        engine.call(lambda e: e.check_integrity())
    finally:
        engine.shutdown()


def test_a_request_refused_anyway_costs_no_disk_read(zoo, tmp_path, secret, monkeypatch):
    """Read-ahead comes after the engine's admission check: a request refused (here: the engine shut down; likewise
    overloaded or draining) never reaches the disk, so a flood of refused requests adds no disk I/O."""
    from app.engine.errors import EngineUnavailable

    calls = []
    find = DiskTier.find
    monkeypatch.setattr(DiskTier, "find", lambda self, *a, **k: calls.append(1) or find(self, *a, **k))
    engine = AsyncEngine(_engine(zoo, tmp_path, host_mb=0.0))
    first, second = _prompts(zoo[1], 2)
    asyncio.run(_answer(engine, first, GREEDY))
    assert calls, "an admitted request reads ahead"
    engine.shutdown()
    calls.clear()
    with pytest.raises(EngineUnavailable):
        asyncio.run(_answer(engine, second, GREEDY))  # a prompt the cache does not hold: it would read ahead
    assert calls == []


def test_a_checkpoint_reused_once_is_written_behind_so_a_crash_keeps_it(zoo, tmp_path, secret):
    """A pool with room for every prompt evicts nothing, so only a reuse writes: the first load of each prompt's
    checkpoint queues it (once: a third ask writes nothing more); a new engine on the directory, with no persist
    before it (a crash), resumes each from disk. With `disk_reuse_mb_s` 0 nothing is written."""
    prompts = _prompts(zoo[1], 3)
    off = _engine(zoo, tmp_path / "off", checkpoint_slots=8, host_mb=0.0, disk_reuse_mb_s=0.0)
    for p in prompts * 2:
        _ask(off, p)
    off.cache.disk.flush()
    assert off.cache.disk.counters.writes == 0 and off.cache.disk.counters.skipped_writes == {}
    first = _engine(zoo, tmp_path / "on", checkpoint_slots=8, host_mb=0.0)
    cold = [_ask(first, p) for p in prompts]
    first.cache.disk.flush()
    assert first.cache.disk.counters.writes == 0  # stored, never reused: nothing written yet
    for p in prompts * 2:
        _ask(first, p)
    first.cache.disk.flush()
    assert first.cache.disk.counters.writes == len(prompts)
    again = _engine(zoo, tmp_path / "on", checkpoint_slots=8, host_mb=0.0)
    warm = [_ask(again, p) for p in prompts]
    assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
    assert all(w.cached_tokens >= len(p) - 64 for w, p in zip(warm, prompts))
    again.cache.disk.flush()
    assert again.cache.disk.counters.writes == 0  # read from disk: not written back at its first reuse
    again.check_integrity()


def test_reused_checkpoints_are_written_within_their_byte_rate(zoo, tmp_path, secret):
    """A rate below one entry a second: the bucket holds one second's bytes, so the first reuse is written (a full
    bucket lets one entry through) and the next ones, at once after it, are skipped and counted."""
    prompts = _prompts(zoo[1], 3)
    engine = _engine(zoo, tmp_path, checkpoint_slots=8, host_mb=0.0, disk_reuse_mb_s=1e-6)
    for p in prompts * 2:
        _ask(engine, p)
    engine.cache.disk.flush()
    assert engine.cache.disk.counters.writes == 1
    assert engine.cache.disk.counters.skipped_writes == {"reuse_rate": len(prompts) - 1}
