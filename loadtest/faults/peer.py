"""Peer fetch faults (issue 40): the main app with peer fetches on (`FETCH_ENGINE`); per round, one replica holds a
fresh long prefix and a burst of concurrent requests shares it, each with its own question, so that the other
replica fetches the prefix from the holder; a moment into the burst the holder is killed (Serve replaces it). Its
fetches then fail over to recomputing and its own requests are retried elsewhere by the ingress: 0 lost requests.
"""

from __future__ import annotations

import asyncio
import random

import httpx

from loadtest.faults.client import Outcome, Target

FETCH_ENGINE = {"peer_fetch": True, "compile_decode": False, "compile_prefill": False}
FETCH_ROUTER = {"stats_period_s": 0.5}


def _text(rng: random.Random, lines: int, tag: str) -> str:
    return "\n".join(f"{tag}_{i} = {rng.randint(0, 99999)}" for i in range(lines))


async def _round(client: httpx.AsyncClient, target: Target, o, rng: random.Random, r: int) -> dict:
    prefix = _text(rng, o.prefix_lines, f"held{r}")
    body = {"model": target.model, "max_tokens": 2, "temperature": 0}
    warm = await client.post(f"{target.url}/v1/completions", json={**body, "prompt": prefix})
    if warm.status_code != 200:
        raise RuntimeError(f"warming the prefix: {warm.status_code} {warm.text[:300]}")
    holder = warm.json()["system_fingerprint"].removeprefix("dasc-")
    await asyncio.sleep(1.5)  # the holder's routing stats publish the prefix's checkpoint

    async def one(k: int) -> int:
        try:
            resp = await client.post(f"{target.url}/v1/completions",
                                     json={**body, "prompt": prefix + "\n" + _text(rng, o.question_lines, f"q{k}")})
            return resp.status_code
        except httpx.HTTPError:
            return 0

    burst = [asyncio.ensure_future(one(k)) for k in range(o.concurrency)]
    await asyncio.sleep(o.kill_after_s)
    killed = await asyncio.to_thread(_kill, target, holder)
    statuses = await asyncio.gather(*burst)
    replaced = await asyncio.to_thread(target.cluster.wait_replicas, "EngineReplica", 2, o.recover_s,
                                       {killed} if killed else set())
    return {"holder": holder, "killed": killed is not None, "statuses": statuses, "replaced_after_s": replaced}


def _kill(target: Target, replica: str) -> str | None:
    """Kill the engine replica whose id is `replica`; -> its actor name (None if it is not there)."""
    import ray

    for actor in target.cluster.actors("EngineReplica"):
        if actor["Name"].endswith(replica):
            ray.kill(ray.get_actor(actor["Name"], namespace="serve"), no_restart=True)
            return actor["Name"]
    return None


async def fetch_counters(client: httpx.AsyncClient, url: str) -> dict:
    """The peer-fetch counters of every replica in /status, summed (failures as "failed <reason>")."""
    out: dict = {}
    for snap in (await client.get(f"{url}/status")).json().get("replicas", {}).values():
        fetch = snap.get("peer_fetch") or {}
        for k in ("fetches", "joined"):
            out[k] = out.get(k, 0) + fetch.get(k, 0)
        for reason, n in (fetch.get("failed") or {}).items():
            out[f"failed {reason}"] = out.get(f"failed {reason}", 0) + n
    return out


def holder_kill(target: Target, o) -> Outcome:
    """`o.rounds` rounds; the fetch counters are read from every replica alive at the end (a killed replica's are
    gone with it)."""
    out, rng = Outcome(), random.Random(40)

    async def main():
        async with httpx.AsyncClient(timeout=o.timeout_s) as client:
            rounds = [await _round(client, target, o, rng, r) for r in range(o.rounds)]
            await asyncio.sleep(2.0)
            return rounds, await fetch_counters(client, target.url)

    rounds, counters = asyncio.run(main())
    statuses = [s for r in rounds for s in r["statuses"]]
    lost = [s for s in statuses if s != 200]
    out.figures.update(requests=len(statuses), by_status={str(s): statuses.count(s) for s in sorted(set(statuses))},
                       holders_killed=sum(r["killed"] for r in rounds),
                       replaced_after_s=[r["replaced_after_s"] for r in rounds], fetches_alive_replicas=counters)
    out.check("holders killed", all(r["killed"] for r in rounds), f"{o.rounds}", sum(r["killed"] for r in rounds))
    out.check("0 lost requests", not lost, "every request 200", len(lost))
    out.check("holder replaced", all(r["replaced_after_s"] is not None for r in rounds), f"within {o.recover_s:g} s",
              [r["replaced_after_s"] for r in rounds])
    return out

