"""The disk tier's store (app/cache/disk_tier.py): entries written behind and found after a "restart" (a new
store on the same directory) by key, the deepest first; salts kept apart; refused files counted and skipped; a
vanished file tolerated; an unwritable directory or a full queue skips writes and costs the caller nothing."""

from __future__ import annotations

import torch

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


def test_a_file_removed_by_another_replica_is_tolerated(tmp_path):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:200], None, _state(1.0))
    tier.flush()
    for p in tmp_path.rglob("*.ckpt"):
        p.unlink()
    assert tier.find(TOKENS, 300, None) is None and tier.counters.rejected == {}
