"""Synthetic in-context retrieval snippets: short Python programs whose last line asks for a value defined
earlier in the program; a model must produce `Snippet.answer` right after `Snippet.prompt`.

Snippet format (one kv_lookup, prompt then answer):

    table = {
        "path": 4821,
        "size": "plum",
    }
    print(table["size"])  # -> plum        <- prompt ends at "# ->", answer is " plum"

The answer carries its leading space, so `encode(prompt) + encode(answer) == encode(prompt + answer)`
for the byte-level BPE of `app.models.tokenizer` (pre-tokenizer pieces never straddle the boundary):
training text and probe prompts tokenize identically. `exec(prompt)` prints the answer (stripped) as its
last line of output, which is how tests check that every answer is derivable from its prompt.
"""

from __future__ import annotations

import builtins
import keyword
import random
import string
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

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
