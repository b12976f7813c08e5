"""The disk tier's index (app/cache/disk_tier.py `marks`): the entries a replica knows are on its disk, published as
digest marks with their bytes, for the router. Built from what it writes and reads, and after a restart from the
files' headers (their chain seed, never the salt); entries removed by a sweep or by another replica leave it."""

from __future__ import annotations

import torch

from app.cache.digest import block_hashes, checkpoint_mark
from app.cache.disk_format import entry_path, read_entry, salt_key, write_entry
from app.cache.disk_tier import DiskTier

SECRET = b"deployment-secret"
TOKENS = list(range(2000, 2300))
BLOCK = 16


def _tier(root, **kw) -> DiskTier:
    return DiskTier(root, SECRET, "model-fp", "codec-fp", block=64, **kw)


def _state(depth: int) -> dict[str, torch.Tensor]:
    return {"state.0": torch.zeros(8), "kv.3": torch.zeros(depth, 2, dtype=torch.bfloat16)}


def _mark(tokens, salt):
    return checkpoint_mark(tokens, BLOCK, salt)


def test_written_entries_are_published_as_marks_of_their_salt_with_their_bytes(tmp_path):
    tier = _tier(tmp_path)
    tier.put("tenant-a", TOKENS[:100], None, _state(100))
    tier.put(None, TOKENS[:250], None, _state(250))
    tier.flush()
    marks = tier.marks(BLOCK)
    assert marks == [(*_mark(TOKENS[:250], None), 32 + 250 * 4), (*_mark(TOKENS[:100], "tenant-a"), 32 + 100 * 4)]
    assert _mark(TOKENS[:100], "tenant-a") != _mark(TOKENS[:100], None)  # salts apart in the digest too
    assert tier.marks(BLOCK, limit=1) == marks[:1] and tier.stats()["indexed"] == 2


def test_a_restarted_tier_indexes_the_directory_from_headers_newest_first(tmp_path):
    first = _tier(tmp_path)
    for depth in (100, 150, 200, 250):
        first.put("tenant-a", TOKENS[:depth], "prompt_end", _state(depth))
    first.flush()
    first.close()
    again = _tier(tmp_path, index_limit=3)
    again.flush()
    assert [m[:3] for m in again.marks(BLOCK)] == [_mark(TOKENS[:d], "tenant-a") for d in (250, 200, 150)]
    # a read makes its entry the most recent
    assert len(again.find(TOKENS[:160], 160, "tenant-a")[0]["tokens"]) == 150
    assert again.marks(BLOCK)[0][:3] == _mark(TOKENS[:150], "tenant-a")


def test_entries_swept_or_removed_by_another_replica_leave_the_index(tmp_path):
    tier = _tier(tmp_path)
    tier.put(None, TOKENS[:100], None, _state(100))
    tier.put(None, TOKENS[:200], None, _state(200))
    tier.flush()
    entry_path(tmp_path, SECRET, "model-fp", "codec-fp", None, TOKENS[:200], 64).unlink()  # another replica's sweep
    assert len(tier.find(TOKENS, 250, None)[0]["tokens"]) == 100
    assert [m[:3] for m in tier.marks(BLOCK)] == [_mark(TOKENS[:100], None)]
    tier.sweep(budget_bytes=0, ttl_s=3600.0)
    assert tier.marks(BLOCK) == [] and tier.stats()["indexed"] == 0


def test_a_file_without_a_seed_is_found_by_lookup_and_indexed_then(tmp_path):
    """Entries written before headers kept their chain seed are not indexed at start, but a hit indexes them."""
    path = entry_path(tmp_path, SECRET, "model-fp", "codec-fp", None, TOKENS[:200], 64)
    write_entry(path, SECRET, {"model": "model-fp", "codec": "codec-fp", "salt": salt_key(SECRET, None),
                               "tokens": TOKENS[:200], "kind": None}, _state(200))
    tier = _tier(tmp_path)
    tier.flush()
    assert tier.marks(BLOCK) == []
    assert read_entry(path, SECRET, "model-fp", "codec-fp", salt_key(SECRET, None))[0]["tokens"] == TOKENS[:200]
    assert tier.find(TOKENS, 250, None) is not None
    assert [m[:3] for m in tier.marks(BLOCK)] == [_mark(TOKENS[:200], None)]
    assert tier.read_s_per_byte is not None and tier.read_s_per_byte > 0


def test_marks_follow_the_router_block_size(tmp_path):
    tier = _tier(tmp_path)
    tier.put("s", TOKENS[:150], None, _state(150))
    tier.flush()
    for block in (16, 64):
        chain = block_hashes(TOKENS, block, "s")
        h, r, tail, _ = tier.marks(block)[0]
        assert (h, r) == (chain[150 // block - 1], 150 % block) and (h, r, tail) == checkpoint_mark(TOKENS[:150],
                                                                                                    block, "s")
