"""Peer fetch faults (issue 40): the main app with peer fetches on (`FETCH_ENGINE`); per round, one replica holds a
fresh long prefix and a burst of concurrent requests shares it, each with its own question, so that the other
replica fetches the prefix from the holder; as soon as that replica reports a fetch under way (polled live through
`EngineReplica.peer_fetch_status`), the holder is killed (Serve replaces it). The fetch then fails over to
recomputing and the holder's own requests are retried elsewhere by the ingress: 0 lost requests. Per round, the
fetcher's failed fetches by reason (its counters before and after) show the kill cut the fetch.
"""

from __future__ import annotations

import asyncio
import random
import time

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

    fetcher = next((a["Name"].rsplit("#", 1)[-1] for a in target.cluster.actors("EngineReplica")
                    if not a["Name"].endswith(holder)), None)
    before = await asyncio.to_thread(_status, fetcher) if fetcher else None
    burst = [asyncio.ensure_future(one(k)) for k in range(o.concurrency)]
    waited = await asyncio.to_thread(_until_fetching, fetcher, o.fetch_wait_s) if fetcher else None
    killed = await asyncio.to_thread(_kill, target, holder)
    statuses = await asyncio.gather(*burst)
    replaced = await asyncio.to_thread(target.cluster.wait_replicas, "EngineReplica", 2, o.recover_s,
                                       {killed} if killed else set())
    after = await asyncio.to_thread(_status, fetcher) if fetcher else None
    failed = {} if not (before and after and after["replica"] == fetcher) else {
        k: n - before["failed"].get(k, 0) for k, n in after["failed"].items() if n > before["failed"].get(k, 0)}
    return {"holder": holder, "killed": killed is not None, "statuses": statuses, "replaced_after_s": replaced,
            "killed_mid_fetch": waited is not None, "fetch_began_s": waited, "fetches_failed": failed}


def _status(replica: str) -> dict:
    """The live peer-fetch status of `replica` (`EngineReplica.peer_fetch_status`, pinned to it by the router)."""
    from ray import serve

    from deployments.messages import FetchStatusRequest
    from loadtest.faults.cluster import APP

    handle = serve.get_deployment_handle("EngineReplica", APP)
    return handle.peer_fetch_status.remote(FetchStatusRequest(route_to=replica)).result(timeout_s=5.0)


def _until_fetching(replica: str, within_s: float) -> float | None:
    """Seconds until `replica` has a peer fetch under way (polled every 10 ms); None if none began within `within_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        status = _status(replica)
        if status["replica"] == replica and status["in_flight"]:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


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
                       replaced_after_s=[r["replaced_after_s"] for r in rounds], fetches_alive_replicas=counters,
                       fetch_began_s=[r["fetch_began_s"] for r in rounds],
                       fetches_failed_per_round=[r["fetches_failed"] for r in rounds])
    out.check("holders killed", all(r["killed"] for r in rounds), f"{o.rounds}", sum(r["killed"] for r in rounds))
    out.check("killed mid-fetch", all(r["killed_mid_fetch"] for r in rounds),
              "a fetch from the holder under way at each kill", [r["fetch_began_s"] for r in rounds])
    out.check("0 lost requests", not lost, "every request 200", len(lost))
    out.check("holder replaced", all(r["replaced_after_s"] is not None for r in rounds), f"within {o.recover_s:g} s",
              [r["replaced_after_s"] for r in rounds])
    return out

