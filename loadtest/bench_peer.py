"""Our server against llama.cpp's llama-server on the same models: `python -m loadtest.bench_peer [--models kda-tiny
gdn-tiny] [--starts 3] [--repeats 3] [--arms ours-local ours-ray llama] [--local-engine JSON] [--quick]
[--out docs/benchmarks.md]` (about 15 minutes on a quiet 2-core machine with the defaults, once the compile cache
is warm; `--starts-only` times our servers' starts with a cold and a warm compile cache instead: loadtest/peer/
starts.py, about 15 minutes for both models).

Arms (loadtest/peer/servers.py), one server at a time, each start a fresh process, the arms' order rotated from
one start to the next: ours-local (app.api.local, shipped engine defaults, 2 torch threads), ours-ray (`serve
run` of configs/config.yaml with one replica of 2 threads) and llama (llama-server `-t 2 -tb 2 -np 16 -c 65536
-ctk f32 -ctv f32`, defaults otherwise) on an f32 GGUF conversion of the zoo checkpoint (loadtest/peer/gguf.py;
for gdn-tiny a rewrite whose dense MLPs are one routed expert each, so llama-server runs its MoE path there).
llama-server is built once outside the repository (loadtest/peer/llama.py). Every arm gets the same token-id
prompts, cut from the held-out corpus (bench_engine.corpus_ids), through POST /v1/completions, greedy, with
ignore_eos and exactly the asked number of tokens back (loadtest/peer/client.py checks `usage`).

Per start, after an untimed warm-up, --repeats times, each repeat on prompts no server has seen in that start and
after an untimed request of its own (a server's threads have slept through the pause between repeats):
  - decode: aggregate output tokens/s of 1, 4 and 16 concurrent non-streamed requests (64-token prompts, 128 new
    tokens each), from the first send to the last answer, over 8, 2 and 1 such rounds one after another (single
    100 ms answers scatter by +-30% on these VMs);
  - cold TTFT: the median of 3 requests of 512, 2048 and 3072 prompt tokens, max_tokens 1 (llama: cache_prompt
    false too);
  - latency: the median of 5 single 128-token answers to 64-token prompts, end to end;
  - ITL p99: 16 streamed requests at once, the 99th percentile of their inter-token gaps (client.py);
and once per start: greedy agreement (5 prompts x 32 tokens, ids as each server reports them, no ignore_eos),
start time (launch to the first /health 200) and the RSS of the server's processes after the run.
Figures are medians over starts x repeats; a ratio ours / llama is the median over starts of the ratio of the
two arms' medians in that start (decode: higher is better; TTFT and latency: lower is better).
Each arm's record also says how many cores other processes kept busy while it was measured (`other_cores`; a
start above 0.2 is flagged NOISY): with one other busy process on a 2-core machine, a 2-thread torch server runs
10-80x slower (its OpenMP team waits at every op's barrier for a thread the OS has not scheduled), llama-server's
thread pool far less, so a run on a shared machine says little about either.
Results: loadtest/results/bench_peer_cpu.json, one variant per model (`<model>/local-engine-<hash>` with
--local-engine); --out DOC replaces their blocks in DOC. --quick (1 start, 1 repeat, 3 agreement prompts, for
development) saves under the temp directory instead and takes no --out. --starts-only times our starts on a cold
and a warm compile cache (loadtest/peer/starts.py); --fewshot runs only the few-shot row, queries on new headers
against llama-server at its default micro-batch and at -ub 128 (loadtest/peer/fewshot.py, variant
`<model>/fewshot`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from app.models.loader import resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest.bench_engine import corpus_ids
from loadtest.common import RESULTS, median, start_run, table
from loadtest.peer import agreement, client, fewshot, gguf, llama, servers
from loadtest.peer import starts as start_times
from loadtest.peer.client import matches
from loadtest.sections import knob_variant, publish
from loadtest.serve_harness import free_port

STREAMS = (1, 4, 16)
ROUNDS = {1: 8, 4: 2, 16: 1}  # sequential rounds of c concurrent requests per repeat: 8-16 answers each
TTFT_LENGTHS = (512, 2048, 3072)
TTFT_SAMPLES, E2E_SAMPLES = 3, 5  # single requests per repeat, median taken
PROMPT, NEW, AGREE_TOKENS, ITL_STREAMS = 64, 128, 32, 16
OURS = ("ours-local", "ours-ray")
FIGURES = [f"decode_{c}" for c in STREAMS] + [f"ttft_{n}" for n in TTFT_LENGTHS] + ["e2e", "itl_p99"]
HIGHER_IS_BETTER = {f"decode_{c}" for c in STREAMS}


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    at = (len(s) - 1) * q / 100
    lo = int(at)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (s[lo + 1] - s[lo]) * (at - lo)


def paired_ratio(ours: list[float], peer: list[float]) -> float:
    """Median over starts of median(ours in the start) / median(peer in the start); lists hold one list per start."""
    return median([median(o) / median(p) for o, p in zip(ours, peer)])


def plan_prompts(ids: list[int], repeats: int, agree: int) -> dict:
    """Non-overlapping slices of the corpus ids: for each repeat its decode, TTFT, latency and ITL prompts, and
    the warm-up and agreement prompts (the same in every start: each start's servers are fresh)."""
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        if at > len(ids):
            raise RuntimeError("corpus too short for this plan")
        return ids[at - n : at]

    plan = {"warm": take(512), "agree": [take(PROMPT) for _ in range(agree)], "repeats": []}
    for _ in range(repeats):
        plan["repeats"].append({
            "warm": take(PROMPT),
            "decode": {c: [[take(PROMPT) for _ in range(c)] for _ in range(ROUNDS[c])] for c in STREAMS},
            "ttft": {n: [take(n) for _ in range(TTFT_SAMPLES)] for n in TTFT_LENGTHS},
            "e2e": [take(PROMPT) for _ in range(E2E_SAMPLES)], "itl": [take(PROMPT) for _ in range(ITL_STREAMS)]})
    return plan


def plan_tokens(repeats: int, agree: int) -> int:
    per_repeat = PROMPT * (1 + sum(c * ROUNDS[c] for c in STREAMS) + E2E_SAMPLES + ITL_STREAMS)
    return 512 + agree * PROMPT + repeats * (per_repeat + TTFT_SAMPLES * sum(TTFT_LENGTHS))


async def measure(server: servers.Server, plan: dict, vocab: client.Vocab, say) -> dict:
    url, arm = server.url, server.arm
    async with httpx.AsyncClient(timeout=client.TIMEOUT) as c:
        await client.complete(c, url, arm, plan["warm"], 8)  # warm-up, untimed
        await client.concurrent(c, url, arm, [plan["warm"][i * 64 : i * 64 + 64] for i in range(4)], 16)
        agree = [await client.greedy_ids(c, url, arm, p, AGREE_TOKENS, vocab) for p in plan["agree"]]
        reps = []
        for r, rp in enumerate(plan["repeats"]):
            await client.complete(c, url, arm, rp["warm"], 16)  # untimed: the server's threads awake after the pause
            fig = {}
            for n, rounds in rp["decode"].items():  # aggregate tokens/s over the rounds, one after another
                fig[f"decode_{n}"] = n * NEW * len(rounds) / sum([await client.concurrent(c, url, arm, prompts, NEW)
                                                                 for prompts in rounds])
            for n, prompts in rp["ttft"].items():
                fig[f"ttft_{n}"] = median([await client.complete(c, url, arm, p, 1, cold=True) for p in prompts])
            fig["e2e"] = median([await client.complete(c, url, arm, p, NEW) for p in rp["e2e"]])
            fig["itl_p99"] = percentile(await client.streams(c, url, arm, rp["itl"], NEW), 99)
            say(f"  {arm} repeat {r}: " + ", ".join(f"{k} {v:.1f} tok/s" if k.startswith("decode") else
                                                    f"{k} {v * 1e3:.1f} ms" for k, v in fig.items()))
            reps.append(fig)
    return {"start_s": server.start_s, "agree_ids": agree, "repeats": reps}


async def tokenizer_check(url: str, tok: Tokenizer, ids: list[int]) -> dict:
    text = tok.decode(ids)
    async with httpx.AsyncClient(timeout=client.TIMEOUT) as c:
        theirs = await client.tokenize(c, url, text)
    ours = tok.encode(text)
    return {"tokens": len(ours), "equal": ours == theirs}


def bench_model(model: str, arms: list[str], starts: int, repeats: int, agree: int, local_engine: dict | None,
                logdir: Path, say=print) -> dict:
    d = resolve_model_dir(model)
    tok, t0 = Tokenizer.from_dir(d), time.time()
    vocab = client.Vocab(tok)
    plan = plan_prompts(corpus_ids(tok, plan_tokens(repeats, agree)), repeats, agree)
    model_file = gguf.convert(model, d, say) if "llama" in arms else None
    out: dict = {"arms": {a: [] for a in arms}, "gguf": model_file and model_file.name}
    me = {os.getpid()}
    for s in range(starts):
        for arm in arms[s % len(arms):] + arms[: s % len(arms)]:  # rotated: no arm always runs first
            server = servers.start(arm, model, free_port(), logdir, model_file, local_engine)
            say(f"{model} start {s} {arm}: up in {server.start_s:.2f} s ({time.time() - t0:.0f} s into the model)")
            try:
                if arm == "llama" and "tokenizer" not in out:
                    out["tokenizer"] = asyncio.run(tokenizer_check(server.url, tok, plan["warm"]))
                    say(f"  llama-server /tokenize vs ours on {out['tokenizer']['tokens']} tokens: "
                        f"{'equal' if out['tokenizer']['equal'] else 'DIFFERENT'}")
                busy, own, t = servers.cpu_seconds(), servers.cpu_seconds(server.pids() | me), time.perf_counter()
                rec = asyncio.run(measure(server, plan, vocab, say))
                rec["rss_mb"] = server.rss_mb()  # after the run, before the stop
                # cores kept busy meanwhile by processes other than this server and this script: a shared machine
                rec["other_cores"] = (servers.cpu_seconds() - busy - servers.cpu_seconds(server.pids() | me)
                                      + own) / (time.perf_counter() - t)
            finally:
                server.stop()
            say(f"  {arm}: RSS {rec['rss_mb']:.0f} MB; other processes kept {rec['other_cores']:.2f} cores busy"
                + (" (NOISY: the figures of this start are not the servers' own)" if rec["other_cores"] > 0.2 else ""))
            out["arms"][arm].append(rec)
    return summarise(out)


def summarise(out: dict) -> dict:
    """Medians per arm, ratios of each ours arm against llama, greedy agreement per prompt (start 0)."""
    med = {}
    for arm, recs in out["arms"].items():
        med[arm] = {f: median([r[f] for rec in recs for r in rec["repeats"]]) for f in FIGURES}
        med[arm] |= {k: median([rec[k] for rec in recs]) for k in ("start_s", "rss_mb")}
    out["medians"], out["ratios"], out["agreement"] = med, {}, {}
    out["other_cores_max"] = max(rec["other_cores"] for recs in out["arms"].values() for rec in recs)
    peer = out["arms"].get("llama")
    for arm in (a for a in OURS if a in out["arms"] and peer):
        recs = out["arms"][arm]
        out["ratios"][arm] = {f: paired_ratio([[r[f] for r in rec["repeats"]] for rec in recs],
                                              [[r[f] for r in rec["repeats"]] for rec in peer]) for f in FIGURES}
        out["ratios"][arm] |= {k: paired_ratio([[rec[k]] for rec in recs], [[rec[k]] for rec in peer])
                               for k in ("start_s", "rss_mb")}
        out["agreement"][arm] = [matches(o, t, AGREE_TOKENS) for o, t in zip(recs[0]["agree_ids"],
                                                                               peer[0]["agree_ids"])]
        out["agreement"][arm + "_stable"] = all(rec["agree_ids"] == recs[0]["agree_ids"] for rec in recs)
    return out


def _cell(figure: str, value: float) -> str:
    return f"{value:.0f}" if figure.startswith("decode") or figure == "rss_mb" else (
        f"{value:.2f}" if figure == "start_s" else f"{value * 1e3:.1f}")


def markdown(res: dict) -> str:
    cols = FIGURES + ["start_s", "rss_mb"]
    heads = ([f"decode tok/s x{c}" for c in STREAMS] + [f"TTFT ms {n}" for n in TTFT_LENGTHS]
             + ["latency ms 128 tok", "ITL p99 ms x16", "start s", "RSS MB"])
    text = ("Medians (start x repeat):\n\n"
            + table(["arm", *heads], [[arm, *(_cell(f, m[f]) for f in cols)] for arm, m in res["medians"].items()]))
    if res["ratios"]:
        text += ("\n\nours / llama (decode: higher is better; the others: lower is better), median over starts of "
                 "the ratio in each start:\n\n"
                 + table(["arm", *heads], [[arm, *(f"{r[f]:.2f}" for f in cols)] for arm, r in res["ratios"].items()]))
        for arm in res["ratios"]:
            cells = ", ".join(f"{s}/{AGREE_TOKENS}" for s, _ in res["agreement"][arm])
            text += (f"\n\nGreedy agreement {arm} vs llama, tokens equal per prompt: {cells} (common prefix "
                     f"{', '.join(str(p) for _, p in res['agreement'][arm])}"
                     f"{'' if res['agreement'][arm + '_stable'] else '; ours differed between starts'}).")
    tk = res.get("tokenizer")
    if tk:
        text += (f" llama-server's /tokenize {'gives' if tk['equal'] else 'does NOT give'} our ids "
                 f"({tk['tokens']} tokens). GGUF: `{res['gguf']}`.")
    text += (f" Other processes kept at most {res['other_cores_max']:.2f} of the machine's cores busy while an arm "
             "was measured.")
    if (res.get("gguf") or "").startswith("gdn"):
        text += " gdn-tiny's dense MLPs are one routed expert each in the GGUF: llama-server runs its MoE path."
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["kda-tiny", "gdn-tiny"])
    p.add_argument("--arms", nargs="+", default=list(servers.ARMS), choices=servers.ARMS)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--local-engine", type=json.loads, default=None, metavar="JSON",
                   help="ours-local's --engine knobs (an experiment: its own variant)")
    p.add_argument("--quick", action="store_true", help="1 start, 1 repeat, 3 agreement prompts; saved under the "
                   "temp directory, never into loadtest/results or --out")
    p.add_argument("--starts-only", action="store_true",
                   help="only time our servers' starts, with a cold and a warm compile cache (loadtest/peer/starts.py)")
    p.add_argument("--fewshot", action="store_true",
                   help="only the few-shot row: new headers' queries, ours vs llama-server at -ub 512 and 128 "
                        "(loadtest/peer/fewshot.py)")
    p.add_argument("--agreement", action="store_true",
                   help="only greedy agreement with llama-server on the random Qwen3.5 checkpoints "
                        f"({', '.join(agreement.SYNTH)}; loadtest/peer/agreement.py)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick and args.out:
        p.error("--quick runs are for development: no --out")
    starts, repeats, agree = (1, 1, 3) if args.quick else (args.starts, args.repeats, 5)
    if ("llama" in args.arms or args.agreement) and not args.starts_only:  # (the few-shot row's llama arms too)
        llama.ensure_server()
    run = start_run("bench_peer", {"models": args.models, "arms": args.arms, "starts": starts, "repeats": repeats,
                                   "threads": servers.THREADS, "llama": llama.PIN,
                                   "llama_flags": list(llama.SERVER_FLAGS), "local_engine": args.local_engine,
                                   "quick": args.quick})
    print(run.machine, run.config, sep="\n", flush=True)
    directory = Path(tempfile.gettempdir()) / "bench_peer_quick" if args.quick else RESULTS
    with tempfile.TemporaryDirectory(prefix="bench_peer-") as logdir:
        for model in args.models if args.starts_only else ():
            res = start_times.time_starts(model, args.arms, Path(logdir), lambda s: print(s, flush=True))
            publish(run, f"{model}/starts", res, start_times.markdown(res), args.out,
                    "Peer: our server vs llama.cpp's llama-server", f"{model}: start times", directory)
        for model in args.models if args.fewshot else ():
            tok = Tokenizer.from_dir(resolve_model_dir(model))
            ids = corpus_ids(tok, starts * fewshot.tokens_per_start())
            arms = [a for a in fewshot.ARMS if a.split("-ub")[0] in args.arms]
            model_file = gguf.convert(model, resolve_model_dir(model)) if "llama" in args.arms else None
            res = fewshot.bench(model, ids, starts, arms, Path(logdir), model_file, lambda s: print(s, flush=True))
            publish(run, f"{model}/fewshot", res, fewshot.markdown(res), args.out,
                    "Peer: our server vs llama.cpp's llama-server", f"{model}: few-shot headers", directory)
        for model in agreement.SYNTH if args.agreement else ():
            res = agreement.bench(model, Path(logdir), lambda s: print(s, flush=True))
            publish(run, f"{model}/agreement", res, agreement.markdown(res), args.out,
                    "Peer: our server vs llama.cpp's llama-server", f"{model}: greedy agreement", directory)
        for model in () if args.starts_only or args.fewshot or args.agreement else args.models:
            res = bench_model(model, args.arms, starts, repeats, agree, args.local_engine, Path(logdir),
                              lambda s: print(s, flush=True))
            variant = knob_variant(model, args.local_engine, "local-engine")[0]
            publish(run, variant, res, markdown(res), args.out, "Peer: our server vs llama.cpp's llama-server",
                    model, directory)


if __name__ == "__main__":
    main()
