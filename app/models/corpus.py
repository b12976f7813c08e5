"""Training data for tiny checkpoints: stdlib code plus synthetic in-context retrieval snippets.

Code comes from the running interpreter's standard library, split by file into train and held-out
parts. Snippets are short Python programs whose last line asks for a value defined earlier in the
program; a model must produce `Snippet.answer` right after `Snippet.prompt`.

Snippet format (one kv_lookup, prompt then answer):

    table = {
        "kx7q": 4821,
        "ab3z": "plum",
    }
    print(table["ab3z"])  # -> plum        <- prompt ends at "# ->", answer is " plum"

The answer carries its leading space, so `encode(prompt) + encode(answer) == encode(prompt + answer)`
for the byte-level BPE of `app.models.tokenizer` (pre-tokenizer pieces never straddle the boundary):
training text and probe prompts tokenize identically. `exec(prompt)` prints the answer (stripped) as its
last line of output, which is how tests check that every answer is derivable from its prompt.
"""

from __future__ import annotations

import builtins
import hashlib
import keyword
import random
import string
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

MAX_FILE_BYTES = 200_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_WORDS = (
    "apple", "amber", "birch", "cedar", "cloud", "coral", "delta", "ember", "fern", "flint", "frost",
    "grape", "hazel", "iris", "ivory", "jade", "kiwi", "lemon", "lilac", "maple", "mango", "mint",
    "navy", "oak", "olive", "onyx", "pearl", "pine", "plum", "quartz", "raven", "ruby", "sage", "sand",
    "slate", "stone", "tiger", "topaz", "tulip", "umber", "violet", "walnut", "wheat", "willow", "zinc",
)
_TABLE_NAMES = ("table", "config", "registry", "lookup", "settings", "index")
_LIST_NAMES = ("xs", "values", "data", "nums", "seq", "items")
_RESERVED = frozenset(keyword.kwlist) | frozenset(dir(builtins))


class Snippet(NamedTuple):
    """A retrieval program: the model must continue `prompt` with `answer` (leading space included)."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The completed program, as used for training: prompt, answer and a final newline."""
        return self.prompt + self.answer + "\n"


class TextEncoder(Protocol):
    """What corpus code needs from a tokenizer (`app.models.tokenizer.Tokenizer` satisfies it)."""

    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...


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


# ---------------------------------------------------------------- snippet generators


def kv_lookup(
    rng: random.Random,
    n_pairs: int,
    n_queries: int = 1,
    *,
    joint: bool = False,
    filler_lines: int = 0,
    words: Sequence[str] | None = None,
) -> Snippet:
    """A dict literal of `n_pairs` random keys, optional filler, then `n_queries` distinct lookups.

    With `joint=False` every lookup but the last is printed with its answer in the text (a few-shot
    format); with `joint=True` one line prints all `n_queries` values and the answer is them joined by
    single spaces, as `print` would. Values are 1-4 digit integers or short words. Keys are random
    4-character strings, or distinct draws from `words` when given (see `single_token_words`).
    """
    if not 1 <= n_queries <= n_pairs:
        raise ValueError(f"need 1 <= n_queries <= n_pairs, got {n_queries}, {n_pairs}")
    name = rng.choice(_TABLE_NAMES)
    keys = _draw_names(rng, n_pairs, _random_key, words)
    values = [_random_value(rng) for _ in keys]
    lines = [f"{name} = {{"] + [f'    "{k}": {_literal(v)},' for k, v in zip(keys, values)] + ["}"]
    lines += _filler(rng, filler_lines)
    asked = rng.sample(range(n_pairs), n_queries)
    if joint:
        refs = ", ".join(f'{name}["{keys[i]}"]' for i in asked)
        lines.append(f"print({refs})  # ->")
        answer = " " + " ".join(str(values[i]) for i in asked)
    else:
        lines += [f'print({name}["{keys[i]}"])  # -> {values[i]}' for i in asked[:-1]]
        lines.append(f'print({name}["{keys[asked[-1]]}"])  # ->')
        answer = f" {values[asked[-1]]}"
    return Snippet("\n".join(lines), answer)


def var_chain(
    rng: random.Random, n_vars: int, hops: int = 3, *, filler_lines: int = 0, words: Sequence[str] | None = None
) -> Snippet:
    """`n_vars` assignments: a chain `a = 41; b = a; c = b` of `hops` variables interleaved with
    distractor chains (1-3 long, other literals), optional filler, then `print(<last of chain>)`.
    The answer is the chain's root literal. Names are drawn from `words` when given."""
    if n_vars < 1:
        raise ValueError(f"need n_vars >= 1, got {n_vars}")
    hops = min(hops, n_vars)
    names = _draw_names(rng, n_vars, _random_name, words)
    target = _random_value(rng)
    chains = [names[:hops]]
    rest = names[hops:]
    while rest:
        size = rng.randint(1, 3)
        chains.append(rest[:size])
        rest = rest[size:]
    roots = [target] + [_random_value(rng, avoid=target) for _ in chains[1:]]
    pending = [0] * len(chains)
    lines = []
    for _ in range(n_vars):  # uniformly random interleaving that keeps each chain's order
        c = rng.choices(range(len(chains)), weights=[len(ch) - p for ch, p in zip(chains, pending)])[0]
        pos, chain = pending[c], chains[c]
        rhs = _literal(roots[c]) if pos == 0 else chain[pos - 1]
        lines.append(f"{chain[pos]} = {rhs}")
        pending[c] += 1
    lines += _filler(rng, filler_lines)
    lines.append(f"print({chains[0][-1]})  # ->")
    return Snippet("\n".join(lines), f" {target}")


def copy_list(rng: random.Random, n: int, *, filler_lines: int = 0) -> Snippet:
    """A list of `n` random integers below 100, optional filler, then a request to print it back."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    name = rng.choice(_LIST_NAMES)
    values = [rng.randrange(100) for _ in range(n)]
    lines = [f"{name} = {values}"] + _filler(rng, filler_lines) + [f"print({name})  # ->"]
    return Snippet("\n".join(lines), f" {values}")


GENERATORS: Mapping[str, Callable[..., Snippet]] = {
    "kv_lookup": kv_lookup,
    "var_chain": var_chain,
    "copy_list": copy_list,
}


def snippet_for_context(
    kind: str, rng: random.Random, tokenizer: TextEncoder, context_len: int, **kwargs: object
) -> Snippet:
    """A `kind` snippet whose prompt is as close to `context_len` tokens as its size allows, never over.

    Searches the size parameter (n_pairs, n_vars or n) by secant steps inside a shrinking bracket;
    each candidate is generated from the same sub-seed drawn once from `rng`, so the result is
    deterministic for `rng`'s state. `kwargs` go to the generator. Raises ValueError if even the
    smallest size does not fit.
    """
    generator = GENERATORS[kind]
    seed = rng.getrandbits(64)
    smallest = int(kwargs.get("n_queries", 1)) if kind == "kv_lookup" else 1

    def build(size: int) -> tuple[Snippet, int]:
        snippet = generator(random.Random(seed), size, **kwargs)
        return snippet, len(tokenizer.encode(snippet.prompt))

    good, good_len = build(smallest)
    if good_len > context_len:
        raise ValueError(f"smallest {kind} prompt is {good_len} tokens, over {context_len}")
    good_size, bad_size = smallest, None
    slope = 8.0
    while bad_size is None or bad_size - good_size > 1:
        step = max(1, int((context_len - good_len) / slope))
        size = good_size + step if bad_size is None else min(good_size + step, bad_size - 1)
        snippet, length = build(size)
        slope = max(1.0, (length - good_len) / (size - good_size))
        if length <= context_len:
            good, good_len, good_size = snippet, length, size
        else:
            bad_size = size
    return good


def _random_key(rng: random.Random) -> str:
    return rng.choice(string.ascii_lowercase) + "".join(
        rng.choice(string.ascii_lowercase + string.digits) for _ in range(3)
    )


def _random_name(rng: random.Random) -> str:
    while True:
        name = rng.choice(string.ascii_lowercase) + "".join(
            rng.choice(string.ascii_lowercase + string.digits) for _ in range(rng.randint(1, 2))
        )
        if name not in _RESERVED:
            return name


def _random_value(rng: random.Random, avoid: int | str | None = None) -> int | str:
    while True:
        value = rng.randrange(10 ** rng.randint(1, 4)) if rng.random() < 0.5 else rng.choice(_WORDS)
        if value != avoid:
            return value


def _literal(value: int | str) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def single_token_words(tokenizer: TextEncoder, lengths: tuple[int, int] = (3, 7)) -> tuple[str, ...]:
    """Lowercase words that are one token both quoted (`"word"`) and bare at a line start, minus Python
    keywords and builtins: keys and names from this pool make a lookup an exact one-token match."""
    vocab = getattr(tokenizer, "vocab", None)
    candidates = sorted(vocab() if callable(vocab) else (vocab or ()))
    base_q, base_b = len(tokenizer.encode('    "a": 1,')), len(tokenizer.encode("\na = 1"))
    return tuple(
        w for w in candidates
        if w.isascii() and w.isalpha() and w.islower() and lengths[0] <= len(w) <= lengths[1]
        and w not in _RESERVED and "_" not in w
        and len(tokenizer.encode(f'    "{w}": 1,')) == base_q and len(tokenizer.encode(f"\n{w} = 1")) == base_b
    )


def _draw_names(
    rng: random.Random, n: int, draw: Callable[[random.Random], str], words: Sequence[str] | None
) -> list[str]:
    if not words:
        return _unique(rng, n, draw)
    if n > len(words):
        raise ValueError(f"asked for {n} distinct names from a pool of {len(words)}")
    return rng.sample(list(words), n)


def _unique(rng: random.Random, n: int, draw: Callable[[random.Random], str]) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(draw(rng))
    return list(seen)


def _filler(rng: random.Random, n_lines: int) -> list[str]:
    """Harmless statements; their names all contain '_' so they never clash with keys or chain names."""
    out = []
    for i in range(n_lines):
        a, b = rng.randint(2, 99), rng.randint(2, 9)
        out.append(rng.choice((
            f"tmp_{i} = {a} * {b} + {rng.randint(0, 9)}",
            f"def helper_{i}(x):\n    return x * {b} + {a}",
            f"for idx_{i} in range({a}):\n    pass",
            f'msg_{i} = "{rng.choice(_WORDS)}".upper()',
            f"multiples_{i} = [n for n in range({a}) if n % {b} == 0]",
        )))
    return out


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
    `app.models.probe` never uses). `kinds` weighs snippet kinds; each kind's extra arguments (queries,
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
