"""Chained block hashes of token prefixes: what a replica tells the router about the prefixes it holds.

hash_k = H(hash_{k-1}, tokens of block k) over full blocks of `block` tokens from a fixed seed (as vLLM's
`hash_block_tokens`), 64-bit blake2b, so any process computes the same values. A replica publishes the
hashes of every full block on the path to each of its checkpoints; a request whose first i block hashes
are all published shares (about) i * block tokens with a checkpoint there.

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


def block_hashes(tokens: list[int], block: int, salt: str | None = None) -> list[int]:
    out, parent = [], chain_seed(salt)
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
    """Block hashes of the prefixes of the tree's checkpoints (each chain seeded by its root's salt), most
    recently used checkpoints first, at most `limit` hashes."""
    return checkpoint_digest(tree, block, limit)[0]


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


def checkpoint_digest(tree, block: int, limit: int = 8192) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(`tree_digest`, the marks): `checkpoint_mark` of each checkpoint, which a router checks against a prompt's
    chain and tokens to find the deepest checkpoint the prompt can resume from."""
    nodes = sorted((n for n in tree.nodes() if n.checkpoint is not None), key=lambda n: -n.ckpt_access)
    seen: dict[int, None] = {}
    marks: dict[tuple[int, int, int], None] = {}
    for node in nodes:
        salt, tokens = tree.path(node)
        chain = block_hashes(tokens, block, salt)
        seen.update(dict.fromkeys(chain))
        mark = checkpoint_mark(tokens, block, salt, chain)
        if mark is not None:
            marks.setdefault(mark)
        if len(seen) >= limit:
            break
    return list(seen)[:limit], list(marks)
