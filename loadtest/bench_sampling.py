"""Sampling benchmark: `python -m loadtest.bench_sampling [--repeats 5] [--out docs/benchmarks.md]`.

Times drawing one token from one logits row, as the engine does for every request with temperature > 0 in
every step: `sample_token` (top-p over growing topk candidates, inverse-transform draw) against the full-sort
form it replaced (`naive_token_probs` + `torch.multinomial`), measured in the same run, at the zoo
vocabulary (4096) and at the target models' (Qwen3-Next 151936, Kimi-Linear 163840). Logits are Gaussian
with scale 4 (peaked, as a trained model's usually are) or 1 (flat: top-p then needs many candidates).
"""

from __future__ import annotations

import argparse
import json

import torch

from app.models.sampling import naive_token_probs, sample_token
from loadtest.common import append_section, header, median, save, table, timed

SETTINGS = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0), (0.7, 0.9, 0), (0.7, 1.0, 50), (0.7, 0.95, 0)]


def naive_sample(logits, temperature, top_p, top_k, gen) -> int:
    return int(torch.multinomial(naive_token_probs(logits, temperature, top_p, top_k), 1, generator=gen))


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
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="append the markdown section to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in args.vocab:
        for scale in args.scales:
            logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
            for temperature, top_p, top_k in SETTINGS:
                ours, naive = [], []
                for _ in range(args.repeats):
                    ours.append(per_draw_ms(lambda x, t, p_, k, g: sample_token(x, t, p_, g, k), logits,
                                            (temperature, top_p, top_k), args.draws))
                    naive.append(per_draw_ms(naive_sample, logits, (temperature, top_p, top_k), args.draws))
                row = {"vocab": vocab, "scale": scale, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                       "ours_ms": median(ours), "full_sort_ms": median(naive)}
                row["speedup"] = row["full_sort_ms"] / row["ours_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    md = header("Sampling: one token from one logits row", config)
    md += ("\nMilliseconds per draw (median of %d repeats of %d draws). *full sort*: the form `sample_token` "
           "replaced (full sort for top-p, `torch.multinomial`), timed in the same run.\n\n"
           % (args.repeats, args.draws))
    md += table(["vocab", "logit scale", "temperature", "top_p", "top_k", "ours ms", "full sort ms", "speed-up"],
                [[r["vocab"], r["scale"], r["temperature"], r["top_p"], r["top_k"], r["ours_ms"],
                  r["full_sort_ms"], r["speedup"]] for r in rows]) + "\n"
    print(md)
    save("bench_sampling", {"config": config, "rows": rows})
    append_section(args.out, md)


if __name__ == "__main__":
    main()
