"""Cache salts: each salt's prefixes live under their own root, so lookups never cross salts; a salted root
disappears once it holds nothing; the router digest seeds each chain with its checkpoint's salt."""

from __future__ import annotations

import torch

from app.cache.digest import block_hashes, prefix_digest
from app.cache.policy import SecondHitFilter
from app.cache.radix import RadixTree

TOKENS = list(range(12))


def _tree_with(salts) -> RadixTree:
    """TOKENS inserted once per salt, each copy with its own slots and a checkpoint at its end."""
    tree = RadixTree()
    for i, salt in enumerate(salts):
        res = tree.insert(TOKENS, torch.arange(len(TOKENS)) + 100 * i, salt)
        assert res.duplicates.numel() == 0  # nothing shared with another salt's copy
        tree.set_checkpoint(res.node, i)
    return tree


def test_lookups_do_not_cross_salts():
    tree = _tree_with([None, "a"])
    unsalted, a, b = tree.match(TOKENS), tree.match(TOKENS, salt="a"), tree.match(TOKENS, salt="b")
    assert (unsalted.kv_len, unsalted.checkpoint_node.checkpoint, unsalted.kv_slots.tolist()) == (12, 0, TOKENS)
    assert (a.kv_len, a.checkpoint_node.checkpoint, a.kv_slots.tolist()) == (12, 1, [100 + t for t in TOKENS])
    assert (b.kv_len, b.kv_node, b.checkpoint_node) == (0, None, None)  # a salt never seen: no root made
    assert set(tree.roots) == {None, "a"}
    tree.check_integrity()


def test_a_salted_root_is_dropped_once_it_holds_nothing():
    tree = RadixTree()
    root = tree.root_of("s")
    tree.lock(root)  # a cold sequence of salt "s" stands at its root
    tree.unlock(root)
    assert set(tree.roots) == {None}
    tree.insert([1, 2, 3], torch.tensor([7, 8, 9]), "s")
    assert set(tree.roots) == {None, "s"}
    freed, ckpts = tree.evict_kv(3)
    assert freed.tolist() == [7, 8, 9] and ckpts == [] and set(tree.roots) == {None}
    tree.check_integrity()


def test_the_second_hit_filter_keeps_salts_apart():
    seen = SecondHitFilter()
    assert not seen.seen_before(TOKENS, "a")
    assert not seen.seen_before(TOKENS, "b") and not seen.seen_before(TOKENS)
    assert seen.seen_before(TOKENS, "a") and seen.seen_before(TOKENS)


def test_the_digest_publishes_each_prefix_under_its_salt():
    tree = _tree_with(["a"])
    digest = set(prefix_digest(tree, 4)[0])
    assert digest == set(block_hashes(TOKENS, 4, salt="a"))
    assert not digest & set(block_hashes(TOKENS, 4)) and not digest & set(block_hashes(TOKENS, 4, salt="b"))
    both = _tree_with([None, "a"])
    assert set(prefix_digest(both, 4)[0]) == set(block_hashes(TOKENS, 4)) | set(block_hashes(TOKENS, 4, salt="a"))
