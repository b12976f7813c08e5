"""Cache tiers benchmark: `python -m loadtest.bench_tiers [--out docs/benchmarks.md]` (about 10 minutes on 2 cores).

The paper's reuse-distance replay (appendix C.2: phases of distinct prompts whose number shrinks; per phase an
untimed cache fill of its prompts, then a timed replay of them in a seeded shuffled order; one output token) with
prompts of 1-3k tokens, on one in-process engine (kda-tiny, eager), requests one at a time. Only replay requests
enter the figures, as in the paper. The pools (checkpoint slots and KV slots) are sized so that the largest phase's
working set is --ratios times what they hold (4 and 16). Arms, each on a fresh engine:
- no tier: the pools alone;
- host: a host tier of 4x the pools' bytes (at 4x the working set fits pools + host);
- ceiling: pools that hold every prompt of the replay.
Each runs with dense checkpoints and with dasc nr-W16, the dasc host tier given the dense arm's bytes (so it holds
more states per byte, though on the zoo a long prompt's KV outweighs its state).

Reported per arm as medians over --seeds, over the replay requests: the hit rate (cached over prompt tokens), mean
and p90 TTFT (from adding the request to its first token), the host tier's entries and bytes by kind at the end,
and the time its promotions took against the prefill they saved (promoted tokens at the no-tier arm's measured
prefill seconds per token). Results: loadtest/results/bench_tiers_cpu.json; --out DOC replaces the block in DOC.

`--section disk` (about 10 minutes) measures the disk tier, each arm on fresh engines and a fresh directory:
- restart: --restart-prefixes distinct prefixes of --restart-tokens tokens (24 of 2k), each asked once, then a
  restart (a new engine in this process on the same directory and secret, with empty pools: the page cache stays
  warm, as on a restarted replica of the same machine), then each asked again; pools holding a quarter of them and
  the host tier off (every eviction written). Restarts: "graceful" (the stopping engine persists what its pools
  hold, as a replica's shutdown does), "crash" (only what was written behind before it), "no disk". Reported: the
  share of prefixes resumed, the hit rate and mean TTFT after the restart, per codec;
- write-behind cost: the reuse-distance replay above (dense, pools at 4x, --decode-tokens per request), with the
  disk tier off, "writes" (written behind, lookups disabled: the writes' cost alone) and "on" (written and read),
  one engine each, interleaved request by request (`cost_arms`); mean TTFT and decode tok/s over the replay
  requests, as medians of per-seed ratios against "off".

`--section stops` (about 10 minutes, loadtest/tiers_stops.py) stops and restarts `python -m app.api.local` with a
disk tier: a graceful stop (SIGINT), a crash (SIGKILL) after reused checkpoints were written behind, the same crash
without those writes, and no disk tier; the share of prompts resumed after the restart and their TTFT.

`--section peer` (about 5 minutes, loadtest/tiers_peer.py) measures checkpoints fetched between two replicas on two
Ray nodes; `--section shapes` (seconds, loadtest/tiers_shapes.py) computes what such a fetch moves and when it beats
recomputing at Kimi-Linear-48B's and Qwen3-Next-80B's shapes (nothing timed).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from app.engine.config import EngineConfig
from app.engine.engine import DISK_SECRET_ENV, Engine
from app.engine.request import SamplingParams
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest import tiers_peer, tiers_shapes, tiers_stops
from loadtest.common import start_run, table
from loadtest.sections import publish
from loadtest.workloads import text_block

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
CODECS = {"dense": {}, "dasc nr-W16": {"w_max": 16.0, "policy": "nr"}}


def replay(tok: Tokenizer, seed: int, phases: tuple[int, ...], lo: int, hi: int) -> tuple[list, list]:
    """(the requests in order as (prompt, timed), each phase's distinct prompts): prompts of `lo`-`hi` tokens; per
    phase its fill (untimed, in order), then its replay (timed, shuffled)."""
    rng = random.Random(seed)
    order, distinct = [], []
    for p, size in enumerate(phases):
        prompts = [tok.encode(text_block(rng, f"s{seed}p{p}i{i}", hi // 8))[: rng.randint(lo, hi)] for i in range(size)]
        walk = list(prompts)
        rng.shuffle(walk)
        order += [(q, False) for q in prompts] + [(q, True) for q in walk]
        distinct.append(prompts)
    return order, distinct


def sizes(distinct: list, ratio: float | None, margin: int) -> dict:
    """Pool knobs holding 1/ratio of the largest phase's working set (None: every prompt of the replay)."""
    if ratio is None:  # two checkpoints a prompt: its end, and (under a recompute tail) its generation end
        return {"checkpoint_slots": 2 * sum(len(p) for p in distinct) + 4,
                "kv_slots": sum(len(t) for p in distinct for t in p) + margin}
    largest = max(distinct, key=lambda p: sum(map(len, p)))
    return {"checkpoint_slots": max(1, round(len(largest) / ratio)),
            "kv_slots": max(round(sum(map(len, largest)) / ratio), margin)}


def serve(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, cached tokens) of one request run alone."""
    t0 = time.perf_counter()
    engine.add_request(prompt, PARAMS)
    ttft, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft, cached = time.perf_counter() - t0, out.cached_tokens
    return ttft, cached


def run_arm(model, tok, order: list, knobs: dict) -> dict:
    engine = Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False, **knobs))
    ttfts, cached, prompt_tokens = [], 0, 0
    for prompt, timed in order:
        t, c = serve(engine, prompt)
        if timed:
            ttfts.append(t)
            cached, prompt_tokens = cached + c, prompt_tokens + len(prompt)
    engine.check_integrity()
    snap = engine.snapshot()
    host = engine.cache.host
    out = {"hit_rate": cached / prompt_tokens, "ttft_mean_ms": statistics.fmean(ttfts) * 1e3,
           "ttft_p90_ms": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] * 1e3,
           "prefill_s_per_token": sum(ttfts) / max(1, prompt_tokens - cached),
           "pool_bytes": snap["checkpoint_bytes_allocated"] + knobs["kv_slots"] * engine.worker.kv.bytes_per_token,
           "state_bytes_per_slot": snap["checkpoint_bytes_per_slot"]}
    if host is not None:
        s = host.stats()
        out.update(host_entries=s["entries"], host_state_mb=s["state_bytes"] / 2**20, host_kv_mb=s["kv_bytes"] / 2**20,
                   promotions=s["promotions"], promoted_tokens=s["promoted_tokens"], demotions=s["demotions"],
                   promotion_s=host.counters.load_s, host_mb=knobs["host_mb"])
    return out


def run_seed(model, tok, seed: int, args) -> dict:
    order, distinct = replay(tok, seed, tuple(args.phases), args.min_tokens, args.max_tokens)
    margin = args.max_tokens + 64
    rows = {}
    for ratio in args.ratios:
        pools = sizes(distinct, ratio, margin)
        dense_host_mb = None
        for codec, cknobs in CODECS.items():
            base = run_arm(model, tok, order, {**pools, **cknobs})
            rows[f"{ratio}x/{codec}/no tier"] = base
            host_mb = dense_host_mb or 4 * base["pool_bytes"] / 2**20
            dense_host_mb = dense_host_mb or host_mb
            host = run_arm(model, tok, order, {**pools, **cknobs, "host_mb": host_mb})
            host["recompute_saved_s"] = host["promoted_tokens"] * base["prefill_s_per_token"]
            rows[f"{ratio}x/{codec}/host"] = host
            if ratio == args.ratios[0]:
                rows[f"{ratio}x/{codec}/ceiling"] = run_arm(model, tok, order, {**sizes(distinct, None, margin),
                                                                                 **cknobs})
            print(seed, ratio, codec, {k: round(v["hit_rate"], 3) for k, v in rows.items()}, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- the disk tier
DISK_SECRET = "bench-tiers-secret"  # DASC_DISK_SECRET of the disk arms (a fresh directory each)


def _disk_engine(model, tok, root: Path | None, knobs: dict, lookups: bool = True) -> Engine:
    """An engine with a disk tier in `root` (None: none); `lookups` False: written behind, never read (the
    cost of the writes alone)."""
    os.environ[DISK_SECRET_ENV] = DISK_SECRET
    engine = Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False, **knobs,
                                             **({"disk_dir": str(root)} if root else {})))
    if root and not lookups:
        engine.cache.disk.find = lambda *a, **k: None
    return engine


def restart_arm(model, tok, prefixes: list, knobs: dict, mode: str) -> dict:
    """Each prefix once on one engine, a restart (`mode`: "graceful" persists first, as a replica's stop does;
    "crash" keeps only what was written behind; "no disk"), each prefix again on a new engine: the second pass's
    hit rate and mean TTFT, and the first pass's (cold) mean TTFT."""
    with tempfile.TemporaryDirectory(prefix="bench-tiers-disk-") as tmp:
        root = None if mode == "no disk" else Path(tmp) / "tier"
        first = _disk_engine(model, tok, root, knobs)
        cold = [serve(first, p)[0] for p in prefixes]
        if mode == "graceful":
            first.persist()
        elif root is not None:
            first.cache.disk.flush()
        written = first.cache.disk.counters.writes if root else 0
        again = _disk_engine(model, tok, root, knobs)
        warm = [serve(again, p) for p in prefixes]
        again.check_integrity()
        for engine in (first, again):
            if engine.cache.disk is not None:
                engine.cache.disk.close()  # before its directory goes
    return {"hit_rate": sum(c for _, c in warm) / sum(len(p) for p in prefixes),
            "resumed": sum(c > 0 for _, c in warm) / len(prefixes), "ttft_mean_ms": statistics.fmean(
                t for t, _ in warm) * 1e3, "cold_ttft_mean_ms": statistics.fmean(cold) * 1e3, "written": written}


def serve_decode(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
    """(TTFT, decode seconds after the first token, tokens after the first) of one request run alone."""
    t0 = time.perf_counter()
    engine.add_request(prompt, params)
    first = last = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter()
                first = first or now
                last, n = now, n + len(out.new_token_ids)
    return first - t0, last - first, n - 1


def cost_arms(model, tok, order: list, knobs: dict, arms: tuple[str, ...], decode: int) -> dict:
    """The reuse-distance replay with `decode` tokens per request on one engine per arm (the disk tier off, written
    behind only: "writes", or written and read: "on"), interleaved request by request in an order that rotates, so
    that the machine's drift falls on every arm alike; each engine's queued writes are finished (untimed) before
    another engine serves. Per arm: mean TTFT and decode tok/s over the replay requests, and its disk counters."""
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="bench-tiers-disk-") as tmp:
        engines = {a: _disk_engine(model, tok, None if a == "off" else Path(tmp) / a, knobs, a == "on") for a in arms}
        seen = {a: {"ttfts": [], "decode_s": 0.0, "decoded": 0} for a in arms}
        for i, (prompt, timed) in enumerate(order):
            for a in arms[i % len(arms):] + arms[: i % len(arms)]:
                t, d, n = serve_decode(engines[a], prompt, params)
                if engines[a].cache.disk is not None:
                    engines[a].cache.disk.flush()
                if timed:
                    seen[a]["ttfts"].append(t)
                    seen[a]["decode_s"], seen[a]["decoded"] = seen[a]["decode_s"] + d, seen[a]["decoded"] + n
        out = {}
        for a, engine in engines.items():
            stats = engine.cache.disk.stats() if engine.cache.disk else {}
            if engine.cache.disk is not None:
                engine.cache.disk.close()  # before its directory goes
            out[a] = {"ttft_mean_ms": statistics.fmean(seen[a]["ttfts"]) * 1e3,
                      "decode_tok_s": seen[a]["decoded"] / seen[a]["decode_s"], "writes": stats.get("writes", 0),
                      "written_mb": stats.get("written_bytes", 0) / 2**20, "disk_hits": stats.get("hits", 0),
                      "skipped_writes": sum(stats.get("skipped_writes", {}).values())}
    return out


def run_disk_seed(model, tok, seed: int, args) -> dict:
    rng = random.Random(seed)
    prefixes = [tok.encode(text_block(rng, f"restart{seed}i{i}", args.restart_tokens // 4))[: args.restart_tokens]
                for i in range(args.restart_prefixes)]
    rows = {}
    for codec, cknobs in CODECS.items():
        pools = sizes([prefixes], 4.0, args.restart_tokens + 64)  # the pools hold a quarter of the prefixes
        for mode in ("no disk", "crash", "graceful"):
            rows[f"restart/{codec}/{mode}"] = restart_arm(model, tok, prefixes, {**pools, **cknobs}, mode)
        print(seed, codec, {k: round(v["hit_rate"], 3) for k, v in rows.items()}, flush=True)
    order, distinct = replay(tok, seed, tuple(args.phases), args.min_tokens, args.max_tokens)
    pools = sizes(distinct, 4.0, args.max_tokens + 64)
    for disk, row in cost_arms(model, tok, order, pools, ("off", "writes", "on"), args.decode_tokens).items():
        rows[f"cost/dense/{disk}"] = row
    print(seed, {k: round(v["ttft_mean_ms"], 1) for k, v in rows.items() if k.startswith("cost")}, flush=True)
    return rows


def report_disk(seeds: list[dict]) -> str:
    med = {a: {k: statistics.median(s[a][k] for s in seeds) for k in seeds[0][a]} for a in seeds[0]}

    def ratio(a: str, b: str, key: str) -> float:
        return statistics.median(s[a][key] / s[b][key] for s in seeds)

    rows = [[a.removeprefix("restart/"), m["resumed"], m["hit_rate"], m["ttft_mean_ms"], m["cold_ttft_mean_ms"],
             m["written"]] for a, m in med.items() if a.startswith("restart/")]
    md = "Restart: each prefix once, a restart, each again (medians over seeds).\n\n" + table(
        ["codec/restart", "prefixes resumed", "hit rate", "TTFT mean ms after", "TTFT mean ms cold", "entries written"],
        rows)
    rows = [[a.removeprefix("cost/"), m["ttft_mean_ms"], m["decode_tok_s"], m["writes"], m["written_mb"],
             m["disk_hits"], m["skipped_writes"]] for a, m in med.items() if a.startswith("cost/")]
    md += "\n\nWrite-behind cost under the reuse-distance replay (host tier off: every checkpoint the pools evict is " \
          "written).\n\n" + table(["codec/disk tier", "TTFT mean ms", "decode tok/s", "entries written",
                                     "MB written", "disk hits", "writes skipped"], rows)
    lines = []
    for codec in CODECS:
        g, n = med[f"restart/{codec}/graceful"], med[f"restart/{codec}/no disk"]
        lines.append(f"- {codec}: after a graceful restart {g['resumed']:.2f} of the prefixes resume from disk "
                     f"(hit rate {g['hit_rate']:.3f}; without the disk tier {n['resumed']:.2f}); mean TTFT "
                     f"{ratio(f'restart/{codec}/graceful', f'restart/{codec}/no disk', 'ttft_mean_ms'):.2f}x the "
                     f"no-disk restart's; after a crash {med[f'restart/{codec}/crash']['resumed']:.2f} resume "
                     "(what the pools evicted before it).")
    lines.append(f"- Write-behind alone (entries written, never read) against no disk tier: mean TTFT "
                 f"{ratio('cost/dense/writes', 'cost/dense/off', 'ttft_mean_ms'):.3f}x, decode tok/s "
                 f"{ratio('cost/dense/writes', 'cost/dense/off', 'decode_tok_s'):.3f}x; written and read: TTFT "
                 f"{ratio('cost/dense/on', 'cost/dense/off', 'ttft_mean_ms'):.3f}x, decode tok/s "
                 f"{ratio('cost/dense/on', 'cost/dense/off', 'decode_tok_s'):.3f}x (medians of per-seed ratios).")
    return md + "\n\n" + "\n".join(lines) + "\n"


def report_peer(results: dict) -> str:
    """The peer section's tables: per arm and prompt length, the medians over repeats; the hot prefix per arm."""
    rows = []
    for arm, res in results.items():
        for n in sorted({t["tokens"] for t in res["trials"]}):
            ts = [t for t in res["trials"] if t["tokens"] == n]
            fetch, cold = statistics.median(t["fetch_s"] for t in ts), statistics.median(t["recompute_s"] for t in ts)
            rows.append([arm, n, res["nodes"], fetch * 1e3, cold * 1e3,
                         statistics.median(t["fetch_s"] / t["recompute_s"] for t in ts),
                         statistics.median(t["bytes"] for t in ts) / 2**20,
                         statistics.median(t["cached"] for t in ts)])
    md = "One request: fetch against recompute on the fetching replica (medians over repeats).\n\n" + table(
        ["arm", "prompt tokens", "nodes", "TTFT fetch ms", "TTFT recompute ms", "fetch / recompute", "MB moved",
         "cached tokens"], rows)
    hot = [[arm, res["hot"]["ttft_mean_s"] * 1e3, res["hot"]["ttft_p90_s"] * 1e3, res["hot"]["replicas_used"],
            res["hot"]["cached_mean"], ", ".join(f"{k} {v}" for k, v in sorted(res["hot"]["fetches"].items())) or "-"]
           for arm, res in results.items()]
    md += "\n\nHot prefix: concurrent requests sharing one prefix held by one replica (medians over bursts)."
    md += "\n\n" + table(
        ["arm", "TTFT mean ms", "TTFT p90 ms", "replicas used", "cached tokens (mean)", "fetches (all replicas)"], hot)
    for codec in ("dense", "dasc nr-W16"):
        on, off = results.get(f"{codec}/fetch", {}).get("hot"), results.get(f"{codec}/no fetch", {}).get("hot")
        if on and off:
            md += (f"\n\nHot prefix, {codec}: mean TTFT with fetches {on['ttft_mean_s'] / off['ttft_mean_s']:.2f}x "
                   f"without, p90 {on['ttft_p90_s'] / off['ttft_p90_s']:.2f}x.")
    return md + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--phases", type=int, nargs="+", default=[24, 12, 6])
    p.add_argument("--ratios", type=float, nargs="+", default=[4.0, 16.0])
    p.add_argument("--min-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=3000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--section", choices=("host", "disk", "peer", "shapes", "stops"), default="host")
    p.add_argument("--config", default="configs/config.yaml")
    p.add_argument("--peer-lengths", type=int, nargs="+", default=[1024, 2048, 3072])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hot-tokens", type=int, default=2048)
    p.add_argument("--hot-requests", type=int, default=16)
    p.add_argument("--hot-suffix-tokens", type=int, default=256)
    p.add_argument("--restart-prefixes", type=int, default=24)
    p.add_argument("--restart-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--stop-prompts", type=int, default=24)
    p.add_argument("--stop-tokens", type=int, default=420)
    p.add_argument("--stop-reused", type=int, default=16)
    p.add_argument("--shapes-w-max", type=float, default=16.0)
    p.add_argument("--mfu", type=float, nargs="+", default=[0.4])
    p.add_argument("--fixed-s", type=float, nargs="+", default=[0.001, 0.02])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = start_run("bench_tiers", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    if args.section == "shapes":
        results = tiers_shapes.run(args)
        publish(record, "production/shapes", results, tiers_shapes.report(results), args.out,
                "Cache tiers: the host tier under the reuse-distance replay",
                "Peer fetches at production shapes: bytes per entry and the break-even prefix")
        return
    if args.section == "stops":
        os.environ.setdefault(DISK_SECRET_ENV, "bench-tiers-stops")
        results = tiers_stops.run(args)
        publish(record, f"{args.model}/stops", results, tiers_stops.report(results), args.out,
                "Cache tiers: the host tier under the reuse-distance replay",
                "Disk tier: what a stop of the single-engine server keeps")
        return
    if args.section == "peer":
        results = tiers_peer.run(args)
        publish(record, f"{args.model}/peer", results, report_peer(results), args.out,
                "Cache tiers: the host tier under the reuse-distance replay",
                "Peer fetches: a checkpoint pulled from the replica that holds it")
        return
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir, torch.float32), Tokenizer.from_dir(model_dir)
    if args.section == "disk":
        seeds = [run_disk_seed(model, tok, seed, args) for seed in args.seeds]
        publish(record, f"{args.model}/disk", {"seeds": seeds}, report_disk(seeds), args.out,
                "Cache tiers: the host tier under the reuse-distance replay",
                "Disk tier: a restart, and the cost of write-behind")
        return
    seeds = [run_seed(model, tok, seed, args) for seed in args.seeds]
    arms = list(seeds[0])
    med = {a: {k: statistics.median(s[a][k] for s in seeds) for k in seeds[0][a]} for a in arms}
    rows = []
    for a in arms:
        m = med[a]
        rows.append([a, m["hit_rate"], m["ttft_mean_ms"], m["ttft_p90_ms"], m.get("host_entries", "-"),
                     m.get("host_state_mb", "-"), m.get("host_kv_mb", "-"), m.get("promotions", "-"),
                     m.get("promotion_s", "-"), m.get("recompute_saved_s", "-")])
    md = table(["ratio/codec/arm", "hit rate", "TTFT mean ms", "TTFT p90 ms", "host entries", "host state MB",
                "host KV MB", "promotions", "promotion s", "recompute saved s"], rows)
    lines = []
    for ratio in args.ratios:
        for codec in CODECS:
            host, base = med[f"{ratio}x/{codec}/host"], med[f"{ratio}x/{codec}/no tier"]
            ceiling = med.get(f"{args.ratios[0]}x/{codec}/ceiling")
            per_seed = statistics.median(s[f"{ratio}x/{codec}/host"]["ttft_mean_ms"]
                                         / s[f"{ratio}x/{codec}/no tier"]["ttft_mean_ms"] for s in seeds)
            against = (f" and {ceiling['hit_rate']:.3f} at the ceiling ({host['hit_rate'] / ceiling['hit_rate']:.2f}x)"
                       if ceiling else "")
            lines.append(f"- {ratio:g}x, {codec}: the host tier ({host['host_mb']:.1f} MiB) reaches hit rate "
                         f"{host['hit_rate']:.3f} against {base['hit_rate']:.3f} without it{against}"
                         + f"; mean TTFT {per_seed:.2f}x no tier's (median of per-seed ratios); promotions took "
                         f"{host['promotion_s']:.2f} s for {host['recompute_saved_s']:.1f} s of prefill saved.")
    states = {codec: med[f"{args.ratios[0]}x/{codec}/host"] for codec in CODECS}
    md += "\n\n" + "\n".join(lines) + "\n\nStates per host byte (at the first ratio, same host bytes): " + ", ".join(
        f"{codec} {s['host_entries']:.0f} entries in {s['host_state_mb'] + s['host_kv_mb']:.1f} MB "
        f"({s['host_state_mb']:.1f} MB state, {s['host_kv_mb']:.1f} MB KV)" for codec, s in states.items()) + ".\n"
    publish(record, args.model, {"seeds": seeds, "medians": med}, md, args.out,
            "Cache tiers: the host tier under the reuse-distance replay")


if __name__ == "__main__":
    main()
