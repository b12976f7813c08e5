"""Answer-quality allowance of a model's cache settings: `python -m app.calibrate MODEL [--out FILE]`.

Why: a dasc checkpoint omits units, so a cache hit may answer differently from a cold run (nr zero-fills the
omitted units; wr replays a bounded window to refresh them). Whether that is acceptable is the operator's
decision, made once per model by measurement, not something the tuning controller may find out live. The rule
(issue 20; docs/serving.md, "Answer quality: the allowance"; constants in app/dasc/allowance.py): a setting is
allowed when, on held-out prompts,
hits under it keep
  (a) the continuation NLL within `NLL_TOLERANCE` (0.5%) of the same hits under dense checkpoints, and
  (b) the first `GREEDY_TOKENS` (32) greedy tokens identical to a cold run on at least `MIN_AGREEMENT` (95%)
      of the prompts.

Prompts: windows of the held-out split of the stdlib corpus (`app.training.corpus`: files the zoo never trained
on), each cut into prefix + suffix + continuation. For every candidate setting (dense, and nr and wr at each
W_max of the tuner's ladder; the interval as configured) one engine serves every prefix (its prompt-end
checkpoint is stored under the setting), then serves prefix + suffix twice as a hit on that checkpoint: once
greedy (compared with a cold engine's greedy tokens) and once teacher-forced through the held-out continuation
(its NLL). The engine has no prompt-logprobs API, so teacher forcing wraps `Engine.run_works`: the forced
request's next-token logits are read and the forced token is appended in place of a sample, through the engine's
own decode path, i.e. exactly what a hit serves.

Writes `allowance.json` next to the model (or `--out`): model, date, commit, the prompt set, per-setting figures
and the allowed labels. The builder reads it and the controller moves only among the allowed settings.
It lives in `app`, not `app.dasc`: it reads the training corpus, and `app.training` already imports `app.dasc`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from app.dasc.allowance import (
    ALLOWANCE_FILE,
    GREEDY_TOKENS,
    MIN_AGREEMENT,
    NLL_TOLERANCE,
    POLICIES,
    W_VALUES,
    setting_label,
)
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from app.training.corpus import TrainingStream, split_files, stdlib_files

PREFIX_TOKENS = (256, 640, 1152)  # prompt i's prefix: PREFIX_TOKENS[i % 3]; longer than most wr windows
SUFFIX_TOKENS = 16  # the new part of the prompt after the cached prefix
GREEDY = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
FORCED = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=1.0, ignore_eos=True)  # logits come back


@dataclass(frozen=True)
class Prompt:
    prefix: list[int]
    suffix: list[int]
    continuation: list[int]  # the held-out text after prefix + suffix, GREEDY_TOKENS long

    @property
    def ids(self) -> list[int]:
        return self.prefix + self.suffix


def held_out_prompts(tok: Tokenizer, n: int) -> list[Prompt]:
    """n prompts from evenly spaced windows of the held-out stdlib files (the zoo's training split)."""
    _, held_out = split_files(stdlib_files())
    length = max(PREFIX_TOKENS) + SUFFIX_TOKENS + GREEDY_TOKENS
    # no train files: only the held-out stream is tokenized (snippet_fraction 1 needs no code of its own)
    stream = TrainingStream(tok, length, snippet_fraction=1.0, files=[], held_out_files=held_out)
    out = []
    for i, block in enumerate(stream.held_out_blocks(n, length).tolist()):
        p = PREFIX_TOKENS[i % len(PREFIX_TOKENS)]
        out.append(Prompt(block[:p], block[p:p + SUFFIX_TOKENS], block[p + SUFFIX_TOKENS:][:GREEDY_TOKENS]))
    return out


@dataclass(frozen=True)
class Candidate:
    w_max: float | None
    policy: str
    interval: int

    @property
    def label(self) -> str:
        return setting_label(self.w_max, self.policy)


def candidates(w_values=W_VALUES, interval: int = 0) -> list[Candidate]:
    """Dense, then nr and wr at every W_max of the tuner's ladder."""
    return [Candidate(None, "nr", interval)] + [Candidate(w, p, interval) for p in POLICIES for w in w_values]


def head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class TeacherForcing:
    """Wraps `engine.run_works`: a request registered in `forced` gets its given tokens appended instead of
    samples (it must be sampled, temperature > 0, so its logits come back), and `nll` collects each forced
    token's negative log-likelihood under the logits the engine computed."""

    def __init__(self, engine: Engine) -> None:
        self.forced: dict[str, list[int]] = {}
        self.nll: dict[str, list[float]] = {}
        run = engine.run_works

        def forcing(works):
            picked, logits = run(works)
            for w in works:
                want = self.forced.get(w.seq.request_id)
                if want is None or id(w.seq) not in logits:
                    continue
                token = want[len(w.seq.output_ids)]
                row = logits.pop(id(w.seq))
                self.nll.setdefault(w.seq.request_id, []).append(-torch.log_softmax(row.float(), -1)[token].item())
                picked[id(w.seq)] = token
            return picked, logits

        engine.run_works = forcing


def run_hits(engine: Engine, prompts: list[Prompt], prime: bool) -> tuple[list[float], list[list[int]], list[int]]:
    """Serve every prompt greedy and teacher-forced (after its prefix, when `prime`) -> (per-prompt mean
    continuation NLL, greedy tokens, cached tokens of the greedy request)."""
    if prime:
        engine.generate([p.prefix for p in prompts], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    forcing = TeacherForcing(engine)
    greedy_ids, forced_ids = [], []
    for p in prompts:  # both requests of a prompt are admitted in one step: both hit the prefix's checkpoint
        greedy_ids.append(engine.add_request(p.ids, GREEDY))
        forced_ids.append(engine.add_request(p.ids, FORCED))
        forcing.forced[forced_ids[-1]] = p.continuation
    final = {}
    while engine.has_unfinished():
        final.update({out.request_id: out for out in engine.step() if out.finished})
    for p, g, f in zip(prompts, greedy_ids, forced_ids):
        hits = {final[g].cached_tokens, final[f].cached_tokens}
        # the prompt-end checkpoint sits one token before the end, and a lossy one `recompute_tail` more; under a
        # tail the first request's own prompt-end checkpoint may land early enough for the second to use it
        if prime and min(hits) < max(0, len(p.prefix) - 1 - engine.cfg.tail):
            raise RuntimeError(f"expected both requests to hit the prefix's checkpoint, got {hits} cached tokens")
    return ([math.fsum(forcing.nll[f]) / len(forcing.nll[f]) for f in forced_ids],
            [final[g].output_ids for g in greedy_ids], [final[g].cached_tokens for g in greedy_ids])


def engine_config(setting: Candidate | None, n: int, **kw) -> EngineConfig:
    """Room for every prompt's two requests at once and every checkpoint they store (none is evicted)."""
    common = dict(max_running=2 * n, **kw)
    if setting is None:
        return EngineConfig(enable_cache=False, **common)
    return EngineConfig(w_max=setting.w_max, policy=setting.policy, interval=setting.interval,
                        checkpoint_slots=8 * n, **common)


def judge(nll: float, dense_nll: float, agreement: float) -> bool:
    return abs(nll / dense_nll - 1.0) <= NLL_TOLERANCE and agreement >= MIN_AGREEMENT


def calibrate(model_name: str, n: int, w_values, interval: int = 0, log=print) -> dict:
    """The allowance record of one model (see the module docstring)."""
    start = time.perf_counter()
    model_dir = resolve_model_dir(model_name)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    prompts = held_out_prompts(tok, n)
    cold_nll, cold_tokens, _ = run_hits(Engine(model, tok, engine_config(None, n)), prompts, prime=False)
    cold_mean = math.fsum(cold_nll) / n
    log(f"{model_dir.name}: {n} prompts, cold NLL {cold_mean:.4f}")
    figures, dense_nll = {}, None
    for setting in candidates(w_values, interval):
        nll, tokens, cached = run_hits(Engine(model, tok, engine_config(setting, n)), prompts, prime=True)
        mean = math.fsum(nll) / n
        dense_nll = dense_nll or mean  # the dense setting comes first
        same = [t[:GREEDY_TOKENS] == c[:GREEDY_TOKENS] for t, c in zip(tokens, cold_tokens)]
        f = {"nll": round(mean, 5), "nll_ratio": round(mean / dense_nll, 5), "agreement": sum(same) / n,
             "cached_fraction": round(sum(cached) / sum(len(p.ids) for p in prompts), 4)}
        f["allowed"] = judge(mean, dense_nll, f["agreement"])
        figures[setting.label] = f
        log(f"  {setting.label:>9}: NLL x{f['nll_ratio']:.4f}, greedy agreement {f['agreement']:.0%}, "
            f"{'allowed' if f['allowed'] else 'not allowed'}")
    return {
        "model": model_dir.name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": head_commit(),
        "rule": {"nll_tolerance": NLL_TOLERANCE, "min_agreement": MIN_AGREEMENT, "greedy_tokens": GREEDY_TOKENS},
        "prompts": {"count": n, "source": "held-out stdlib files (app.training.corpus.split_files)",
                    "prefix_tokens": list(PREFIX_TOKENS), "suffix_tokens": SUFFIX_TOKENS,
                    "continuation_tokens": GREEDY_TOKENS},
        "interval": interval, "cold_nll": round(cold_mean, 5), "settings": figures,
        "allowed": [label for label, f in figures.items() if f["allowed"]],
        "run_s": round(time.perf_counter() - start, 1),
    }


def markdown_table(records: list[dict]) -> str:
    """The figures as docs/serving.md shows them: a row per setting, per model the hits' NLL over dense hits,
    the share of prompts whose greedy tokens equal a cold run's, and the verdict."""
    head = " | ".join(f"{r['model']} ({r['prompts']['count']} prompts)" for r in records)
    rows = [f"| setting | {head} |", "|---" * (len(records) + 1) + "|"]
    for label in records[0]["settings"]:
        cells = [(f"NLL x{f['nll_ratio']:.4f}, greedy {f['agreement']:.0%}: {'**allowed**' if f['allowed'] else 'no'}"
                  if (f := r["settings"].get(label)) else "not measured") for r in records]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m app.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="+", help="zoo name or checkpoint directory (several only with --table)")
    p.add_argument("--prompts", type=int, default=40,
                   help="held-out prompts (a multiple of 3 spreads the lengths; with 40 two misses still pass 95%%)")
    p.add_argument("--w-max", type=float, nargs="+", default=list(W_VALUES),
                   help="W_max values to judge, each with nr and wr")
    p.add_argument("--interval", type=int, default=0, help="the engine's checkpoint interval (as configured)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (more oversubscribe a shared CPU)")
    p.add_argument("--out", default=None, help=f"where to write (default: MODEL_DIR/{ALLOWANCE_FILE})")
    p.add_argument("--table", action="store_true", help="print the models' stored figures as a markdown table")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([json.loads((resolve_model_dir(m) / ALLOWANCE_FILE).read_text()) for m in args.model]))
        return
    if len(args.model) != 1:
        p.error("calibrate one model at a time")
    torch.set_num_threads(args.threads)
    record = calibrate(args.model[0], args.prompts, args.w_max, args.interval)
    out = Path(args.out) if args.out else resolve_model_dir(args.model[0]) / ALLOWANCE_FILE
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"allowed: {', '.join(record['allowed'])} -> {out}")


if __name__ == "__main__":
    main()
