"""In-context retrieval probe: exact-match accuracy of greedy answers to held-out snippets.

Held-out seeds: example i of a probe is generated from `random.Random("dasc-probe/<kind>/<context_len>/
<seed>/<i>")`. Training streams seed theirs with "dasc-train/<seed>" and the tokenizer corpus with
"dasc-tokenizer/<seed>"; string seeds go through SHA-512, so probe and training snippets come from
disjoint seed namespaces for every integer `seed`; an identical snippet could recur only by chance
(keys drawn from the ~1,300 single-token words of the vocabulary, 1-4 digit or word values, and
dozens of pairs per prompt make that negligible).

Keys and variable names are single-token words (`single_token_words`), as in the training snippets: a
lookup is then an exact one-token match, which the tiny models can learn in an hour; random 4-character
keys split into several tokens and were not learned (see the training reports).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from app.models.tokenizer import Tokenizer
from app.training.snippets import Snippet, single_token_words, snippet_for_context

Generate = Callable[[list[int], int], list[int]]
"""generate(prompt_ids, max_new_tokens) -> new ids only (greedy; may stop early at a stop id)."""

PROBE_KINDS: dict[str, tuple[str, dict[str, object]]] = {
    "single_key": ("kv_lookup", {"n_queries": 1}),
    "multi_key": ("kv_lookup", {"n_queries": 3, "joint": True}),  # one line asks for three values
    "var_chain": ("var_chain", {"hops": 3}),
}
EXTRA_TOKENS = 4  # generated beyond the answer's own length, to see what follows it


class ProbeExample(NamedTuple):
    """One probe item: prompt length in tokens, expected answer, decoded continuation, verdict."""

    prompt_len: int
    answer: str
    output: str
    correct: bool


class ProbeResult(NamedTuple):
    """Fraction of `n` items answered exactly, and every item."""

    exact_match: float
    n: int
    examples: list[ProbeExample]


def retrieval_probe(
    generate: Generate, tokenizer: Tokenizer, kind: str, context_len: int, n: int = 100, seed: int = 1234
) -> ProbeResult:
    """Ask `n` held-out `kind` questions (single_key, multi_key, var_chain) with prompts filling up to
    `context_len` tokens, and score the greedy continuations with `is_exact`."""
    snippet_kind, kwargs = PROBE_KINDS[kind]
    kwargs = {**kwargs, "words": single_token_words(tokenizer)}
    examples = []
    for i in range(n):
        rng = random.Random(f"dasc-probe/{kind}/{context_len}/{seed}/{i}")
        snippet = snippet_for_context(snippet_kind, rng, tokenizer, context_len, **kwargs)
        examples.append(_ask(generate, tokenizer, snippet))
    return ProbeResult(sum(e.correct for e in examples) / n, n, examples)


def is_exact(output: str, answer: str) -> bool:
    """True if `output` is `answer` followed by a natural terminator: a newline, or nothing at all
    (generation stopped at a stop id right after the answer)."""
    return output.startswith(answer) and output[len(answer) : len(answer) + 1] in ("", "\n", "\r")


def _ask(generate: Generate, tokenizer: Tokenizer, snippet: Snippet) -> ProbeExample:
    prompt_ids = tokenizer.encode(snippet.prompt)
    new_ids = generate(prompt_ids, len(tokenizer.encode(snippet.answer)) + EXTRA_TOKENS)
    stops = [i for i, t in enumerate(new_ids) if t in tokenizer.stop_token_ids]
    output = tokenizer.decode(new_ids[: stops[0]] if stops else new_ids)
    return ProbeExample(len(prompt_ids), snippet.answer, output, is_exact(output, snippet.answer))
