"""Radix tree and prefix cache: exact slot ids, match results and eviction order; random operation
sequences (hypothesis) that always end in a consistent cache."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.cache.checkpoint import CheckpointPool, DenseCodec, physical_slots
from app.cache.policy import FlopAwareSelect, lru_select
from app.cache.pools import KVSlots
from app.cache.prefix_cache import PrefixCache
from app.cache.radix import RadixTree
from app.models.batch import LinearStates


def _state(value: float) -> LinearStates:
    return LinearStates([torch.full((1, 3, 2), value)], [torch.full((1, 1, 2, 2), value)])


class _Store:
    """A dense codec standing in for a worker's checkpoint storage."""

    def __init__(self, slots: int) -> None:
        self.codec = DenseCodec(_state(0.0))
        self.codec.allocate(slots + 1)

    def write(self, state: LinearStates):
        return lambda slot: self.codec.store(slot, state)


def _cache(kv_slots=32, ckpt_slots=2, select=lru_select, admission="always") -> PrefixCache:
    codec = DenseCodec(_state(0.0))
    cache = PrefixCache(KVSlots(kv_slots), CheckpointPool(codec.bytes_per_slot, ckpt_slots + 1), admission, select)
    cache.store = _Store(ckpt_slots)
    return cache


def _store(cache: PrefixCache, node, state: LinearStates) -> bool:
    return cache.store_checkpoint(node, cache.store.write(state), "prompt_end")


def _slots(cache: PrefixCache, n: int) -> torch.Tensor:
    return cache.alloc_kv(n)


def test_insert_split_match_exact_slots():
    tree = RadixTree()
    a = tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    assert a.duplicates.numel() == 0 and a.slots.tolist() == [10, 11, 12, 13]
    b = tree.insert([1, 2, 9], torch.tensor([20, 21, 22]))  # splits [1 2 3 4] after 2
    assert b.duplicates.tolist() == [20, 21] and b.slots.tolist() == [10, 11, 22]
    assert sorted(len(n.tokens) for n in tree.nodes() if n is not tree.root) == [1, 2, 2]
    tree.set_checkpoint(a.node, 5)
    m = tree.match([1, 2, 3, 4, 7])
    assert (m.kv_len, m.checkpoint_len, m.checkpoint_node.checkpoint) == (4, 4, 5)
    assert m.kv_slots.tolist() == [10, 11, 12, 13]
    m = tree.match([1, 2, 3, 4], limit=3)  # the checkpoint at 4 is past the limit
    assert (m.kv_len, m.checkpoint_node, m.checkpoint_len) == (4, None, 0)
    m = tree.match([1, 2, 3, 8])  # ends inside the edge [3 4]
    assert m.kv_len == 3 and m.checkpoint_len == 0
    node = tree.split_at([1, 2, 3, 8], 3)
    assert node.depth == 3 and node.kv.tolist() == [12]
    tree.check_integrity()


def test_match_reports_a_stateless_fork_below_the_checkpoint():
    """[1 2] is a fork (children [3 4] and [9]) without a checkpoint: a third sequence through it learns its
    depth; once [1 2] holds a checkpoint, or the fork is past the limit, fork_len is 0."""
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    tree.insert([1, 2, 9], torch.tensor([20, 21, 22]))
    m = tree.match([1, 2, 3, 7])
    assert (m.kv_len, m.checkpoint_len, m.fork_len) == (3, 0, 2)
    assert tree.match([1, 2, 3, 7], limit=1).fork_len == 0
    assert tree.match([5, 6]).fork_len == 0
    fork = tree.match([1, 2, 9]).kv_node.parent
    assert fork.depth == 2
    tree.set_checkpoint(fork, 3)
    m = tree.match([1, 2, 3, 7])
    assert (m.checkpoint_len, m.fork_len) == (2, 0)
    tree.check_integrity()


DEEPEST = lambda nodes: max(nodes, key=lambda n: n.depth)  # noqa: E731  (an eviction policy)


def test_match_reports_where_a_checkpoint_evicted_for_room_would_have_resumed():
    """A checkpoint evicted by policy leaves its node marked: a lookup through it, deeper than the checkpoint it
    loads and within the limit, reports lost_len (what the pool's pressure cost it). Storing one there again, or
    a new layout (`drop_checkpoints`), clears the mark; a never-checkpointed node is no loss."""
    tree = RadixTree()
    a = tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    low = tree.split_at([1, 2, 3, 4], 2)
    tree.set_checkpoint(low, 7)
    tree.set_checkpoint(a.node, 8)
    assert tree.evict_checkpoint(DEEPEST) == 8 and a.node.evicted  # the deeper one goes
    m = tree.match([1, 2, 3, 4, 5])
    assert (m.checkpoint_len, m.lost_len) == (2, 4)
    assert tree.match([1, 2, 3, 4, 5], limit=3).lost_len == 0  # past the limit: not a loss
    assert tree.match([1, 2, 3, 9]).lost_len == 0  # leaves the path before it
    tree.set_checkpoint(a.node, 9)
    assert not a.node.evicted and tree.match([1, 2, 3, 4, 5]).lost_len == 0
    tree.evict_checkpoint(DEEPEST)
    tree.drop_checkpoints()
    assert tree.match([1, 2, 3, 4, 5]).lost_len == 0
    assert tree.num_checkpoints() == 0
    tree.check_integrity()


def test_match_limit_is_inclusive():
    """A checkpoint, or a stateless fork, exactly at `limit` is usable; one token past it is not."""
    tree = RadixTree()
    a = tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    tree.insert([1, 2, 9], torch.tensor([20, 21, 22]))
    tree.set_checkpoint(a.node, 5)
    m = tree.match([1, 2, 3, 4, 7], limit=4)
    assert (m.checkpoint_len, m.checkpoint_node) == (4, a.node)
    assert m.kv_slots.tolist() == [10, 11, 12, 13]
    assert tree.match([1, 2, 3, 4]).checkpoint_len == 4  # the default limit is the whole prompt
    assert tree.match([1, 2, 3, 4, 7], limit=3).checkpoint_len == 0
    assert tree.match([1, 2, 3, 7], limit=2).fork_len == 2
    assert tree.match([1, 2, 3, 7], limit=1).fork_len == 0


def test_lock_protects_from_eviction_and_lru_order():
    cache = _cache(kv_slots=12)
    r1 = cache.insert([1, 2, 3], _slots(cache, 3))
    r2 = cache.insert([4, 5, 6], _slots(cache, 3))
    r3 = cache.insert([7, 8, 9], _slots(cache, 3))
    cache.match([1, 2, 3])  # refresh [1 2 3]: LRU order is now [4 5 6], [7 8 9], [1 2 3]
    cache.lock(r3.node)
    slots = cache.alloc_kv(6)  # 3 free + evict one leaf: [4 5 6] (oldest unlocked)
    assert slots.tolist() == [3, 4, 5, 9, 10, 11]
    assert cache.match([4, 5, 6]).kv_len == 0 and cache.match([7, 8, 9]).kv_len == 3
    assert cache.alloc_kv(4) is None  # evicting [1 2 3] frees 3, and [7 8 9] is locked
    assert cache.match([1, 2, 3]).kv_len == 0 and cache.match([7, 8, 9]).kv_len == 3
    assert cache.kv.num_free == 3
    cache.unlock(r3.node)
    cache.check_integrity(private=[slots])
    assert r1.node.lock == 0 and r2.node.lock == 0


def test_checkpoint_eviction_lru_refreshes_only_the_used_node():
    cache = _cache(ckpt_slots=2)
    a = cache.insert([1, 2], _slots(cache, 2))
    b = cache.insert([1, 2, 3, 4], _slots(cache, 4))
    assert _store(cache, a.node, _state(1.0))
    assert _store(cache, b.node, _state(2.0))
    assert [a.node.checkpoint, b.node.checkpoint] == [1, 2]
    m = cache.match([1, 2, 9])  # uses the checkpoint at depth 2, refreshes a only
    assert m.checkpoint_node is a.node
    c = cache.insert([5, 6], _slots(cache, 2))
    assert _store(cache, c.node, _state(3.0))
    assert b.node.checkpoint is None and c.node.checkpoint == 2  # b evicted, its slot reused
    assert cache.match([1, 2, 3, 4]).kv_len == 4  # KV-only node remains
    loaded = cache.store.codec.load(cache.load_checkpoint(a.node))
    assert torch.equal(loaded.ssm[0], _state(1.0).ssm[0])
    loaded.ssm[0].add_(5.0)  # copy-on-write: the stored checkpoint does not change
    assert torch.equal(cache.store.codec.load(cache.load_checkpoint(a.node)).ssm[0], _state(1.0).ssm[0])
    cache.check_integrity()


def test_a_lookback_checkpoint_goes_first_once_a_checkpoint_below_it_is_reused():
    """A repeat resumed at the prompt end below the lookback checkpoint: the lookback one saves nothing more and
    is evicted before the LRU pick; a lookback checkpoint with nothing reused below keeps plain LRU order."""
    cache = _cache(ckpt_slots=2)
    lb = cache.insert([1, 2], _slots(cache, 2))
    end = cache.insert([1, 2, 3, 4], _slots(cache, 4))
    assert cache.store_checkpoint(lb.node, cache.store.write(_state(1.0)), "lookback")
    assert _store(cache, end.node, _state(2.0))
    other = cache.insert([5, 6], _slots(cache, 2))
    assert _store(cache, other.node, _state(3.0))  # nothing reused yet: LRU takes the older lookback one
    assert lb.node.checkpoint is None and end.node.checkpoint is not None
    assert cache.store_checkpoint(lb.node, cache.store.write(_state(1.0)), "lookback")  # LRU pick: end
    assert end.node.checkpoint is None
    assert _store(cache, end.node, _state(2.0))  # (evicts other, the least recently used)
    cache.load_checkpoint(end.node)  # a repeat resumes at the prompt end
    assert cache.store_checkpoint(lb.node, cache.store.write(_state(1.0)), "lookback")  # refresh: lb is newest
    last = cache.insert([7, 8], _slots(cache, 2))
    assert _store(cache, last.node, _state(4.0))
    assert lb.node.checkpoint is None and end.node.checkpoint is not None  # dominated: first out, LRU or not
    live = [n for n in cache.tree.nodes() if n.checkpoint is not None]
    assert cache.counters.reuse(live)["lookback"] == {"stored": 2, "reused": 0, "never_reused": 2,
                                                      "evicted_unused": 2, "unused_in_pool": 0}
    cache.check_integrity()
    assert cache.store_checkpoint(lb.node, cache.store.write(_state(1.0)), "lookback")
    cache.tree.drop_checkpoints()  # a layout change discards it: never reused, but not evicted for want of use
    assert cache.counters.reuse([])["lookback"] == {"stored": 3, "reused": 0, "never_reused": 3,
                                                    "evicted_unused": 2, "unused_in_pool": 0}


def test_checkpoint_eviction_flop_aware_prefers_cheap_prefixes():
    select = FlopAwareSelect(linear_flops_per_token=1.0, attention_flops_per_pair=0.0, bytes_per_checkpoint=1,
                             alpha=0.0)
    cache = _cache(ckpt_slots=2, select=select)
    long_ = cache.insert(list(range(10, 30)), _slots(cache, 20))
    short = cache.insert([1, 2], _slots(cache, 2))
    _store(cache, long_.node, _state(1.0))
    _store(cache, short.node, _state(2.0))
    cache.match(list(range(10, 30)))  # recency favours nothing here: alpha = 0
    new = cache.insert([3, 4, 5], _slots(cache, 3))
    _store(cache, new.node, _state(3.0))
    assert short.node.checkpoint is None and long_.node.checkpoint is not None  # 2 tokens save least
    cache.check_integrity()


def test_full_pool_with_locked_checkpoints_skips_the_store():
    cache = _cache(ckpt_slots=1)
    a = cache.insert([1, 2], _slots(cache, 2))
    _store(cache, a.node, _state(1.0))
    cache.lock(a.node)
    b = cache.insert([3, 4], _slots(cache, 2))
    assert not _store(cache, b.node, _state(2.0))
    assert cache.counters.skipped_stores == 1 and cache.checkpoints.num_used == 1
    cache.unlock(a.node)
    cache.check_integrity()


def test_second_hit_admission():
    cache = _cache(admission="second_hit")
    assert not cache.admit_prompt_end([1, 2, 3])
    assert cache.admit_prompt_end([1, 2, 3])
    assert not cache.admit_prompt_end([1, 2, 4])


def test_budget_sizing_follows_eq8():
    codec = DenseCodec(_state(0.0))
    assert codec.bytes_per_slot == (3 * 2 + 2 * 2) * 4
    budget = 10 * codec.bytes_per_slot + 5
    pool = CheckpointPool(codec.bytes_per_slot, physical_slots(codec.bytes_per_slot, budget_bytes=budget))
    assert pool.num_slots == 9 and pool.allocated_bytes <= budget


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "store", "alloc", "evict"]),
              st.lists(st.integers(0, 3), min_size=1, max_size=8)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_the_cache_consistent(sequence):
    cache = _cache(kv_slots=40, ckpt_slots=3)
    locked, private = [], []
    for op, tokens in sequence:
        if op == "insert":
            slots = cache.alloc_kv(len(tokens))
            if slots is not None:
                cache.insert(tokens, slots)
        elif op == "match":
            m = cache.match(tokens)
            assert m.checkpoint_len <= m.kv_len <= len(tokens)
            assert len(m.kv_slots) == m.checkpoint_len
        elif op == "lock":
            m = cache.match(tokens)
            node = cache.tree.split_at(tokens, m.kv_len) if m.kv_len else cache.tree.root
            cache.lock(node)
            locked.append(node)
        elif op == "unlock" and locked:
            cache.unlock(locked.pop(0))
        elif op == "store":
            m = cache.match(tokens)
            if m.kv_len:
                _store(cache, cache.tree.split_at(tokens, m.kv_len), _state(float(len(tokens))))
        elif op == "alloc":
            slots = cache.alloc_kv(len(tokens))
            if slots is not None:
                private.append(slots)
        elif op == "evict":
            freed = cache.tree.evict_checkpoint(lru_select)
            if freed is not None:
                cache.checkpoints.free(freed)
        assert cache.checkpoints.num_used <= cache.checkpoints.num_slots
        cache.check_integrity(private)
    for node in locked:
        cache.unlock(node)
    cache.check_integrity(private)
