"""A checkpoint moved between two engines (issue 40's fetch, without Ray): the holder exports the deepest checkpoint
a prompt starts with, from its pools or its host tier, with its prefix's KV; the fetcher files it and resumes from
it with the answer the holder gives from its own checkpoint (for dense checkpoints, the cold answer). Refused: an
entry of another codec setting, another salt, or tokens the prompt does not start with."""

from __future__ import annotations

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.engine.test_host_tier import _prompts
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def _engine(zoo, **knobs) -> Engine:
    model, tok = zoo
    return Engine(model, tok, EngineConfig(**{"compile_decode": False, "compile_prefill": False,
                                              "checkpoint_slots": 4, **knobs}))


def _ask(engine: Engine, prompt: list[int], salt: str | None = None):
    params = GREEDY if salt is None else SamplingParams(**{**GREEDY.__dict__, "cache_salt": salt})
    return engine.generate([prompt], params)[0][0]


def _limit(engine: Engine, prompt: list[int]) -> int:
    return len(prompt) - 1 - engine.cfg.tail  # where a request of `prompt` may resume


@pytest.mark.parametrize("codec", [{}, {"w_max": 16.0, "policy": "nr"}], ids=["dense", "dasc-nr-W16"])
def test_a_fetched_checkpoint_resumes_with_the_holders_answer(zoo, codec):
    prompt = _prompts(zoo[1], 1)[0]
    holder, fetcher = _engine(zoo, **codec), _engine(zoo, peer_fetch=True, **codec)
    cold = _ask(holder, prompt)
    entry = holder.export_entry(prompt, _limit(holder, prompt), None)
    assert entry is not None and len(entry["tokens"]) == _limit(holder, prompt)
    local = _ask(holder, prompt)  # the holder resuming from its own checkpoint
    assert fetcher.import_entry(entry, prompt, None) is None
    fetched = _ask(fetcher, prompt)
    assert fetched.cached_tokens == local.cached_tokens == len(entry["tokens"])
    assert fetched.output_ids == local.output_ids
    if not codec:
        assert fetched.output_ids == cold.output_ids
    fetcher.check_integrity()
    holder.check_integrity()


def test_an_entry_in_the_holders_host_tier_is_exported_too(zoo):
    prompts = _prompts(zoo[1], 3)
    holder = _engine(zoo, checkpoint_slots=1, host_mb=4.0)
    cold = [_ask(holder, p) for p in prompts]  # the first two prompts' checkpoints went to the host tier
    entry = holder.export_entry(prompts[0], _limit(holder, prompts[0]), None)
    assert entry is not None and entry["tokens"] == prompts[0][: _limit(holder, prompts[0])]
    fetcher = _engine(zoo, peer_fetch=True)
    assert fetcher.import_entry(entry, prompts[0], None) is None
    out = _ask(fetcher, prompts[0])
    assert out.cached_tokens == len(entry["tokens"]) and out.output_ids == cold[0].output_ids


def test_entries_of_another_salt_codec_or_prompt_are_refused(zoo):
    prompts = _prompts(zoo[1], 2)
    holder = _engine(zoo)
    _ask(holder, prompts[0], "tenant-a")
    assert holder.export_entry(prompts[0], _limit(holder, prompts[0]), "tenant-b") is None
    assert holder.export_entry(prompts[0], _limit(holder, prompts[0]), None) is None
    entry = holder.export_entry(prompts[0], _limit(holder, prompts[0]), "tenant-a")
    fetcher = _engine(zoo, peer_fetch=True)
    assert fetcher.import_entry(entry, prompts[0], "tenant-b") == "mismatched"
    assert fetcher.import_entry(entry, prompts[1], "tenant-a") == "mismatched"
    assert _engine(zoo, peer_fetch=True, w_max=16.0).import_entry(entry, prompts[0], "tenant-a") == "foreign"
    assert _engine(zoo).import_entry(entry, prompts[0], "tenant-a") == "no host tier"
    out = _ask(fetcher, prompts[0], "tenant-b")
    assert out.cached_tokens == 0
    fetcher.check_integrity()


def test_an_entry_on_the_holders_disk_is_exported_and_published(zoo, tmp_path, monkeypatch):
    """A holder restarted on its disk tier (empty pools and host tier) exports the entry from disk, read but not
    filed, and publishes it among its disk-tier marks from the start (the directory indexed from the headers)."""
    from app.cache.digest import checkpoint_mark
    from app.engine.engine import DISK_SECRET_ENV

    monkeypatch.setenv(DISK_SECRET_ENV, "test-deployment-secret")
    prompt = _prompts(zoo[1], 1)[0]
    first = _engine(zoo, disk_dir=str(tmp_path), host_mb=0.0)
    cold = _ask(first, prompt)
    assert first.persist() >= 1
    holder = _engine(zoo, disk_dir=str(tmp_path), host_mb=0.0)
    holder.cache.disk.flush()  # the index is built
    limit = _limit(holder, prompt)
    assert (*checkpoint_mark(prompt[:limit], 16), ) in [m[:3] for m in holder.cache.disk.marks(16)]
    entry = holder.export_entry(prompt, limit, None)
    assert entry is not None and entry["tokens"] == prompt[:limit]
    assert not holder.cache.host.entries  # read for the peer, not filed here
    fetcher = _engine(zoo, peer_fetch=True)
    assert fetcher.import_entry(entry, prompt, None) is None
    out = _ask(fetcher, prompt)
    assert out.cached_tokens == limit and out.output_ids == cold.output_ids
