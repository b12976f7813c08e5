"""Disk tier faults (issue 39): the Ray app with a disk tier under one-slot-deep pools (`DISK_ENGINE`: the host
tier off, so every checkpoint the pools evict goes to disk, and the recurring prompts come back from it), under a
load of 16 clients cycling over long prompts, while the directory is damaged:
- `corrupted`: files torn, altered, emptied and planted (garbage under an entry's name) every fraction of a
  second while serving;
- `unwritable`: the directory replaced by a file mid-run (root ignores permission bits, so this is how it stops
  being writable here);
- `tiny` (its own app, `disk_mb` below one entry): nothing fits, nothing is written.
Each asserts 0 5xx and 0 lost requests, that the greedy answers of the prompts, asked one at a time after the
fault, equal the ones asked before it, and that the fault was met (files refused, writes skipped).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

import httpx

from loadtest.faults.client import Outcome, Target
from loadtest.faults.service import wait_idle

SECRET_ENV = "DASC_DISK_SECRET"
DISK_ENGINE = {"host_mb": 0, "checkpoint_budget_mb": 0.5, "disk_mb": 256, "compile_decode": False,
               "compile_prefill": False}
TINY_MB = 0.05  # below one kda-tiny entry (a dense checkpoint alone is about 128 KiB)
PROMPTS = 12
MAX_TOKENS = 8


def prompts(seed: int = 39) -> list[str]:
    """`PROMPTS` distinct prompts of a few hundred tokens each (several 64-token blocks)."""
    rng = random.Random(seed)
    return ["\n".join(f"record_{p}_{i} = {rng.randint(0, 99999)}" for i in range(40)) for p in range(PROMPTS)]


async def _ask(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> tuple[int, str]:
    try:
        r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                                             "max_tokens": MAX_TOKENS})
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]


async def _answers(client, url: str, model: str, asks: list[str]) -> list[tuple[int, str]]:
    return [await _ask(client, url, model, p) for p in asks]


async def _load(client, url: str, model: str, asks: list[str], concurrency: int, until: float) -> list[int]:
    """Statuses of `concurrency` clients each asking the prompts in its own shuffled order until `until`."""
    statuses: list[int] = []

    async def one(c: int) -> None:
        rng = random.Random(c)
        while time.monotonic() < until:
            order = list(asks)
            rng.shuffle(order)
            for p in order:
                if time.monotonic() >= until:
                    return
                statuses.append((await _ask(client, url, model, p))[0])

    await asyncio.gather(*(one(c) for c in range(concurrency)))
    return statuses


async def _disk_stats(client, url: str, replicas: int, within_s: float) -> dict:
    """The disk tier counters of all `replicas`, summed (reasons merged), from snapshots reported after this call
    began (a telemetry window later)."""
    deadline = time.monotonic() + within_s
    while True:
        _, _, snaps = await wait_idle(client, url, max(1.0, deadline - time.monotonic()))
        if len(snaps) >= replicas or time.monotonic() >= deadline:
            break
    out: dict = {"replicas": len(snaps), "hits": 0, "writes": 0, "rejected": {}, "skipped_writes": {}}
    for snap in snaps.values():
        disk = snap.get("disk_tier") or {}
        for k in ("hits", "writes"):
            out[k] += disk.get(k, 0)
        for k in ("rejected", "skipped_writes"):
            for reason, n in (disk.get(k) or {}).items():
                out[k][reason] = out[k].get(reason, 0) + n
    return out


def _run(target: Target, o, fault, during_s: float | None = None) -> tuple[Outcome, dict]:
    """Reference answers, then the load with `fault(root, stop_at)` running beside it, then the answers again;
    -> the outcome with the common criteria, and the disk counters after."""
    root = Path(target.cluster.args["engine"]["disk_dir"])
    asks, replicas = prompts(), target.cluster.args.get("replicas", 2)
    out = Outcome()

    async def main():
        async with httpx.AsyncClient(timeout=o.timeout_s) as client:
            before = await _answers(client, target.url, target.model, asks)
            start = await _disk_stats(client, target.url, replicas, o.settle_s)
            until = time.monotonic() + (during_s or o.duration_s)
            damage = asyncio.create_task(asyncio.to_thread(fault, root, until))
            statuses = await _load(client, target.url, target.model, asks, o.concurrency, until)
            await damage
            after = await _answers(client, target.url, target.model, asks)
            return before, start, statuses, after, await _disk_stats(client, target.url, replicas, o.settle_s)

    before, start, statuses, after, end = asyncio.run(main())
    fails = [s for s in statuses if s != 200]
    out.check("every replica reported", start["replicas"] == end["replicas"] == replicas, f"{replicas}",
              [start["replicas"], end["replicas"]])
    out.figures.update(requests=len(statuses), by_status={str(s): statuses.count(s) for s in sorted(set(statuses))},
                       disk_before_fault=start, disk_after=end)
    out.check("no 5xx", not any(s >= 500 for s in statuses), "0", sum(s >= 500 for s in statuses))
    out.check("no lost request", not fails, "0 non-200 answers", len(fails))
    out.check("reference answers 200", all(s == 200 for s, _ in before + after), "all", [s for s, _ in before + after])
    same = sum(a == b for a, b in zip(before, after))
    out.check("answers as before the fault", same == len(asks), f"{len(asks)} of {len(asks)}", same)
    for i, (a, b) in enumerate(zip(before, after)):
        if a != b:
            out.find(prompt=i, before=a, after=b)
    return out, end


def _damage(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    how = rng.choice(("torn", "flip", "empty", "garbage"))
    if how == "torn":
        data = data[: rng.randint(0, max(0, len(data) - 1))]
    elif how == "flip" and data:
        at = rng.randrange(len(data))
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    elif how == "empty":
        data = b""
    else:
        data = rng.randbytes(rng.randint(1, 4096))
    path.write_bytes(data)


def corrupted(target: Target, o) -> Outcome:
    """Files damaged every `every_s` while serving; then every file, before the answers are asked again."""
    rng = random.Random(7)
    damaged = [0]

    def fault(root: Path, until: float) -> None:
        while time.monotonic() < until:
            files = sorted(root.rglob("*.ckpt"))
            for path in rng.sample(files, min(len(files), 3)):
                try:
                    _damage(path, rng)
                    damaged[0] += 1
                except OSError:  # removed by its replica meanwhile
                    pass
            time.sleep(o.every_s)
        for path in root.rglob("*.ckpt"):
            _damage(path, rng)
            damaged[0] += 1

    out, end = _run(target, o, fault)
    refused = sum(end["rejected"].values())
    out.check("entries written and read back", end["writes"] > 0 and end["hits"] > 0, "> 0 each",
              {"writes": end["writes"], "hits": end["hits"]})
    out.figures["files_damaged"] = damaged[0]
    out.check("damaged files met and refused", refused > 0, "> 0 refused", end["rejected"])
    return out


def unwritable(target: Target, o) -> Outcome:
    """A third of the way into the load, the directory is moved away and a file put in its place."""
    def fault(root: Path, until: float) -> None:
        time.sleep(max(0.0, (until - time.monotonic()) / 3))
        shutil.move(root, root.with_name(root.name + ".moved"))
        root.write_text("no longer a directory")

    out, end = _run(target, o, fault)
    skipped = sum(end["skipped_writes"].values())
    out.check("entries written before the fault", out.figures["disk_before_fault"]["writes"] > 0, "> 0",
              out.figures["disk_before_fault"]["writes"])
    out.check("writes skipped and counted", skipped > 0, "> 0 skipped", end["skipped_writes"])
    return out


def tiny(target: Target, o) -> Outcome:
    """`disk_mb` below one entry: every write is skipped as too large; the directory stays within it."""
    out, end = _run(target, o, lambda root, until: None)
    root = Path(target.cluster.args["engine"]["disk_dir"])
    held = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    out.figures["bytes_on_disk"] = held
    out.check("directory within disk_mb", held <= TINY_MB * 2**20, f"<= {TINY_MB * 2**20:.0f} bytes", held)
    skipped = end["skipped_writes"].get("larger_than_budget", 0)
    out.check("entries too large skipped", skipped > 0 and end["writes"] == 0, "> 0 skipped, 0 written",
              {"skipped": end["skipped_writes"], "writes": end["writes"]})
    return out
