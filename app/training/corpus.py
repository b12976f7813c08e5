"""Training data for tiny checkpoints: stdlib code plus synthetic in-context retrieval snippets.

Code comes from the running interpreter's standard library, split by file into train and held-out parts;
snippets come from `app.training.snippets`. `TrainingStream` mixes them into fixed-length token blocks.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from app.training.snippets import TextEncoder, single_token_words, snippet_for_context

MAX_FILE_BYTES = 200_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


# ---------------------------------------------------------------- stdlib files and split


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """Standard-library `.py` sources sorted by path relative to `stdlib_root()`.

    Excludes site-packages, test directories, `__pycache__`, symlinks, files over `max_bytes`, and the
    platform-specific files (`config-*` directories, `_sysconfigdata*`), so the listing depends only on
    the Python version, not on the machine.
    """
    root = stdlib_root()
    kept = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("_sysconfigdata") or path.is_symlink() or path.stat().st_size > max_bytes:
            continue
        kept.append(path)
    return sorted(kept, key=lambda p: p.relative_to(root).as_posix())


def split_files(
    files: Sequence[Path], held_out_fraction: float = 0.06
) -> tuple[list[Path], list[Path]]:
    """Split `files` into (train, held_out) by a SHA-256 of each path relative to the stdlib root.

    A file's side depends only on its relative path, so the split is stable across machines and runs
    and adding files never moves others. Paths outside the stdlib root hash their full posix path.
    """
    root = stdlib_root()
    train, held_out = [], []
    for path in files:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
        digest = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
        (held_out if digest / 2**64 < held_out_fraction else train).append(path)
    return train, held_out


def read_source(path: Path) -> str:
    """A source file as text (undecodable bytes, absent from 3.11's stdlib, become U+FFFD)."""
    return path.read_bytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------- training stream (tokens)


class Block(NamedTuple):
    """One training block: ids [seq_len] int64; answer_mask [seq_len] bool, True on snippet answers."""

    ids: torch.Tensor
    answer_mask: torch.Tensor


class TrainingStream:
    """Endless fixed-length blocks mixing stdlib code and packed retrieval snippets.

    A block is code with probability `1 - snippet_fraction`: a window at a random offset into the train
    files, tokenized and concatenated with an end-of-text id after each file. Otherwise it packs
    snippets, each `prompt + answer + "\\n"` followed by end-of-text, whose token lengths are drawn
    from `snippet_tokens` (min >= 32, max) and capped by the room left; the tail is end-of-text padding.
    Everything is a function of `seed` (the rng is seeded with the string "dasc-train/<seed>", which
    `app.training.probe` never uses). `kinds` weighs snippet kinds; each kind's extra arguments (queries,
    joint, filler) are drawn per snippet.
    """

    def __init__(
        self,
        tokenizer: TextEncoder,
        seq_len: int,
        *,
        seed: int = 0,
        snippet_fraction: float = 0.5,
        snippet_tokens: tuple[int, int] = (48, 512),
        kinds: Mapping[str, float] | None = None,
        files: Sequence[Path] | None = None,
        held_out_files: Sequence[Path] | None = None,
    ) -> None:
        if not 0.0 <= snippet_fraction <= 1.0 or not 32 <= snippet_tokens[0] <= snippet_tokens[1]:
            raise ValueError(f"bad snippet_fraction {snippet_fraction} or snippet_tokens {snippet_tokens}")
        if files is None or held_out_files is None:
            train, held_out = split_files(stdlib_files())
            files = train if files is None else files
            held_out_files = held_out if held_out_files is None else held_out_files
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.snippet_fraction, self.snippet_tokens = snippet_fraction, snippet_tokens
        self.kinds = dict(kinds or {"kv_lookup": 0.5, "var_chain": 0.3, "copy_list": 0.2})
        self._held_out_files = list(held_out_files)
        self.words = single_token_words(tokenizer) if hasattr(tokenizer, "vocab") else ()
        self.code_ids = self._tokenize_files(files)
        if self.snippet_fraction < 1.0 and len(self.code_ids) < seq_len:
            raise ValueError(f"train files give {len(self.code_ids)} tokens, fewer than seq_len {seq_len}")

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Blocks of ids [seq_len] int64."""
        return (block.ids for block in self.blocks())

    def blocks(self) -> Iterator[Block]:
        """Blocks with their answer masks; `iter(self)` is this without the masks."""
        rng = random.Random(f"dasc-train/{self.seed}")
        while True:
            if rng.random() < self.snippet_fraction:
                yield self._snippet_block(rng)
            else:
                start = rng.randrange(len(self.code_ids) - self.seq_len + 1)
                ids = self.code_ids[start : start + self.seq_len]
                yield Block(ids, torch.zeros(self.seq_len, dtype=torch.bool))

    def held_out_blocks(self, n: int, seq_len: int) -> torch.Tensor:
        """[n, seq_len] int64: n non-overlapping windows evenly spaced over the held-out token stream."""
        ids = self._tokenize_files(self._held_out_files)
        available = len(ids) // seq_len
        if n > available:
            raise ValueError(f"held-out split has {available} blocks of {seq_len}, asked for {n}")
        starts = [(i * available // n) * seq_len for i in range(n)]
        return torch.stack([ids[s : s + seq_len] for s in starts])

    def _snippet_block(self, rng: random.Random) -> Block:
        ids: list[int] = []
        mask: list[bool] = []
        lo, hi = self.snippet_tokens
        misses = 0
        while self.seq_len - len(ids) >= lo and misses < 8:
            kind = rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
            budget = rng.randint(lo, min(hi, self.seq_len - len(ids)))
            prompt_len = budget // 2 - 2 if kind == "copy_list" else budget - 16  # room for the answer
            try:
                snip = snippet_for_context(
                    kind, rng, self.tokenizer, prompt_len, **_training_kwargs(kind, rng, budget, self.words)
                )
            except ValueError:  # the drawn extras do not fit in a small budget
                misses += 1
                continue
            prompt = self.tokenizer.encode(snip.prompt)
            answer = self.tokenizer.encode(snip.answer)
            tail = self.tokenizer.encode("\n") + [self.tokenizer.eos_token_id]
            if ids and len(ids) + len(prompt) + len(answer) + len(tail) > self.seq_len:
                break
            ids += prompt + answer + tail
            mask += [False] * len(prompt) + [True] * len(answer) + [False] * len(tail)
        pad = self.seq_len - len(ids)
        ids = (ids + [self.tokenizer.eos_token_id] * pad)[: self.seq_len]
        mask = (mask + [False] * pad)[: self.seq_len]
        return Block(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))

    def _tokenize_files(self, files: Sequence[Path]) -> torch.Tensor:
        texts = [read_source(p) for p in files]
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        encoded = encode_batch(texts) if encode_batch else [self.tokenizer.encode(t) for t in texts]
        eot = [self.tokenizer.eos_token_id]
        return torch.cat([torch.zeros(0, dtype=torch.int64)] + [torch.tensor(ids + eot) for ids in encoded])


def _training_kwargs(kind: str, rng: random.Random, budget: int, words: Sequence[str]) -> dict[str, object]:
    """Per-snippet extras for training: few-shot (up to 8 answered lookups, every one a retrieval to learn
    from) or joint multi-key lookups, filler scaled to budget, names from the single-token pool."""
    filler = rng.randint(0, budget // 96)
    named = {"words": words} if words else {}
    if kind == "kv_lookup":
        n_queries = rng.choice((1, 2, 3, 4, 6, 8))
        joint = 1 < n_queries <= 4 and rng.random() < 0.3
        return {"n_queries": n_queries, "joint": joint, "filler_lines": filler, **named}
    if kind == "var_chain":
        return {"hops": rng.randint(2, 4), "filler_lines": filler, **named}
    return {"filler_lines": filler}
