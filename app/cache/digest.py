"""Chained block hashes of token prefixes: what a replica tells the router about the prefixes it holds.

hash_k = H(hash_{k-1}, tokens of block k) over full blocks of `block` tokens from a fixed seed (as vLLM's
`hash_block_tokens`), 64-bit blake2b, so any process computes the same values. A replica publishes the
hashes of every full block on the path to each of its checkpoints; a request whose first i block hashes
are all published shares (about) i * block tokens with a checkpoint there.
"""

from __future__ import annotations

import hashlib

SEED = b"dasc-serve/prefix-digest/v1"


def block_hashes(tokens: list[int], block: int) -> list[int]:
    out, parent = [], SEED
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


def tree_digest(tree, block: int, limit: int = 8192) -> list[int]:
    """Block hashes of the prefixes of the tree's checkpoints, most recently used checkpoints first, at most
    `limit` hashes."""
    nodes = sorted((n for n in tree.nodes() if n.checkpoint is not None), key=lambda n: -n.ckpt_access)
    seen: dict[int, None] = {}
    for node in nodes:
        for h in block_hashes(_path_tokens(node), block):
            seen.setdefault(h)
        if len(seen) >= limit:
            break
    return list(seen)[:limit]


def _path_tokens(node) -> list[int]:
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]
