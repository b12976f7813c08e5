"""Command line: `python -m app.cli generate --model kda-tiny --prompt "..." --max-tokens 32 --temperature 0`.

The model is a zoo name (app/models/zoo/<name>) or a checkpoint directory. Several prompts (repeat --prompt,
or --prompt-file with one JSON string per line) run in order through one engine, so later prompts hit the
prefix cache that earlier ones filled; --json prints one object per request. Every engine knob is a flag
built from `app.engine.config.KNOBS` (same name with dashes, its default, choices and doc; switches that are on
by default take `--no-...`, e.g. --no-cache).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from app.engine.config import KNOBS, EngineConfig, Knob
from app.engine.request import SamplingParams
from app.engine.tp import build_engine
from app.models.loader import resolve_model_dir


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts += [json.loads(line) for line in f if line.strip()]
    return prompts


def _generate(args: argparse.Namespace) -> int:
    try:
        model_dir = resolve_model_dir(args.model)
        prompts = _read_prompts(args)
        if not prompts:
            raise ValueError("give --prompt (repeatable) or --prompt-file")
        cfg = engine_config(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = build_engine(str(model_dir), cfg, args.tp, args.placement)
    except (RuntimeError, ValueError) as e:  # a missing GPU, head counts that do not divide the TP size
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = engine.tokenizer
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        try:
            out = engine.generate([ids], params)[0][0]
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.output_ids, "prompt_tokens": out.prompt_tokens,
                              "cached_tokens": out.cached_tokens, "ttft_ms": round(out.ttft_s * 1000, 3)}))
        else:
            print(out.text)
    if args.stats:
        print(json.dumps(engine.snapshot(), indent=2), file=sys.stderr)
    if getattr(engine, "tp_group", None) is not None:
        engine.tp_group.close()
    return 0


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` knob, in their own group; the parsed value lands under the knob's name."""
    group = parser.add_argument_group("engine knobs (app/engine/config.py)")
    for k in KNOBS.values():
        _add_knob_flag(group, k)


def _add_knob_flag(group: argparse._ArgumentGroup, k: Knob) -> None:
    if k.base is bool and k.default:
        group.add_argument(k.cli_flag, dest=k.name, action="store_false", help=f"turn off: {k.doc}")
    elif k.base is bool:
        group.add_argument(k.cli_flag, dest=k.name, action="store_true", help=k.doc)
    else:
        group.add_argument(k.cli_flag, dest=k.name, type=k.base, choices=k.choices, default=k.default, help=k.doc)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed knob flags describe (ValueError for a bad value)."""
    return EngineConfig(**{name: getattr(args, name) for name in KNOBS})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.cli", description="dasc-serve command line")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts with a zoo model or checkpoint directory")
    g.add_argument("--model", default="kda-tiny", help="zoo name or checkpoint directory")
    g.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    g.add_argument("--prompt-file", help="file with one JSON string per line")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    g.add_argument("--json", action="store_true", help="one JSON object per request")
    g.add_argument("--stats", action="store_true", help="print engine telemetry to stderr at the end")
    add_knob_flags(g)
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes; gloo on CPU)")
    g.add_argument("--placement", choices=["off", "storage", "balanced"], default="off",
                   help="TP placement of compressed checkpoints")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.set_defaults(func=_generate)
    c = sub.add_parser("cache", help="manage a disk tier directory")
    c.add_argument("action", choices=["purge"], help="purge: remove every entry and temporary file")
    c.add_argument("dir", help="the disk tier directory (engine.disk_dir)")
    c.set_defaults(func=_cache, threads=None)
    return parser


def _cache(args: argparse.Namespace) -> int:
    from app.cache.disk_tier import purge

    print(f"removed {purge(args.dir)} files from {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
