"""The disk tier's store (issue 39, in progress): entries in a directory (app/cache/disk_format.py), written behind by
a background thread and found by key, with no scan of the directory before serving.

- `put` queues an entry (its tensors on the host) and returns at once; the writer thread writes it. A full or
  unwritable disk, a queue already `max_queue` deep (a slow disk), or an entry larger than the whole budget skips
  the write and counts it by reason: the serving path never waits for the disk. An entry the index knows is on disk
  already is not written again (`holds`; the writer checks too, for what was queued twice).
- Reused checkpoints: the cache writes a checkpoint behind on its first load (so that a crash keeps what was worth
  keeping), within `reuse_bytes_s` (`may_write_reused`, a token bucket of one second's bytes).
- `find` computes, for each full block of the prompt from the deepest, the directory its entries would be in, lists
  it, and reads only the files named as an entry of one of the prompt's depths there would be (deepest first), so
  other prompts' entries in the same directory are never read; it returns the first that checks. A file another
  replica removed meanwhile is skipped; a refused one is counted by its reason and skipped, and not read again while
  it is unchanged (its path, mtime and size).
- `sweep` (the writer thread runs it at start and every `sweep_s`, off the serving path) keeps the directory
  within its bytes and age: entries past `ttl_s` go, then, beyond `budget_bytes`, those of other model or codec
  fingerprints, then the oldest. Files another replica removes meanwhile are skipped.
- `marks(block)`: the tier's index of the entries it knows are on disk (those it wrote or read, and, once after
  start, those its writer thread finds in its fingerprint's directory, newest first, up to `index_limit`, from
  their headers alone) as digest marks with their bytes, for the router (issue 40). A mark is a hint: a lookup
  checks the file in full, and an entry another replica removed meanwhile costs a misrouted request, no more.
- `purge(root)` removes every entry and temporary file under a tier directory, and the directories they leave
  empty (`python -m app.cli cache purge DIR`); other files are left alone.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.cache.digest import block_hashes, chain_seed, checkpoint_mark
from app.cache.disk_format import (
    DTYPES,
    DiskEntryError,
    block_dir,
    entry_name,
    entry_path,
    fingerprint_dir,
    read_entry,
    read_header,
    salt_key,
    write_entry,
)

BAD_KEPT = 4096  # refused file versions remembered (then forgotten at once, and read again at most once more)
WRITER_NICE = 19  # where SCHED_IDLE is not there: the write-behind thread's nice value


def _yield_cpu() -> None:
    """Put the calling thread below every serving thread: Linux's SCHED_IDLE (it runs when a core would idle, e.g.
    between steps), else the highest nice value; on Linux both apply to the thread alone (by its thread id)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    except (AttributeError, OSError):
        pass


@dataclass
class DiskCounters:
    writes: int = 0
    written_bytes: int = 0
    skipped_writes: dict[str, int] = field(default_factory=dict)  # by reason: full queue, disk errors
    hits: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # refused files by reason
    swept: dict[str, int] = field(default_factory=dict)  # files removed by `sweep`, by reason
    stored_files: int = 0  # in the directory, as of the last sweep plus the writes since (all replicas' files)
    stored_bytes: int = 0
    read_s: float = 0.0  # time the hits' reads took, and their bytes: the router's price of a disk hit
    read_bytes: int = 0


@dataclass
class Known:
    """An entry the index knows is on disk: its chain's seed, tokens and bytes, and its mark at one block size."""

    seed: bytes
    tokens: tuple[int, ...]
    nbytes: int
    mark: tuple | None = None  # (block, checkpoint_mark or None), computed on first publication


class DiskTier:
    def __init__(self, root: str | Path, secret: bytes, model_fp: str, codec_fp: str, block: int = 64,
                 max_queue: int = 64, budget_bytes: int | None = None, ttl_s: float = 7 * 24 * 3600.0,
                 sweep_s: float = 60.0, index_limit: int = 4096, reuse_bytes_s: float = 0.0) -> None:
        self.root, self.secret, self.block = Path(root), secret, block
        self.reuse_bytes_s, self._reuse_room, self._reuse_at = reuse_bytes_s, reuse_bytes_s, time.monotonic()
        self.index_limit = index_limit
        self._index: OrderedDict[str, Known] = OrderedDict()  # file path -> entry, least recently used first
        self._index_lock = threading.Lock()
        self._indexed = threading.Event()  # set once the writer thread has indexed the directory
        self._bad: set[tuple] = set()  # versions (path, mtime, size) of files refused: not read again
        self.model_fp, self.codec_fp = model_fp, codec_fp
        self.budget_bytes, self.ttl_s, self.sweep_s = budget_bytes, ttl_s, sweep_s
        self._swept_at, self._closed = float("-inf"), False
        self.counters = DiskCounters()
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._writer = threading.Thread(target=self._write_loop, name="disk-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ write-behind
    def put(self, salt: str | None, tokens: list[int], kind: str | None, tensors: dict[str, torch.Tensor],
            wait_s: float = 0.0) -> bool:
        """Queue one entry for writing (host tensors, not touched afterwards), waiting up to `wait_s` for room in
        the queue (0 on the serving path); False if it was skipped (also when it alone exceeds the budget)."""
        if self._closed:
            self._skip("closed")
            return False
        if self.budget_bytes is not None and sum(t.nbytes for t in tensors.values()) > self.budget_bytes:
            self._skip("larger_than_budget")
            return False
        try:
            self._queue.put((salt, list(tokens), kind, tensors), timeout=wait_s) if wait_s > 0 else \
                self._queue.put_nowait((salt, list(tokens), kind, tensors))
        except queue.Full:
            self._skip("queue_full")
            return False
        return True

    def holds(self, salt: str | None, tokens: list[int]) -> bool:
        """Whether the index knows this entry is on disk (written or read by this tier, or indexed at start)."""
        path = entry_path(self.root, self.secret, self.model_fp, self.codec_fp, salt, tokens, self.block)
        with self._index_lock:
            return str(path) in self._index

    def may_write_reused(self, nbytes: int) -> bool:
        """Whether a reused checkpoint of `nbytes` may be written behind now (and its bytes are taken from the
        bucket): at most `reuse_bytes_s` a second, a second's worth at once (one entry larger than that goes when the
        bucket is full)."""
        if self.reuse_bytes_s <= 0:
            return False
        now = time.monotonic()
        self._reuse_room = min(self.reuse_bytes_s, self._reuse_room + (now - self._reuse_at) * self.reuse_bytes_s)
        self._reuse_at = now
        if self._reuse_room < min(nbytes, self.reuse_bytes_s):
            self._skip("reuse_rate")
            return False
        self._reuse_room -= nbytes
        return True

    def flush(self) -> None:
        """Wait until the directory is indexed and every queued entry is written (or skipped)."""
        self._indexed.wait()
        self._queue.join()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued and end the writer thread (within `timeout_s`); later `put`s are skipped."""
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(timeout_s)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def stats(self) -> dict:
        c = self.counters
        return {"hits": c.hits, "writes": c.writes, "written_bytes": c.written_bytes, "queued": self.queued,
                "indexed": self.indexed,
                "stored_files": c.stored_files, "stored_bytes": c.stored_bytes,
                "skipped_writes": dict(c.skipped_writes), "rejected": dict(c.rejected), "swept": dict(c.swept)}

    def _write_loop(self) -> None:
        _yield_cpu()
        try:
            self._index_directory()
        finally:
            self._indexed.set()
        while True:
            if self.budget_bytes is not None and time.monotonic() - self._swept_at >= self.sweep_s:
                self._swept_at = time.monotonic()
                try:
                    self.sweep(self.budget_bytes, self.ttl_s)
                except OSError:
                    pass
            try:
                item = self._queue.get(timeout=self.sweep_s)
            except queue.Empty:
                continue
            if item is None:  # `close`
                self._queue.task_done()
                return
            salt, tokens, kind, tensors = item
            try:
                path = entry_path(self.root, self.secret, self.model_fp, self.codec_fp, salt, tokens, self.block)
                if str(path) in self._index and path.exists():  # queued twice (a reuse, then an eviction)
                    continue
                seed = chain_seed(salt)
                header = {"model": self.model_fp, "codec": self.codec_fp, "salt": salt_key(self.secret, salt),
                          "seed": seed.hex(), "tokens": tokens, "kind": kind}
                size = write_entry(path, self.secret, header, tensors)
                self._know(path, seed, tokens, sum(t.nbytes for t in tensors.values()))
                self.counters.written_bytes += size
                self.counters.writes += 1
                self.counters.stored_files, self.counters.stored_bytes = (self.counters.stored_files + 1,
                                                                          self.counters.stored_bytes + size)
            except OSError as e:  # a full or unwritable disk: the entry is not kept, nothing else happens
                self._skip(os.strerror(e.errno) if e.errno else type(e).__name__)
            finally:
                self._queue.task_done()

    def _skip(self, reason: str) -> None:
        self.counters.skipped_writes[reason] = self.counters.skipped_writes.get(reason, 0) + 1

    # ------------------------------------------------------------------ lookups
    def find(self, tokens: list[int], limit: int, salt: str | None, above: int = 0
             ) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """(header, tensors) of the deepest entry of `salt` that starts `tokens`, at most `limit` and more than
        `above` deep (directories holding only shallower entries are not read)."""
        key = salt_key(self.secret, salt)
        top = min(limit, len(tokens))
        for k in range(top // self.block, (above + 1) // self.block - 1, -1):
            folder = block_dir(self.root, self.secret, self.model_fp, self.codec_fp, salt, tokens[: k * self.block])
            try:
                names = set(os.listdir(folder))
            except OSError:  # no such directory (or unreadable): nothing filed here
                continue
            # deepest first: the depths this directory may hold, within (above, top], by the names they would have
            for depth in range(min(top, (k + 1) * self.block - 1), max(above, k * self.block - 1), -1):
                name = entry_name(self.secret, folder.name, tokens[k * self.block : depth])
                if name not in names:
                    if str(folder / name) in self._index:  # removed by another replica's eviction
                        self._forget(folder / name)
                    continue
                t0 = time.perf_counter()
                try:
                    st = os.stat(folder / name)
                    version = (str(folder / name), st.st_mtime_ns, st.st_size)
                    if version in self._bad:  # refused before, unchanged since: not read again
                        continue
                    found = read_entry(folder / name, self.secret, self.model_fp, self.codec_fp, key, tokens[:depth])
                except FileNotFoundError:  # removed by another replica's eviction meanwhile
                    self._forget(folder / name)
                    continue
                except DiskEntryError as e:
                    self.refused(e.reason, version)
                    continue
                except OSError:
                    continue
                if len(found[0]["tokens"]) != depth:  # filed under another depth's name: planted or moved
                    self.refused("mismatched", version)
                    continue
                nbytes = sum(t.nbytes for t in found[1].values())
                with self._index_lock:  # lookups run on the step thread and ahead of admission (read-ahead)
                    self.counters.hits += 1
                    self.counters.read_s += time.perf_counter() - t0
                    self.counters.read_bytes += nbytes
                self._know(folder / name, chain_seed(salt), found[0]["tokens"], nbytes)
                return found
        return None

    # ------------------------------------------------------------------ retention
    def sweep(self, budget_bytes: int, ttl_s: float, now: float | None = None) -> None:
        """Remove entries older than `ttl_s`, then, while the directory holds more than `budget_bytes`, entries of
        other model or codec fingerprints (an older model's, or a setting no replica runs any more: other
        replicas on a shared directory may still use theirs, so they go by budget and age, not at once), then the
        oldest of this one."""
        now = time.time() if now is None else now
        mine = fingerprint_dir(self.root, self.secret, self.model_fp, self.codec_fp)
        files = []
        for path in self.root.glob("fp-*/*/*.ckpt"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((path.parent.parent == mine, st.st_mtime, st.st_size, path))
        files.sort()
        total, files_left = sum(f[2] for f in files), len(files)
        for own, mtime, size, path in files:
            reason = "ttl" if mtime < now - ttl_s else "budget" if own and total > budget_bytes else \
                "fingerprint" if total > budget_bytes else None
            if reason is None:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            self._forget(path)
            total -= size
            files_left -= 1
            self._count_swept(reason, 1)
        self.counters.stored_files, self.counters.stored_bytes = files_left, total

    # ------------------------------------------------------------------ the index (routing hints)
    def marks(self, block: int, limit: int | None = None) -> list[tuple[int, int, int, int]]:
        """Per known entry at least one block deep, most recently used first (at most `limit`): its
        `checkpoint_mark` at `block` and its bytes, as a host tier's `marks`."""
        with self._index_lock:
            known = list(reversed(self._index.values()))
        out = []
        for e in known:
            if e.mark is None or e.mark[0] != block:
                tokens = list(e.tokens)
                e.mark = (block, checkpoint_mark(tokens, block, chain=block_hashes(tokens, block, seed=e.seed)))
            if e.mark[1] is not None:
                out.append((*e.mark[1], e.nbytes))
                if limit is not None and len(out) >= limit:
                    break
        return out

    @property
    def read_s_per_byte(self) -> float | None:
        """Measured seconds per byte of the hits' reads so far (None before the first)."""
        c = self.counters
        return c.read_s / c.read_bytes if c.read_bytes else None

    @property
    def indexed(self) -> int:
        return len(self._index)

    def _know(self, path: Path, seed: bytes, tokens: list[int], nbytes: int) -> None:
        with self._index_lock:
            self._index[str(path)] = Known(seed, tuple(tokens), nbytes)
            self._index.move_to_end(str(path))
            while len(self._index) > self.index_limit:
                self._index.popitem(last=False)

    def _forget(self, path: Path) -> None:
        with self._index_lock:
            self._index.pop(str(path), None)

    def _index_directory(self) -> None:
        """Index the entries of this tier's fingerprint already on disk (a restart), newest first, from their
        headers alone: on the writer thread, below every serving thread, before its first write. Entries the
        serving path read meanwhile stay the most recent."""
        mine = fingerprint_dir(self.root, self.secret, self.model_fp, self.codec_fp)
        try:
            files = sorted(((p.stat().st_mtime, p) for p in mine.glob("*/*.ckpt")), key=lambda f: f[0], reverse=True)
        except OSError:
            return
        scanned: OrderedDict[str, Known] = OrderedDict()
        for _, path in files[: self.index_limit]:
            try:
                header = read_header(path)
                seed, tokens = bytes.fromhex(header["seed"]), header["tokens"]
                nbytes = sum(torch.Size(t["shape"]).numel() * DTYPES[t["dtype"]].itemsize for t in header["tensors"])
            except (OSError, DiskEntryError, KeyError, TypeError, ValueError):
                continue  # vanished, refused or written before headers kept their seed: found by lookups only
            if isinstance(tokens, list):
                scanned[str(path)] = Known(seed, tuple(tokens), nbytes)
        with self._index_lock:
            merged = OrderedDict(reversed([(k, v) for k, v in scanned.items() if k not in self._index]))
            merged.update(self._index)
            while len(merged) > self.index_limit:
                merged.popitem(last=False)
            self._index = merged

    def refused(self, reason: str, version: tuple | None = None) -> None:
        """Count a refused file by `reason`; given its `version` (path, mtime, size), it is not read again until it
        changes (a file refused once is refused by every lookup: names are keyed by salt and tokens)."""
        with self._index_lock:
            self.counters.rejected[reason] = self.counters.rejected.get(reason, 0) + 1
            if version is not None:
                if len(self._bad) >= BAD_KEPT:
                    self._bad.clear()
                self._bad.add(version)

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
