"""The disk tier's store (issue 39, in progress): entries in a directory (app/cache/disk_format.py), written behind by
a background thread and found by key, with no scan of the directory before serving.

- `put` queues an entry (its tensors on the host) and returns at once; the writer thread writes it. A full or
  unwritable disk, or a queue already `max_queue` deep (a slow disk), skips the write and counts it: the serving
  path never waits for the disk.
- `find` computes, for each full block of the prompt from the deepest, the directory its entries would be in, reads
  the entries there (usually one or two) and returns the deepest one that starts the prompt. A file another
  replica removed meanwhile is skipped; a refused one is counted by its reason and skipped.
- `sweep` (run it off the serving path, e.g. on the writer's schedule) keeps the directory within its bytes and
  age: it removes the directories of other model or codec fingerprints, then entries past `ttl_s`, then the
  oldest until the rest fit `budget_bytes`. Files another replica removes meanwhile are skipped.
- `purge(root)` removes every entry and temporary file under a tier directory, and the directories they leave
  empty (`python -m app.cli cache purge DIR`); other files are left alone.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.cache.disk_format import (
    DiskEntryError,
    block_dir,
    entry_path,
    fingerprint_dir,
    read_entry,
    salt_key,
    write_entry,
)


@dataclass
class DiskCounters:
    writes: int = 0
    written_bytes: int = 0
    skipped_writes: dict[str, int] = field(default_factory=dict)  # by reason: full queue, disk errors
    hits: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # refused files by reason
    swept: dict[str, int] = field(default_factory=dict)  # files removed by `sweep`, by reason


class DiskTier:
    def __init__(self, root: str | Path, secret: bytes, model_fp: str, codec_fp: str, block: int = 64,
                 max_queue: int = 64) -> None:
        self.root, self.secret, self.block = Path(root), secret, block
        self.model_fp, self.codec_fp = model_fp, codec_fp
        self.counters = DiskCounters()
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._writer = threading.Thread(target=self._write_loop, name="disk-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ write-behind
    def put(self, salt: str | None, tokens: list[int], kind: str | None, tensors: dict[str, torch.Tensor]) -> bool:
        """Queue one entry for writing (host tensors, not touched afterwards); False if it was skipped."""
        try:
            self._queue.put_nowait((salt, list(tokens), kind, tensors))
        except queue.Full:
            self._skip("queue_full")
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued entry is written (or skipped)."""
        self._queue.join()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def _write_loop(self) -> None:
        while True:
            salt, tokens, kind, tensors = self._queue.get()
            try:
                path = entry_path(self.root, self.secret, self.model_fp, self.codec_fp, salt, tokens, self.block)
                header = {"model": self.model_fp, "codec": self.codec_fp, "salt": salt_key(self.secret, salt),
                          "tokens": tokens, "kind": kind}
                self.counters.written_bytes += write_entry(path, self.secret, header, tensors)
                self.counters.writes += 1
            except OSError as e:  # a full or unwritable disk: the entry is not kept, nothing else happens
                self._skip(os.strerror(e.errno) if e.errno else type(e).__name__)
            finally:
                self._queue.task_done()

    def _skip(self, reason: str) -> None:
        self.counters.skipped_writes[reason] = self.counters.skipped_writes.get(reason, 0) + 1

    # ------------------------------------------------------------------ lookups
    def find(self, tokens: list[int], limit: int, salt: str | None) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """(header, tensors) of the deepest entry of `salt` that starts `tokens`, at most `limit` deep."""
        key = salt_key(self.secret, salt)
        for k in range(min(limit, len(tokens)) // self.block, -1, -1):
            folder = block_dir(self.root, self.secret, self.model_fp, self.codec_fp, salt, tokens[: k * self.block])
            try:
                names = sorted(p for p in os.listdir(folder) if p.endswith(".ckpt"))
            except OSError:  # no such directory (or unreadable): nothing filed here
                continue
            best = None
            for name in names:
                try:
                    header, tensors = read_entry(folder / name, self.secret, self.model_fp, self.codec_fp, key,
                                                 tokens)
                except FileNotFoundError:  # removed by another replica's eviction meanwhile
                    continue
                except DiskEntryError as e:
                    self.counters.rejected[e.reason] = self.counters.rejected.get(e.reason, 0) + 1
                    continue
                except OSError:
                    continue
                depth = len(header["tokens"])
                if depth <= limit and (best is None or depth > len(best[0]["tokens"])):
                    best = (header, tensors)
            if best is not None:
                self.counters.hits += 1
                return best
        return None

    # ------------------------------------------------------------------ retention
    def sweep(self, budget_bytes: int, ttl_s: float, now: float | None = None) -> None:
        """Remove other fingerprints' directories, entries older than `ttl_s`, then the oldest beyond
        `budget_bytes` (see the module doc)."""
        now = time.time() if now is None else now
        mine = fingerprint_dir(self.root, self.secret, self.model_fp, self.codec_fp)
        for other in self.root.glob("fp-*"):
            if other != mine and other.is_dir():
                self._count_swept("fingerprint", purge(other))
        files = []
        for path in mine.glob("*/*.ckpt"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for mtime, size, path in files:
            reason = "ttl" if mtime < now - ttl_s else "budget" if total > budget_bytes else None
            if reason is None:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            self._count_swept(reason, 1)

    def _count_swept(self, reason: str, n: int) -> None:
        if n:
            self.counters.swept[reason] = self.counters.swept.get(reason, 0) + n


def purge(root: str | Path) -> int:
    """Remove every entry (`*.ckpt`) and temporary file (`.*.tmp`) under `root` and the directories left empty;
    returns the files removed. Anything else stays."""
    root, removed = Path(root), 0
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        try:
            if path.is_file() and (path.suffix == ".ckpt" or (path.name.startswith(".") and path.suffix == ".tmp")):
                path.unlink()
                removed += 1
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        except OSError:
            continue
    if root.is_dir() and root.name.startswith("fp-") and not any(root.iterdir()):
        root.rmdir()
    return removed
