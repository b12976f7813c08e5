"""Sampling benchmark: `python -m loadtest.bench_sampling [--rows 16] [--repeats 5] [--out docs/benchmarks.md]`.

Times drawing one token from each of --rows logits rows, as the engine does for the requests with
temperature > 0 in every step: `sample_rows` (top-p by a topk of V/64 candidates, 64 to 256, then a radix
select; inverse-transform draw) against the full-sort form it replaced (`naive_token_probs` +
`torch.multinomial`, row by row), measured in the same run, at the zoo vocabulary (4096) and at the target
models' (Qwen3-Next 151936, Kimi-Linear 163840). Logits are Gaussian with scale 4 (peaked, as a trained model's
usually are) or 1 (flat: top-p then needs many candidates).
Results: loadtest/results/bench_sampling_cpu.json, variant `rows-<N>`; --out DOC replaces that variant's block
in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from app.engine.sampling import naive_token_probs, sample_rows
from loadtest.common import median, start_run, table, timed
from loadtest.sections import publish

SETTINGS = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0), (0.7, 0.9, 0), (0.7, 1.0, 50), (0.7, 0.95, 0)]


def naive_sample(logits, temperature, top_p, top_k, gen) -> list[int]:
    return [int(torch.multinomial(naive_token_probs(row, temperature, top_p, top_k), 1, generator=gen))
            for row in logits]


def ours_sample(logits, temperature, top_p, top_k, gen) -> list[int]:
    n = logits.shape[0]
    return sample_rows(logits, [temperature] * n, [top_p] * n, [top_k] * n, [gen] * n)


def per_draw_ms(fn, logits, setting, draws: int) -> float:
    gen = torch.Generator().manual_seed(0)
    t, _ = timed(lambda: [fn(logits, *setting, gen) for _ in range(draws)])
    return t / draws * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936, 163840])
    p.add_argument("--scales", type=float, nargs="+", default=[4.0, 1.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draws", type=int, default=20, help="draws per timing")
    p.add_argument("--rows", type=int, default=1, help="rows drawn together (a step's sampled requests)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="replace this run's block in this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = start_run("bench_sampling", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    rows = []
    for vocab in args.vocab:
        for scale in args.scales:
            logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
            for temperature, top_p, top_k in SETTINGS:
                ours, naive = [], []
                for _ in range(args.repeats):
                    ours.append(per_draw_ms(ours_sample, logits, (temperature, top_p, top_k), args.draws))
                    naive.append(per_draw_ms(naive_sample, logits, (temperature, top_p, top_k), args.draws))
                row = {"vocab": vocab, "scale": scale, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                       "ours_ms": median(ours), "full_sort_ms": median(naive)}
                row["speedup"] = row["full_sort_ms"] / row["ours_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    md = ("Milliseconds per draw of all %d rows (median of %d repeats of %d draws). *full sort*: the form "
           "`sample_rows` replaced (full sort for top-p, `torch.multinomial`), row by row, timed in the same run.\n\n"
           % (args.rows, args.repeats, args.draws))
    md += table(["vocab", "logit scale", "temperature", "top_p", "top_k", "ours ms", "full sort ms", "speed-up"],
                [[r["vocab"], r["scale"], r["temperature"], r["top_p"], r["top_k"], r["ours_ms"],
                  r["full_sort_ms"], r["speedup"]] for r in rows]) + "\n"
    publish(record, f"rows-{args.rows}", {"rows": rows}, md, args.out, "Sampling: one token from each of N logits rows",
            f"{args.rows} row{'s' if args.rows > 1 else ''} per draw")


if __name__ == "__main__":
    main()
