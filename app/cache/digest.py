"""Chained block hashes of token prefixes: what a replica tells the router about the prefixes it holds.

hash_k = H(hash_{k-1}, tokens of block k) over full blocks of `block` tokens from a fixed seed (as vLLM's
`hash_block_tokens`), 64-bit blake2b, so any process computes the same values. A replica publishes the
hashes of every full block its tree holds KV for (`prefix_digest`), and a mark per checkpoint
(`checkpoint_mark`); a request whose first i block hashes are all published shares (about) i * block tokens
of KV there, and resumes from the deepest mark its tokens reach. KV without a checkpoint saves a hybrid model
nothing by itself, but it is where the engine cuts the branch checkpoint the prefix's next requests resume
from: the router keeps a prefix near its KV for that.

A cache salt seeds the chain (`chain_seed`): the cache keeps each salt's prefixes apart (app/cache/radix.py), so
a salted request's hashes match only checkpoints of its own salt, and no digest shows one tenant's prefixes
under another's hashes.
"""

from __future__ import annotations

import hashlib

SEED = b"dasc-serve/prefix-digest/v1"


def chain_seed(salt: str | None) -> bytes:
    """The chain's starting value: SEED, or for a salt a hash of SEED and the salt."""
    if salt is None:
        return SEED
    return hashlib.blake2b(SEED + b"/salt/" + salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def block_hashes(tokens: list[int], block: int, salt: str | None = None, seed: bytes | None = None) -> list[int]:
    """The chained hashes of every full block, from `chain_seed(salt)` or the given `seed` (a disk entry keeps its
    chain's seed, never its salt)."""
    out, parent = [], chain_seed(salt) if seed is None else seed
    for lo in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent + repr(tokens[lo : lo + block]).encode(), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
        parent = h
    return out


def matched_blocks(chain: list[int], known: set[int] | frozenset[int]) -> int:
    """How many leading blocks of `chain` are in `known`."""
    n = 0
    for h in chain:
        if h not in known:
            break
        n += 1
    return n


def tail_hash(block_hash: int, tail: list[int]) -> int:
    """The hash that pins a checkpoint's position inside the block after its last full one: the tokens between
    that block's end and the checkpoint, chained from the block's hash."""
    h = hashlib.blake2b(block_hash.to_bytes(8, "little") + b"/tail/" + repr(list(tail)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def checkpoint_mark(tokens: list[int], block: int, salt: str | None = None,
                    chain: list[int] | None = None) -> tuple[int, int, int] | None:
    """A checkpoint after `tokens` as (hash of its last full block, r: tokens past that block, their `tail_hash`).
    A prompt resumes from it only if it starts with all of `tokens`: its chain holds the block hash and its next r
    tokens give the same tail hash. None for a checkpoint shallower than one block."""
    k = len(tokens) // block
    if k == 0:
        return None
    chain = block_hashes(tokens, block, salt) if chain is None else chain
    return chain[k - 1], len(tokens) - k * block, tail_hash(chain[k - 1], tokens[k * block :])


def prefix_digest(tree, block: int, limit: int = 8192) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(the hashes of every full block the tree holds KV for, each chain seeded by its root's salt; the
    `checkpoint_mark` of each checkpoint). One walk: each node's blocks are hashed once, chained from its
    parent's last full block, and the most recently used branches come first; at most `limit` hashes (a
    checkpoint's mark is listed only with its path)."""
    hashes: list[int] = []
    marks: dict[tuple[int, int, int], None] = {}
    # (node, the chain value after the last full block above the node's edge, the tokens past that block)
    stack = [(r, chain_seed(r.salt), []) for r in sorted(tree.roots.values(), key=lambda n: n.kv_access)]
    while stack:
        node, parent, pending = stack.pop()
        pending = pending + node.tokens if node.parent is not None else pending
        while len(pending) >= block:
            if len(hashes) >= limit:
                return hashes, list(marks)
            parent = hashlib.blake2b(parent + repr(pending[:block]).encode(), digest_size=8).digest()
            pending = pending[block:]
            hashes.append(int.from_bytes(parent, "little"))
        if node.checkpoint is not None and node.depth >= block:
            last = int.from_bytes(parent, "little")
            marks.setdefault((last, len(pending), tail_hash(last, pending)))
        stack += [(c, parent, pending) for c in sorted(node.children.values(), key=lambda n: n.kv_access)]
    return hashes, list(marks)
