"""Radix tree over token ids: attention KV slots on every edge, at most one state checkpoint per node end.

    root ──[5 9 2]── A ──[7 7]── B (ckpt 3)        node A holds KV slots of tokens 5 9 2,
                      └──[4 1 8 6]── C (ckpt 1)    B those of 7 7 and a checkpoint of the state after
                                                   the 5 tokens 5 9 2 7 7, C the state after 7 tokens.
Invariants (checked by `check_integrity`):
- every non-root node has a non-empty edge with one KV slot per token; children are keyed by the first
  token of their edge, and no two children share it;
- a KV slot belongs to at most one node;
- a checkpoint sits only at a node's end, and only where the node's whole prefix has KV (always: a
  checkpoint is dropped with its node's KV);
- lock counts never go negative and a node's lock is at least the sum of its children's (locking a node
  locks its whole path); locked nodes are never evicted, neither their KV nor their checkpoint.
A lookup's usable hit is the deepest checkpoint at or below the KV match (`MatchResult`).

Cache salts: each salt has its own root (`roots`; None's is `root`), and lookups and inserts of a request
start at its salt's root, so requests with different salts never share a prefix: a tenant cannot learn from
`cached_tokens` or TTFT what another tenant sent. A salted root exists while it has children or is locked
(`root_of` makes it, `_prune` drops it once empty), so a stream of one-off salts leaves nothing behind.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch


@dataclass(eq=False)
class Node:
    tokens: list[int]
    kv: torch.Tensor  # [len(tokens)] int64 KV slot ids
    parent: "Node | None"
    depth: int  # tokens from the root to this node's end
    id: int
    children: dict[int, "Node"] = field(default_factory=dict)
    checkpoint: int | None = None  # checkpoint pool slot of the state after `depth` tokens
    lock: int = 0  # holders of this node or a node below it: its KV stays
    pins: int = 0  # holders of this very node (a sequence's deepest node, a fork's, a store's): its checkpoint stays
    kv_access: int = 0  # refreshed along the path on every match and insert
    ckpt_access: int = 0  # refreshed only when this node's checkpoint is stored or used
    evicted: bool = False  # its checkpoint was evicted for room (until one is stored here again)
    discarded: bool = False  # its checkpoint was discarded by a layout change (`drop_checkpoints`; likewise)
    ckpt_kind: str | None = None  # why its checkpoint was stored (prompt_end, branch, lookback, ...)
    ckpt_loads: int = 0  # times its checkpoint was loaded since it was stored
    salt: str | None = None  # a root's cache salt (other nodes: None; their root tells)


class MatchResult(NamedTuple):
    """kv_len: prompt tokens whose KV the tree holds; kv_node: node where that match ends (the match may end
    inside its edge; None when the salt has no root); checkpoint_node/checkpoint_len: deepest checkpoint at
    or below kv_len and at most `limit` (None, 0 when there is none); kv_slots: [checkpoint_len] slots the
    request can share; fork_len: depth of the deepest fork on the matched path below the checkpoint (a node
    where earlier sequences already diverged, so this request is at least the third to share it) that holds
    no checkpoint and sits at most at `limit`, else 0: a prefix worth checkpointing again after its checkpoint
    was evicted; lost_len: depth of the deepest node on the matched path below the checkpoint and at most
    `limit` whose checkpoint was evicted for room (`Node.evicted`), else 0: the request would have resumed there
    had the pool kept it (what cache pressure costs, unlike a replay from where no checkpoint was ever cut);
    discarded_len: the same for a checkpoint a layout change discarded (`Node.discarded`; at any depth of the match,
    capped at `limit`): the replay a retune costs once, which neither more room nor more checkpoints would save.
    host_len, host_bytes: the deepest checkpoint of the host tier the prompt starts with (at most `limit`), when it
    lies deeper than checkpoint_len, and the bytes loading it moves (0, 0 otherwise; `PrefixCache.match` fills
    them)."""

    kv_len: int
    kv_node: Node | None
    checkpoint_node: Node | None
    checkpoint_len: int
    kv_slots: torch.Tensor
    fork_len: int = 0
    lost_len: int = 0
    discarded_len: int = 0
    host_len: int = 0
    host_bytes: int = 0


class InsertResult(NamedTuple):
    """node: the node ending exactly at the inserted length; slots: the tree's KV slots for the whole
    sequence (the caller adopts them); duplicates: caller slots the tree already had tokens for (free them)."""

    node: Node
    slots: torch.Tensor
    duplicates: torch.Tensor


class RadixTree:
    def __init__(self, on_drop: Callable[[Node], None] | None = None) -> None:
        """`on_drop(node)`: told of each checkpoint about to leave the tree (evicted, or dropped with its KV or
        by `drop_checkpoints`), while the node still holds it: what telemetry counts as reused or never."""
        self.on_drop = on_drop or (lambda node: None)
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = self._new_root(None)
        self.roots: dict[str | None, Node] = {None: self.root}

    def _new_root(self, salt: str | None) -> Node:
        """A root holds a lock of its own: it is never evicted (a salted one is pruned once empty)."""
        return Node([], torch.zeros(0, dtype=torch.long), None, 0, next(self._ids), lock=1, salt=salt)

    def root_of(self, salt: str | None) -> Node:
        """The root of `salt`'s prefixes, made on first use."""
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = self._new_root(salt)
        return root

    def _prune(self, root: Node) -> None:
        """Drop a salted root that holds nothing (no children, no lock but its own)."""
        if root.salt is not None and not root.children and root.lock == 1:
            self.roots.pop(root.salt, None)

    @staticmethod
    def path(node: Node) -> tuple[str | None, list[int]]:
        """(the salt of `node`'s root, the tokens from that root to `node`'s end)."""
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return node.salt, [t for part in reversed(parts) for t in part]

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: list[int], limit: int | None = None, touch: bool = True,
              salt: str | None = None) -> MatchResult:
        """Longest cached prefix of `tokens` under `salt`'s root; the checkpoint used must sit at depth <= limit."""
        limit = len(tokens) if limit is None else limit
        node, pos = self.roots.get(salt), 0
        if node is None:
            return MatchResult(0, None, None, 0, torch.zeros(0, dtype=torch.long))
        best, best_len, fork, lost, discarded = None, 0, 0, 0, 0
        path_slots: list[torch.Tensor] = []
        best_slots = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos)
            path_slots.append(child.kv[:n])
            if n < len(child.tokens):
                node, pos = child, pos + n
                break
            node, pos = child, pos + n
            if node.checkpoint is not None and node.depth <= limit:
                best, best_len, best_slots = node, node.depth, len(path_slots)
            elif node.depth <= limit:
                fork = node.depth if len(node.children) >= 2 else fork
                lost = node.depth if node.evicted else lost
            if node.discarded:  # at any depth: under a new tail the old checkpoint may lie past `limit`
                discarded = min(node.depth, limit)
        if touch:
            now = next(self._clock)
            walk = node
            while walk is not None:
                walk.kv_access = now
                walk = walk.parent
            if best is not None:
                best.ckpt_access = now
        slots = torch.cat(path_slots[:best_slots]) if best_slots else torch.zeros(0, dtype=torch.long)
        return MatchResult(pos, node, best, best_len, slots, fork if fork > best_len else 0,
                           lost if lost > best_len else 0, discarded if discarded > best_len else 0)

    # ------------------------------------------------------------------ updates
    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> InsertResult:
        """Add `tokens` with their KV `slots` [len(tokens)] under `salt`'s root, splitting edges as needed."""
        assert len(tokens) == len(slots) and len(tokens) > 0
        node, pos = self.root_of(salt), 0
        tree_slots, dup = [], []
        now = next(self._clock)
        while pos < len(tokens):
            node.kv_access = now
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(list(tokens[pos:]), slots[pos:].clone(), node, len(tokens), next(self._ids), kv_access=now)
                node.children[tokens[pos]] = new
                tree_slots.append(new.kv)
                node, pos = new, len(tokens)
                break
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            tree_slots.append(child.kv)
            dup.append(slots[pos : pos + n])
            node, pos = child, pos + n
        node.kv_access = now
        dup_slots = torch.cat(dup) if dup else torch.zeros(0, dtype=torch.long)
        return InsertResult(node, torch.cat(tree_slots), dup_slots)

    def kv_along(self, tokens: list[int], length: int, salt: str | None = None) -> torch.Tensor:
        """The KV slots of the first `length` tokens of `tokens` (which the tree must hold), in order."""
        if length == 0:  # (the salt may have no root yet)
            return torch.zeros(0, dtype=torch.long)
        node, pos, parts = self.roots[salt], 0, []
        while pos < length:
            child = node.children[tokens[pos]]
            take = min(len(child.tokens), length - pos)
            parts.append(child.kv[:take])
            node, pos = child, pos + take
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    @staticmethod
    def path_kv(node: Node) -> torch.Tensor:
        """The KV slots of every token from `node`'s root to its end, in order."""
        parts = []
        while node.parent is not None:
            parts.append(node.kv)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.zeros(0, dtype=torch.long)

    def split_at(self, tokens: list[int], length: int, salt: str | None = None) -> Node:
        """The node ending exactly at `length` tokens of `tokens` (which the tree must hold), splitting an edge."""
        node, pos = self.roots[salt], 0
        while pos < length:
            child = node.children[tokens[pos]]
            if pos + len(child.tokens) > length:
                return self._split(child, length - pos)
            node, pos = child, pos + len(child.tokens)
        return node

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (which keeps no checkpoint)."""
        parent = child.parent
        upper = Node(child.tokens[:n], child.kv[:n].clone(), parent, child.depth - len(child.tokens) + n,
                     next(self._ids), lock=child.lock, kv_access=child.kv_access)
        parent.children[child.tokens[0]] = upper
        child.tokens, child.kv, child.parent = child.tokens[n:], child.kv[n:].clone(), upper
        upper.children[child.tokens[0]] = child
        return upper

    def set_checkpoint(self, node: Node, slot: int, kind: str | None = None) -> int | None:
        """Attach checkpoint `slot` (stored for `kind`) at `node`'s end; returns the slot it replaces (to free),
        if any. Setting the slot the node already holds refreshes it (its kind and loads stay)."""
        old, node.checkpoint, node.evicted, node.discarded = node.checkpoint, slot, False, False
        if old != slot:
            node.ckpt_kind, node.ckpt_loads = kind, 0
        node.ckpt_access = next(self._clock)
        return old

    def lock(self, node: Node) -> None:
        """Hold `node`: its checkpoint and the KV of its path stay (the checkpoints above it may be evicted: a
        holder loaded its state already, or resumes from `node` itself)."""
        node.pins += 1
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        node.pins -= 1
        assert node.pins >= 0, "unpin without pin"
        while True:
            node.lock -= 1
            assert node.lock >= 0, "unlock without lock"
            if node.parent is None:
                self._prune(node)
                return
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, num_slots: int) -> tuple[torch.Tensor, list[int]]:
        """Remove least-recently-used unlocked leaves until `num_slots` KV slots are freed (or none is left).
        Returns (freed KV slots, freed checkpoint slots of the removed nodes)."""
        freed, ckpts = [], []
        count = 0
        while count < num_slots:
            leaves = [n for n in self.nodes() if not n.children and n.lock == 0 and n.parent is not None]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.kv_access, n.id))
            del victim.parent.children[victim.tokens[0]]
            if victim.parent.parent is None:
                self._prune(victim.parent)
            freed.append(victim.kv)
            count += len(victim.kv)
            if victim.checkpoint is not None:
                self.on_drop(victim)
                ckpts.append(victim.checkpoint)
        return (torch.cat(freed) if freed else torch.zeros(0, dtype=torch.long)), ckpts

    def evict_checkpoint(self, select: Callable[[list[Node]], Node]) -> int | None:
        """Drop the checkpoint of the node `select` picks among all checkpointed nodes no one holds itself (in
        node-id order; one on a held node's path may go: an agent's older turns hold no slot while its next
        turn runs); the node keeps its KV. Returns the freed slot, or None if none is evictable."""
        candidates = sorted((n for n in self.nodes() if n.checkpoint is not None and n.pins == 0), key=lambda n: n.id)
        if not candidates:
            return None
        victim = select(candidates)
        self.on_drop(victim)
        slot, victim.checkpoint, victim.evicted = victim.checkpoint, None, True
        return slot

    def drop_checkpoints(self) -> None:
        """Forget every checkpoint (a new layout empties the pool), and which ones were evicted for room; mark the
        nodes that held one as discarded."""
        for node in self.nodes():
            node.discarded = node.checkpoint is not None or node.discarded
            if node.checkpoint is not None:
                self.on_drop(node)  # (marked first: `on_drop` tells a discard from an eviction by it)
            node.checkpoint, node.evicted = None, False

    # ------------------------------------------------------------------ inspection
    def nodes(self):
        """Every node under every root, the roots included."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_checkpoints(self) -> int:
        return sum(n.checkpoint is not None for n in self.nodes())

    def num_kv_slots(self) -> int:
        return sum(len(n.kv) for n in self.nodes())

    def check_integrity(self) -> None:
        seen: set[int] = set()
        for node in self.nodes():
            if node.parent is not None:
                assert node.tokens and len(node.tokens) == len(node.kv), f"node {node.id}: edge/kv length"
                assert node.parent.children.get(node.tokens[0]) is node, f"node {node.id}: child key"
                assert node.depth == node.parent.depth + len(node.tokens), f"node {node.id}: depth"
                assert node.lock >= 0, f"node {node.id}: negative lock"
                assert 0 <= node.pins <= node.lock, f"node {node.id}: pins outside [0, lock]"
            assert node.lock >= sum(c.lock for c in node.children.values()), f"node {node.id}: lock below children"
            slots = node.kv.tolist()
            assert not seen.intersection(slots), f"node {node.id}: KV slot owned twice"
            assert len(set(slots)) == len(slots), f"node {node.id}: KV slot repeated"
            seen.update(slots)
        ckpts = [n.checkpoint for n in self.nodes() if n.checkpoint is not None]
        assert len(ckpts) == len(set(ckpts)), "checkpoint slot shared by two nodes"
        for salt, root in self.roots.items():
            assert root.salt == salt and root.parent is None and root.depth == 0, f"root of salt {salt!r}"
            assert root.checkpoint is None, "checkpoint at a root"
            assert root.lock >= 1 and (salt is None or root.children or root.lock > 1), f"stale root {salt!r}"


def _common(edge: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of edge and tokens[pos:]; a whole-slice compare (C speed) settles the
    usual case, a full match, before any per-token loop."""
    n, limit = 0, min(len(edge), len(tokens) - pos)
    if edge[:limit] == tokens[pos : pos + limit]:
        return limit
    while edge[n] == tokens[pos + n]:
        n += 1
    return n

