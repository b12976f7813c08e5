"""Train a zoo checkpoint on CPU: `python -m app.training.train --preset kda-tiny --out runs/kda-tiny --minutes 60`.

Data: the Python standard library on this machine (held out by file) mixed with generated retrieval snippets,
through a curriculum of phases (short pure-snippet blocks first, then longer mixed blocks). Answer tokens of
snippets get `--answer-weight` in the loss. The run has a time budget (`--minutes`) and, optionally, a step
budget (`--max-steps`): the learning-rate schedule and the phases follow the fraction spent of whichever budget is
nearer its end, the run stops when that fraction reaches 1, and a resumed run (`--resume`) continues the same
schedule.
Every `--save-every` minutes it writes `OUT/state.pt` (model, optimizer, clock, step); at the end it writes
the checkpoint directory `OUT/model` (config.json, model.safetensors, tokenizer files) and the log.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from app.models.loader import ZOO_DIR, build_model, save_model
from app.models.tokenizer import Tokenizer
from app.training.corpus import TrainingStream
from app.training.init import init_weights
from app.training.presets import PRESETS

TOKENIZER_DIR = ZOO_DIR / "_tokenizer"


@dataclass(frozen=True)
class Phase:
    """From `start` (fraction of the budget) on: block length, batch size, snippet share and size range."""

    start: float
    seq_len: int
    batch: int
    snippet_fraction: float
    snippet_tokens: tuple[int, int]
    repeat_fraction: float = 0.0


CURRICULA = {
    "default": (  # induction first (copying, short lookups), then longer mixed code + retrieval
        Phase(0.00, 256, 8, 1.0, (48, 256), 0.5),
        Phase(0.25, 512, 4, 0.6, (64, 512), 0.15),
        Phase(0.50, 1024, 2, 0.5, (96, 1024), 0.1),
        Phase(0.85, 2048, 1, 0.5, (128, 2048), 0.05),
    ),
    "synthetic": (Phase(0.00, 256, 8, 1.0, (48, 256), 0.5),),  # for quick learnability experiments
}


def repeat_block(gen: torch.Generator, seq_len: int, vocab_size: int, eos: int):
    """Segments of random tokens each followed by an exact repeat: the copy task that grows induction heads.
    Returns (ids [seq_len], mask [seq_len] True on the repeats)."""
    ids, mask = [], []
    while len(ids) < seq_len:
        n = int(torch.randint(8, 65, (1,), generator=gen))
        seg = torch.randint(3, vocab_size, (n,), generator=gen).tolist()
        ids += seg + seg + [eos]
        mask += [False] * n + [True] * n + [False]
    return torch.tensor(ids[:seq_len]), torch.tensor(mask[:seq_len])


def phase_at(fraction: float, curriculum: str = "default") -> Phase:
    return [p for p in CURRICULA[curriculum] if p.start <= fraction][-1]


def lr_at(fraction: float, peak: float, warmup: float = 0.02, floor: float = 0.1) -> float:
    if fraction < warmup:
        return peak * fraction / warmup
    progress = min(1.0, (fraction - warmup) / (1.0 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def weighted_lm_loss(logits: torch.Tensor, ids: torch.Tensor, answer: torch.Tensor, answer_weight: float):
    """Next-token cross entropy; target tokens inside answers weigh `answer_weight`.

    Returns (weighted loss, plain mean loss, argmax accuracy on answer tokens or None when there are none)."""
    flat_logits, target = logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
    ce = F.cross_entropy(flat_logits, target, reduction="none")
    is_answer = answer[:, 1:].flatten()
    w = 1.0 + (answer_weight - 1.0) * is_answer.float()
    acc = None
    if is_answer.any():
        acc = (flat_logits[is_answer].argmax(-1) == target[is_answer]).float().mean().item()
    return (ce * w).sum() / w.sum(), ce.mean(), acc


@torch.no_grad()
def held_out_loss(model, blocks: torch.Tensor, batch: int = 4) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(blocks), batch):
        ids = blocks[i : i + batch]
        logits = model.forward_train(ids)
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (blocks.shape[0] * (blocks.shape[1] - 1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    p.add_argument("--max-steps", type=_positive_int, default=None,
                   help="optimizer-step budget, steps before a resume included (the run stops at whichever of "
                        "--minutes and --max-steps is spent first)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--answer-weight", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=float, default=5.0, help="minutes between resumable states")
    p.add_argument("--eval-every", type=float, default=5.0, help="minutes between held-out evaluations")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state.pt")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    p.add_argument("--curriculum", choices=sorted(CURRICULA), default="default")
    p.add_argument("--layers", default=None, help="override layer pattern, e.g. aallllll (a: attention)")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    config = PRESETS[args.preset]()
    if args.layers:
        config["layer_types"] = ["full_attention" if c == "a" else "linear_attention" for c in args.layers]
    model = build_model(config)
    init_weights(model, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    state_path, log_path = args.out / "state.pt", args.out / "train_log.jsonl"
    clock = {"elapsed": 0.0, "step": 0, "tokens": 0}
    if args.resume and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        clock = saved["clock"]
        if log_path.exists():  # drop steps logged after the state was saved (a crash between saves)
            kept = [x for x in log_path.read_text().splitlines() if json.loads(x)["step"] <= clock["step"]]
            log_path.write_text("".join(x + "\n" for x in kept))
    elif log_path.exists():
        log_path.unlink()
    if clock["step"] == 0:
        _write_json(args.out / "init_state.json", {"preset": args.preset, "config": config})
        torch.save(model.state_dict(), args.out / "init_model.pt")

    budget = args.minutes * 60
    gen = torch.Generator().manual_seed(args.seed * 7919 + clock["step"])
    held_out = None
    phase, stream = None, None
    last_save = last_eval = clock["elapsed"]
    bar = tqdm(total=int(budget), initial=int(clock["elapsed"]), unit="s", desc=args.preset, mininterval=10)
    model.train()
    while (frac := _progress(clock, budget, args.max_steps)) < 1.0:
        if phase_at(frac, args.curriculum) != phase:
            phase = phase_at(frac, args.curriculum)
            stream = TrainingStream(tokenizer, phase.seq_len, seed=args.seed * 1000 + clock["step"],
                                    snippet_fraction=phase.snippet_fraction,
                                    snippet_tokens=phase.snippet_tokens).blocks()
            if held_out is None:
                held_out = TrainingStream(tokenizer, 512, seed=0, snippet_fraction=0.0).held_out_blocks(16, 512)
        t0 = time.perf_counter()
        blocks = [repeat_block(gen, phase.seq_len, tokenizer.vocab_size, tokenizer.eos_token_id)
                  if torch.rand((), generator=gen) < phase.repeat_fraction else next(stream)
                  for _ in range(phase.batch)]
        ids = torch.stack([b[0] for b in blocks])
        answer = torch.stack([b[1] for b in blocks])
        lr = lr_at(frac, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, plain, answer_acc = weighted_lm_loss(model.forward_train(ids), ids, answer, args.answer_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        dt = time.perf_counter() - t0
        clock["elapsed"] += dt
        clock["step"] += 1
        clock["tokens"] += ids.numel()
        bar.update(int(clock["elapsed"]) - bar.n)
        bar.set_postfix(loss=f"{plain.item():.3f}", seq=phase.seq_len, tok_s=f"{ids.numel() / dt:.0f}")
        record = {"step": clock["step"], "elapsed_s": round(clock["elapsed"], 2), "tokens": clock["tokens"],
                  "loss": round(plain.item(), 4), "weighted_loss": round(loss.item(), 4), "lr": lr,
                  "grad_norm": round(grad_norm, 3), "seq_len": phase.seq_len, "answer_acc": answer_acc}
        if clock["elapsed"] - last_eval >= args.eval_every * 60 or _progress(clock, budget, args.max_steps) >= 1.0:
            record["held_out_loss"] = round(held_out_loss(model, held_out), 4)
            last_eval = clock["elapsed"]
            tqdm.write(f"step {clock['step']} tokens {clock['tokens']} held-out loss {record['held_out_loss']}")
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if clock["elapsed"] - last_save >= args.save_every * 60:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "clock": clock}, state_path)
            last_save = clock["elapsed"]
    bar.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "clock": clock}, state_path)
    out = save_model(model.eval(), config, args.out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, out / name)
    _write_json(args.out / "clock.json", clock)
    print(f"saved {out} after {clock['step']} steps, {clock['tokens']} tokens")
    return out


def _progress(clock: dict, budget_s: float, max_steps: int | None) -> float:
    """The fraction of the run spent: of the time budget, or of the step budget when that is further along."""
    return max(clock["elapsed"] / budget_s, clock["step"] / max_steps if max_steps else 0.0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


if __name__ == "__main__":
    main()
