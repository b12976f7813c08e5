"""Command line: `python -m app.cli generate --model kda-tiny --prompt "..." --max-tokens 32 --temperature 0`.

The model is a zoo name (app/models/zoo/<name>) or a checkpoint directory.
"""

from __future__ import annotations

import argparse
import sys

import torch

from app.models.generate import generate
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer


def _generate(args: argparse.Namespace) -> int:
    try:
        model_dir = resolve_model_dir(args.model)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = load_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    out = generate(model, prompt_ids, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, stop_ids=() if args.ignore_eos else tokenizer.stop_token_ids)
    if out and out[-1] in tokenizer.stop_token_ids and not args.ignore_eos:
        out = out[:-1]
    print(tokenizer.decode(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.cli", description="dasc-serve command line")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt with a zoo model or checkpoint directory")
    g.add_argument("--model", default="kda-tiny", help="zoo name or checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_tokens < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
