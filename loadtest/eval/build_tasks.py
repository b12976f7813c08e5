"""Build the lm-eval task data (loadtest/eval/tasks/*.jsonl) from held-out standard-library code.

The zoo trained on the interpreter's standard library minus a held-out 6% of its files
(`app.training.corpus.split_files`); every document here comes from those held-out files, so no answer was seen
in training. The output is deterministic for a Python version and committed, so `make eval` needs no hub and no
rebuild: `python -m loadtest.eval.build_tasks` rewrites the files (the YAML beside them is written by hand).

Four task sets (docs/fidelity.md):
- dasc_code_mc (multiple_choice): 16 lines of code, then which of four lines comes next (the true one and three
  other lines of the same file).
- dasc_code_loglik (loglikelihood): the log-likelihood of the true next line after 16 lines.
- dasc_code_copy (generate_until): a shared 24-line header from a file, then the start of one of its lines to
  complete from memory; ten documents per header, so most requests resume from the header's checkpoint.
- dasc_code_next (generate_until, with `num_fewshot: 3` drawn `first_n`): every request starts with the same
  three solved examples (the few-shot header), then six lines of code and the next line to write.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from app.training.corpus import split_files, stdlib_files, stdlib_root

TASKS = Path(__file__).parent / "tasks"
CONTEXT_LINES, HEADER_LINES, SHORT_CONTEXT = 16, 24, 6
COPY_HEADERS, COPY_PER_HEADER = 8, 10


def _usable(line: str) -> bool:
    """A line worth predicting: code (not blank, not a lone comment or bracket), 8 to 80 characters."""
    text = line.strip()
    return 8 <= len(line) <= 80 and not text.startswith("#") and len(set(text) - set("()[]{},:")) > 2


def _files() -> list[tuple[str, list[str]]]:
    """(relative path, lines) of each held-out file with enough code, in a stable order."""
    root = stdlib_root()
    out = []
    for path in split_files(stdlib_files())[1]:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if sum(_usable(x) for x in lines) >= 40:
            out.append((path.relative_to(root).as_posix(), lines))
    return out


def _positions(lines: list[str], before: int) -> list[int]:
    return [i for i in range(before, len(lines)) if _usable(lines[i]) and any(x.strip() for x in lines[i - 3 : i])]


def next_line_docs(files, rng: random.Random, n: int, before: int, choices: int = 0) -> list[dict]:
    """`n` documents spread over the files: `before` lines of context (ending in a newline), the next line as
    target and, with `choices`, that many lines of the same file in a random order with the target among them."""
    pool = [(path, lines, i) for path, lines in files for i in _positions(lines, before)]
    docs = []
    for path, lines, i in rng.sample(pool, n):
        doc = {"source": f"{path}:{i + 1}", "context": "\n".join(lines[i - before : i]) + "\n", "target": lines[i]}
        if choices:
            others = sorted({x for x in lines if _usable(x) and x.strip() != lines[i].strip()})
            options = [lines[i], *rng.sample(others, choices - 1)]
            rng.shuffle(options)
            doc |= {"choices": options, "gold": options.index(lines[i])}
        docs.append(doc)
    return docs


def copy_docs(files, rng: random.Random) -> list[dict]:
    """Groups of `COPY_PER_HEADER` documents sharing a `HEADER_LINES`-line header: each asks to repeat one of
    the header's lines given its first half (cut at a space, so the prompt ends on a word boundary)."""
    docs = []
    for path, lines in rng.sample(files, COPY_HEADERS):
        start = rng.randrange(0, len(lines) - HEADER_LINES)
        header = lines[start : start + HEADER_LINES]
        usable = [x for x in dict.fromkeys(header) if _usable(x) and _spaces(x)]
        for line in rng.sample(usable, min(COPY_PER_HEADER, len(usable))):
            cut = min(_spaces(line), key=lambda k: abs(k - len(line) // 2))
            docs.append({"source": f"{path}:{start + 1}", "header": "\n".join(header),
                         "prefix": line[:cut], "target": line[cut:]})
    return docs


def _spaces(line: str) -> list[int]:
    """Where a line can be cut: its spaces after the indentation (the target then starts with a space)."""
    indent = len(line) - len(line.lstrip())
    return [k for k in range(indent + 1, len(line) - 1) if line[k] == " "]


def jsonl(docs: list[dict]) -> str:
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def build(seed: int = 0) -> dict[str, list[dict]]:
    """Every task's documents, by file name (without `.jsonl`)."""
    files = _files()
    rng = random.Random(seed)
    return {
        "dasc_code_mc": next_line_docs(files, rng, 60, CONTEXT_LINES, choices=4),
        "dasc_code_loglik": next_line_docs(files, rng, 40, CONTEXT_LINES),
        "dasc_code_copy": copy_docs(files, rng),
        "dasc_code_next": next_line_docs(files, rng, 40, SHORT_CONTEXT),
        "dasc_code_next_fewshot": next_line_docs(files, rng, 3, SHORT_CONTEXT),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=TASKS)
    args = p.parse_args(argv)
    sets = build(args.seed)
    for name, docs in sets.items():
        (args.out / f"{name}.jsonl").write_text(jsonl(docs))
    print(json.dumps({name: len(docs) for name, docs in sets.items()}))


if __name__ == "__main__":
    main()
