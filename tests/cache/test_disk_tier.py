"""The disk tier's store (app/cache/disk_tier.py): entries written behind and found after a "restart" (a new
store on the same directory) by key, the deepest first; salts kept apart; refused files counted and skipped; a
vanished file tolerated; an unwritable directory or a full queue skips writes and costs the caller nothing; the
sweep's retention (other fingerprints, age, bytes) and the purge command."""

from __future__ import annotations

import json
import os
import struct

import torch

from app import cli
from app.cache.disk_tier import DiskTier

SECRET = b"deployment-secret"
TOKENS = list(range(1000, 1300))


def _tier(root, **kw) -> DiskTier:
    return DiskTier(root, SECRET, "model-fp", "codec-fp", block=64, **kw)


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"state": torch.full((4,), v), "kv": torch.arange(6, dtype=torch.int8)}


def test_entries_written_behind_are_found_after_a_restart_deepest_first(tmp_path):
    first = _tier(tmp_path)
    for depth in (100, 200, 250):
        assert first.put("tenant-a", TOKENS[:depth], "prompt_end", _state(depth))
    first.flush()
    assert first.counters.writes == 3
    again = _tier(tmp_path)  # a new process: nothing in memory
    header, tensors = again.find(TOKENS, 300, "tenant-a")
    assert len(header["tokens"]) == 250 and torch.equal(tensors["state"], torch.full((4,), 250.0))
    assert len(again.find(TOKENS, 220, "tenant-a")[0]["tokens"]) == 200
    assert again.find(TOKENS, 300, "tenant-b") is None and again.find(TOKENS, 300, None) is None
    assert again.find([7] + TOKENS, 300, "tenant-a") is None


def test_other_prompts_entries_in_the_same_directory_are_not_read(tmp_path):
    """Entries sharing a block prefix share a directory; a lookup opens only the names its own depths would have, so
    a sibling (here a longer branch, and one past the prompt) is neither read nor counted as refused."""
    tier = _tier(tmp_path)
    branch = TOKENS[:100] + [7] * 20
    for tokens in (TOKENS[:100], branch, TOKENS[:125]):
        tier.put(None, tokens, None, _state(len(tokens)))
    tier.flush()
    assert len({p.parent for p in tmp_path.rglob("*.ckpt")}) == 1
    header, _ = tier.find(TOKENS[:120], 120, None)
    assert len(header["tokens"]) == 100 and tier.counters.rejected == {}
    assert tier.find(branch, 120, None)[0]["tokens"] == branch and tier.counters.rejected == {}


def test_refused_files_are_skipped_and_counted(tmp_path):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:250], None, _state(1.0))
    tier.put(None, TOKENS[:150], None, _state(2.0))
    tier.flush()
    files = sorted(tmp_path.rglob("*.ckpt"))
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    files[1].write_bytes(files[1].read_bytes()[:-5] + b"xxxxx")  # altered: its tag no longer matches
    reader = _tier(tmp_path)
    assert reader.find(TOKENS, 300, None) is None
    assert reader.counters.rejected == {"torn": 1, "unauthenticated": 1}
    # refused once, not read again while unchanged (a request's read-ahead and its admission look up the same files)
    assert reader.find(TOKENS, 300, None) is None
    assert reader.counters.rejected == {"torn": 1, "unauthenticated": 1}
    good = _tier(tmp_path / "good")
    good.put(None, TOKENS[:250], None, _state(3.0))
    good.flush()
    replaced = next((tmp_path / "good").rglob("*.ckpt"))
    target = next(f for f in files if f.name == replaced.name)
    target.write_bytes(replaced.read_bytes())  # a good file in its place: read again, and found
    assert reader.find(TOKENS, 300, None)[1]["state"][0] == 3.0


def test_an_unwritable_directory_or_a_full_queue_skips_writes(tmp_path):
    root = tmp_path / "tier"
    root.write_text("not a directory")  # every write fails, for root too
    tier = _tier(root)
    assert tier.put(None, TOKENS[:100], None, _state(1.0))
    tier.flush()
    assert tier.counters.writes == 0 and sum(tier.counters.skipped_writes.values()) == 1
    full = _tier(tmp_path / "slow", max_queue=1)
    results = [full.put(None, TOKENS[: 100 + i], None, _state(i)) for i in range(50)]
    full.flush()
    assert results[0] and (not all(results)) == (full.counters.skipped_writes.get("queue_full", 0) > 0)
    assert full.counters.writes + full.counters.skipped_writes.get("queue_full", 0) == 50


def test_an_entry_larger_than_the_whole_budget_is_not_written(tmp_path):
    tier = _tier(tmp_path, budget_bytes=20)  # _state's tensors: 22 bytes
    assert not tier.put(None, TOKENS[:100], None, _state(1.0))
    tier.flush()
    assert tier.counters.writes == 0 and tier.counters.skipped_writes == {"larger_than_budget": 1}
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_file_removed_by_another_replica_is_tolerated(tmp_path):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:200], None, _state(1.0))
    tier.flush()
    for p in tmp_path.rglob("*.ckpt"):
        p.unlink()
    assert tier.find(TOKENS, 300, None) is None and tier.counters.rejected == {}


def test_sweep_removes_expired_then_other_fingerprints_then_the_oldest_beyond_the_budget(tmp_path):
    old = DiskTier(tmp_path, SECRET, "older-model", "codec-fp", block=64)
    old.put(None, TOKENS[:100], None, _state(0.0))
    old.flush()
    tier = _tier(tmp_path)
    for depth in (100, 150, 200, 250):
        tier.put(None, TOKENS[:depth], None, _state(depth))
    tier.flush()
    mine = {len(_read(p)["tokens"]): p for p in tmp_path.glob("fp-*/*/*.ckpt") if _mine(p)}
    for depth, path in mine.items():  # written in order of depth, a second apart
        os.utime(path, (1000.0 + depth, 1000.0 + depth))
    budget = sum(p.stat().st_size for d, p in mine.items() if d != 100)  # room for all but the oldest
    tier.sweep(budget_bytes=budget, ttl_s=1e9, now=2000.0)
    assert tier.counters.swept == {"fingerprint": 1, "budget": 1}
    assert sorted(len(_read(p)["tokens"]) for p in tmp_path.rglob("*.ckpt")) == [150, 200, 250]
    tier.sweep(budget_bytes=budget, ttl_s=775.0, now=2000.0)  # written before 1225: the 150- and 200-token ones
    assert sorted(len(_read(p)["tokens"]) for p in tmp_path.rglob("*.ckpt")) == [250]
    assert tier.counters.swept["ttl"] == 2


def test_purge_removes_entries_and_temporary_files_only(tmp_path, capsys):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:100], None, _state(1.0))
    tier.flush()
    (tmp_path / "notes.txt").write_text("keep me")
    next(tmp_path.rglob("*.ckpt")).with_name(".x.ckpt.1.2.tmp").write_bytes(b"half")
    assert cli.main(["cache", "purge", str(tmp_path)]) == 0
    assert "removed 2 files" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _read(path):
    return json.loads(path.read_bytes()[20:20 + struct.unpack("<I", path.read_bytes()[8:12])[0]])


def _mine(path) -> bool:
    return _read(path)["model"] == "model-fp"


def test_close_writes_what_is_queued_then_ends_the_writer(tmp_path):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:100], None, _state(1.0))
    tier.close()
    assert tier.counters.writes == 1 and not tier._writer.is_alive()
    assert not tier.put(None, TOKENS[:120], None, _state(2.0)) and tier.counters.skipped_writes == {"closed": 1}


def test_the_writer_thread_runs_only_on_idle_cpu(tmp_path):
    """SCHED_IDLE (Linux): the write-behind thread never takes a core from the step thread or the API."""
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:100], None, _state(1.0))
    tier.flush()
    assert os.sched_getscheduler(tier._writer.native_id) == os.SCHED_IDLE
    tier.close()
