"""Load scenarios over HTTP alone: the disconnect storm, the overload burst, the soak.

Each is bounded by a request count and a time budget. Replica checks that HTTP cannot make (the engine's
`check_integrity`, replica process ids for RSS) come from `target.cluster` when the target is a Ray app, or
from `target.pid` for a local server.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from loadtest.faults.client import Outcome, is_openai_error, tally
from loadtest.faults.service import busy, dropped_stream, greedy, settings_of, stream_body, wait_idle

DROPS = ("sent", "headers", "token", "tokens", "timeout")


async def _storm(target, o) -> Outcome:
    out = Outcome()
    async with httpx.AsyncClient() as client:
        idle0, _, snaps0 = await wait_idle(client, target.url, 120)
        before, setting0 = await greedy(client, target.url, target.model), settings_of(snaps0)
        rng, sem, seen = random.Random(0), asyncio.Semaphore(o.concurrency), []
        deadline = time.monotonic() + o.budget_s

        async def one(i: int) -> None:
            async with sem:
                if time.monotonic() < deadline:
                    seen.append(await dropped_stream(target.url, stream_body(target.model, rng), DROPS[i % 5],
                                                     o.timeout_s))

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(o.streams)))
        storm_s = time.monotonic() - t0
        idle, waited, snaps1 = await wait_idle(client, target.url, 60)
        after = await greedy(client, target.url, target.model)
        integrity = await asyncio.to_thread(target.cluster.integrity) if target.cluster else None
    out.figures = {"streams": len(seen), "storm_s": round(storm_s, 1), "answered_200": sum(s["status"] == 200
                   for s in seen), "dropped_after_a_token": sum(s["events"] > 0 for s in seen),
                   "idle_after_s": round(waited, 1), "state_slots_free": _per(snaps0, snaps1, "state_slots_free"),
                   "kv_slots_free": _per(snaps0, snaps1, "kv_slots_free"), "setting": settings_of(snaps1)}
    out.check("streams dropped", len(seen) >= o.streams, f"{o.streams} within {o.budget_s:g} s", len(seen))
    out.check("0 running sequences", idle0 and idle, "0 running or waiting within 60 s", busy(snaps1))
    free0 = {k: v.get("state_slots_free") for k, v in snaps0.items()}
    free1 = {k: v.get("state_slots_free") for k, v in snaps1.items()}
    out.check("0 leaked state slots", free0 == free1, "state slots free as before", free1)
    if integrity is not None:
        bad = [r for r in integrity if not r.get("ok")]
        out.check("check_integrity on every replica", not bad and integrity, "every replica ok (KV and state slots)",
                  integrity)
    else:
        out.figures["check_integrity"] = "not reachable over HTTP (local server): state slots and running only"
    out.check("greedy outputs unchanged", before == after and setting0 == settings_of(snaps1),
              "same text at the same cache setting", "same" if before == after else {"before": before, "after": after})
    return out


def _per(a: dict, b: dict, key: str) -> dict:
    return {rid: [a.get(rid, {}).get(key), b.get(rid, {}).get(key)] for rid in sorted(set(a) | set(b))}


def storm(target, opts) -> Outcome:
    """`opts.streams` streams opened and dropped at every stage (`DROPS`), `opts.concurrency` at a time."""
    return asyncio.run(_storm(target, opts))


async def _overload(target, o) -> Outcome:
    out, kinds = Outcome(), []
    limits = httpx.Limits(max_connections=o.burst + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=o.timeout_s) as client:
        async def one(i: int) -> None:
            body = {"model": target.model, "prompt": f"burst {i}: the list of", "max_tokens": o.max_tokens,
                    "ignore_eos": True}
            try:
                r = await client.post(f"{target.url}/v1/completions", json=body)
            except httpx.TimeoutException:
                kinds.append("timeout")
                return
            except httpx.HTTPError as exc:
                kinds.append("connection_error")
                out.find(kind="connection_error", error=repr(exc)[:200])
                return
            kind = str(r.status_code)
            if r.status_code in (429, 503):
                ok = "retry-after" in r.headers and _json_error(r)
                kind += "" if ok else "_without_retry_after_json"
            kinds.append(kind)
            if r.status_code >= 500 and r.status_code != 503:
                out.find(kind=kind, answer=r.text[:300])

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(o.burst)))
        burst_s = time.monotonic() - t0
        recovered, recover_s = await _recovers(client, target, o.recover_s)
    counts = tally(kinds)
    out.figures = {"burst": o.burst, "max_tokens": o.max_tokens, "burst_s": round(burst_s, 1), "by_answer": counts,
                   "recovered_after_s": round(recover_s, 1)}
    out.check("429s under overload", counts.get("429", 0) > 0, ">= 1 (with Retry-After, OpenAI JSON)",
              counts.get("429", 0))
    out.check("no timeouts", not counts.get("timeout"), f"0 (client timeout {o.timeout_s:g} s)",
              counts.get("timeout", 0))
    bad = {k: v for k, v in counts.items() if k not in ("200", "429", "503", "timeout")}
    out.check("no other failures", not bad, "only 200, 429 or 503 with Retry-After", bad or 0)
    out.check("recovers", recovered, f"a request answered 200 within {o.recover_s:g} s after the burst",
              round(recover_s, 1))
    return out


def _json_error(r: httpx.Response) -> bool:
    try:
        return is_openai_error(r.json())
    except ValueError:
        return False


async def _recovers(client: httpx.AsyncClient, target, within_s: float) -> tuple[bool, float]:
    """Whether a small request is answered 200 within `within_s`; -> (ok, seconds)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            r = await client.post(f"{target.url}/v1/completions", timeout=max(1.0, within_s - (time.monotonic() - t0)),
                                  json={"model": target.model, "prompt": "ok", "max_tokens": 2})
            if r.status_code == 200:
                return True, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    return False, time.monotonic() - t0


def overload(target, opts) -> Outcome:
    """`opts.burst` long requests at once; then whether a small one is served again."""
    return asyncio.run(_overload(target, opts))


def soak(target, opts) -> Outcome:
    """Steady mixed load for `opts.duration_s` (see loadtest.faults.soak)."""
    from loadtest.faults.soak import run

    return run(target, opts)
