"""Train the zoo's byte-level BPE tokenizer on the stdlib corpus plus synthetic snippets.

    python -m app.training.tokenizer OUT_DIR [--vocab-size 4096] [--snippets 3000] [--seed 0]

Writes the three files `app.models.tokenizer.Tokenizer` reads (tokenizer.json, tokenizer_config.json,
special_tokens_map.json); the special ids and the chat template are defined there.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from app.models.tokenizer import CHAT_TEMPLATE, EOT, IM_END, IM_START, SPECIAL_TOKENS, Tokenizer
from app.training.corpus import read_source, split_files, stdlib_files
from app.training.snippets import GENERATORS


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 4096,
    *,
    files: Sequence[Path] | None = None,
    n_snippets: int = 3000,
    seed: int = 0,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE on `files` (default: the stdlib train split) plus `n_snippets` synthetic
    snippets, write the tokenizer directory `out_dir` and return it loaded."""
    files = split_files(stdlib_files())[0] if files is None else list(files)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_texts(files, n_snippets, seed), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert backend.token_to_id(token) == i, f"{token} should have id {i}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "special_tokens_map.json", {
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "additional_special_tokens": [IM_START, IM_END],
    })
    return Tokenizer.from_dir(out)


def bytes_per_token(tokenizer: Tokenizer, files: Sequence[Path]) -> float:
    """UTF-8 bytes per token over `files` (higher is better compression)."""
    texts = [read_source(p) for p in files]
    n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    return sum(len(t.encode()) for t in texts) / n_tokens


def _training_texts(files: Sequence[Path], n_snippets: int, seed: int) -> Iterator[str]:
    for path in files:
        yield read_source(path)
    rng = random.Random(f"dasc-tokenizer/{seed}")
    kinds = sorted(GENERATORS)
    for _ in range(n_snippets):
        yield GENERATORS[rng.choice(kinds)](rng, rng.randint(4, 64)).text


def _tokenizer_config() -> dict[str, object]:
    added = {
        str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: train, write OUT_DIR, print training time and held-out bytes per token."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--snippets", type=int, default=3000, help="synthetic snippets added to the corpus")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, held_out = split_files(stdlib_files())
    start = time.perf_counter()
    tokenizer = train_tokenizer(args.out_dir, args.vocab_size, files=train, n_snippets=args.snippets, seed=args.seed)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "out_dir": str(args.out_dir),
        "vocab_size": tokenizer.vocab_size,
        "train_files": len(train),
        "held_out_files": len(held_out),
        "train_seconds": round(seconds, 1),
        "held_out_bytes_per_token": round(bytes_per_token(tokenizer, held_out), 3),
        "train_bytes_per_token": round(bytes_per_token(tokenizer, train), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
