"""The host tier's bookkeeping (`app/cache/host_tier.py`), without an engine: the deepest entry a prompt starts
with, salts and codec layouts kept apart, KV blocks shared along a path, one budget over states and KV evicted by
value per byte and age, and the integrity check. One KV byte a token, blocks of 16 tokens."""

from __future__ import annotations

import pytest

from app.cache.host_tier import HostTier

DENSE, DASC = (None, "none", "ragged", "static"), (64.0, "none", "ragged", "static")
PROMPT = list(range(1000, 1300))


def test_find_gives_the_deepest_entry_the_prompt_starts_with_within_the_limit():
    tier = HostTier(10_000, 1, block=16)
    for depth in (40, 64, 130):
        tier.admit(None, PROMPT[:depth], DENSE, 10, "prompt_end")
    tier.admit(None, PROMPT[:100] + [7] * 50, DENSE, 10, "prompt_end")  # leaves the prompt at 100
    assert tier.find(PROMPT, 300, None, DENSE).depth == 130
    assert tier.find(PROMPT, 129, None, DENSE).depth == 64
    assert tier.find(PROMPT, 63, None, DENSE).depth == 40
    assert tier.find(PROMPT, 39, None, DENSE) is None
    assert tier.find(PROMPT[:50] + [1] + PROMPT[51:], 300, None, DENSE).depth == 40
    tier.check_integrity(DENSE)


def test_salts_and_layouts_never_share():
    tier = HostTier(10_000, 1, block=16)
    tier.admit("tenant-a", PROMPT[:80], DENSE, 10, None)
    assert tier.find(PROMPT, 300, "tenant-b", DENSE) is None and tier.find(PROMPT, 300, None, DENSE) is None
    assert tier.find(PROMPT, 300, "tenant-a", DASC) is None
    assert tier.find(PROMPT, 300, "tenant-a", DENSE).depth == 80
    stale, dropped = tier.drop_layouts(DASC)
    assert [e.depth for e in stale] == [80] and len(dropped) == 5 and not tier.entries and not tier.blocks
    assert tier.counters.layout_drops == 1
    tier.check_integrity(DASC)


def test_entries_on_one_path_share_their_kv_blocks():
    tier = HostTier(10_000, 1, block=16)
    short = tier.admit(None, PROMPT[:64], DENSE, 10, None)
    assert [at for _, at in short.new_blocks] == [0, 16, 32, 48] and tier.kv_bytes == 64
    long = tier.admit(None, PROMPT[:100], DENSE, 10, None)  # two more blocks and 4 tokens of its own
    assert [at for _, at in long.new_blocks] == [64, 80] and tier.kv_bytes == 100
    tier.take(short.entry)
    assert tier.release(short.entry) == [] and tier.kv_bytes == 100  # its blocks stay: the longer entry uses them
    tier.take(long.entry)
    assert len(tier.release(long.entry)) == 6 and tier.kv_bytes == 0 and not tier.blocks
    tier.check_integrity(DENSE, set(), set())


def test_one_budget_evicts_by_value_per_byte_and_age():
    """An entry's value is the prefill it saves per byte; greedy-dual aging raises the floor to each evicted
    entry's priority, so newer entries outlast old ones of the same value."""
    tier = HostTier(1000, 1, block=16)
    cheap = tier.admit(None, PROMPT[:100], DENSE, 100, None).entry  # 200 bytes: 0.5 tokens per byte
    dear = tier.admit(None, PROMPT[200:210], DENSE, 190, None).entry  # 200 bytes: 0.05 tokens per byte
    third = tier.admit(None, PROMPT[250:300], DENSE, 600, None)  # 650 bytes: evicts the least valuable
    assert third.evicted == [dear] and set(tier.entries) == {cheap.id, third.entry.id}
    assert tier.used_bytes == 850 and tier.state_bytes == 700 and tier.kv_bytes == 150
    fourth = tier.admit(None, PROMPT[:30], DENSE, 150, None)  # shares cheap's first block; aged, it stays
    assert fourth.evicted == [third.entry] and fourth.entry.priority > third.entry.priority
    assert fourth.new_blocks == [] and tier.used_bytes == 200 + 164
    assert tier.admit(None, PROMPT, DENSE, 900, None).entry is None  # larger than the whole budget
    assert tier.counters.skipped == 1
    tier.check_integrity(DENSE)


def test_integrity_catches_bytes_that_disagree_with_the_bookkeeping():
    tier = HostTier(1000, 1, block=16)
    entry = tier.admit(None, PROMPT[:20], DENSE, 10, None).entry
    tier.check_integrity(DENSE, held={entry.id})
    with pytest.raises(AssertionError, match="host bytes held"):
        tier.check_integrity(DENSE, held=set())
    with pytest.raises(AssertionError, match="superseded layout"):
        tier.check_integrity(DASC)
    tier.take(entry)
    tier.release(entry)
    tier.settle(entry, loaded=True)
    assert tier.counters.promotions == 1 and tier.used_bytes == 0
    tier.check_integrity(DENSE, held=set())


def test_an_entry_being_loaded_keeps_its_blocks_whatever_is_evicted_meanwhile():
    """Regression (bench_tiers, KeyError in a promotion): making room for a promotion demotes another checkpoint,
    whose admission may evict the entries the loading one shares blocks with; those blocks must stay until the
    loading entry is released."""
    tier = HostTier(200, 1, block=16)
    shorter = tier.admit(None, PROMPT[:64], DENSE, 10, None).entry
    loading = tier.admit(None, PROMPT[:100], DENSE, 10, None).entry
    tier.take(loading)
    other = tier.admit(None, PROMPT[150:200], DENSE, 40, None)  # room only without the shorter entry
    assert other.evicted == [shorter] and not set(other.dropped) & set(loading.blocks) and other.entry
    assert tier.admit(None, PROMPT[200:300], DENSE, 10, None).entry is None  # no room while it loads
    assert sorted(tier.release(loading)) == sorted(loading.blocks)
    tier.check_integrity(DENSE)
