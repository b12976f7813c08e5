"""Tokenizer round trips and HF compatibility, corpus split and stream determinism, snippets, probe."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.models.tokenizer import EOT, IM_END, IM_START, Tokenizer, decode_stream
from app.training.corpus import MAX_FILE_BYTES, TrainingStream, split_files, stdlib_files, stdlib_root
from app.training.probe import PROBE_KINDS, is_exact, retrieval_probe
from app.training.snippets import GENERATORS, copy_list, kv_lookup, snippet_for_context, var_chain
from app.training.tokenizer import train_tokenizer

TRICKY = [
    "",
    " ",
    "\n\n\n",
    "   leading and trailing   ",
    "tabs\t\tand\r\nCRLF\r\n",
    "x = 12345 + 0.5e-3",
    "héllo wörld ñ",
    "emoji 😀👍🏽 and ZWJ 👩‍👩‍👧",
    "中文和日本語のテキスト",
    "combining e\u0301 and \u00a0nbsp \u2028 separators",
    "def f():\n    return {'a': [1, 2]}  # comment\n",
    f"{IM_START}user\nhi{IM_END}\n{EOT}",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    train, _ = split_files(stdlib_files())
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, vocab_size=512, files=train[:12], n_snippets=200)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def exec_output(prompt: str) -> str:
    """The last line the prompt program prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(prompt, {})
    return out.getvalue().splitlines()[-1]


# ---------------------------------------------------------------- tokenizer


def test_special_ids_and_vocab(tok: Tokenizer, tok_dir: Path) -> None:
    assert [tok.encode(t) for t in (EOT, IM_START, IM_END)] == [[0], [1], [2]]
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.stop_token_ids == (0, 2)
    assert tok.vocab_size == 512
    assert {p.name for p in tok_dir.iterdir()} >= {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"
    }


def test_hub_style_config_without_bos(tok_dir: Path, tmp_path: Path) -> None:
    """A Qwen-style tokenizer_config.json: no bos token, eos given as an AddedToken dict naming <|im_end|>."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.update(bos_token=None, eos_token={"content": IM_END, "special": True}, pad_token=EOT)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hub = Tokenizer.from_dir(tmp_path)
    assert (hub.bos_token_id, hub.eos_token_id, hub.pad_token_id) == (None, 2, 0)
    assert hub.stop_token_ids == (2, 0)
    assert hub.decode(hub.encode(TRICKY[-1])) == TRICKY[-1]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TRICKY, ids=range(len(TRICKY)))
def test_round_trip_tricky(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("x = 9081726354")
    assert [tok.decode([i]) for i in ids[-10:]] == list("9081726354")


def test_incremental_decoding_matches_decode(tok: Tokenizer) -> None:
    for text in TRICKY:
        ids = tok.encode(text)
        deltas = list(decode_stream(tok, ids))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)  # never half a character
    rng = random.Random(0)
    for _ in range(200):  # arbitrary ids, including byte tokens that form invalid UTF-8
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert "".join(decode_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_transformers_compatibility(tok: Tokenizer, tok_dir: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    assert Backend.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size() == 512
    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id
    for text in TRICKY:
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "héllo\n 😀"}],
    ]
    for chat in chats:
        for gen in (True, False):
            assert tok.apply_chat_template(chat, gen) == hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )
    assert tok.apply_chat_template(chats[0]) == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["clean_up_tokenization_spaces"] is False


# ---------------------------------------------------------------- corpus


def test_stdlib_listing() -> None:
    files = stdlib_files()
    root = stdlib_root()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels) and len(files) > 500
    assert all(f.stat().st_size <= MAX_FILE_BYTES for f in files)
    banned = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert not any(banned & set(Path(r).parts[:-1]) for r in rels)
    assert "os.py" in rels and "json/decoder.py" in rels


def test_split_is_by_file_stable_and_disjoint() -> None:
    files = stdlib_files()
    train, held_out = split_files(files)
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(files)
    assert 0.03 < len(held_out) / len(files) < 0.10
    sub_train, sub_held = split_files(files[::3])  # a file's side does not depend on the others
    assert set(sub_held) == set(held_out) & set(files[::3])
    assert split_files(files) == (train, held_out)


@pytest.fixture(scope="module")
def small_files() -> tuple[list[Path], list[Path]]:
    train, held_out = split_files(stdlib_files())
    return train[:6], held_out[:2]


def test_stream_is_deterministic(tok: Tokenizer, small_files: tuple[list[Path], list[Path]]) -> None:
    train, held_out = small_files

    def take(seed: int) -> list[torch.Tensor]:
        stream = TrainingStream(tok, 96, seed=seed, snippet_tokens=(32, 96), files=train, held_out_files=held_out)
        return [b for b, _ in zip(stream, range(12))]

    a, b, c = take(1), take(1), take(2)
    assert all(x.shape == (96,) and x.dtype == torch.int64 for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    stream = TrainingStream(tok, 96, files=train, held_out_files=held_out)
    held = stream.held_out_blocks(4, 64)
    assert held.shape == (4, 64) and torch.equal(held, stream.held_out_blocks(4, 64))


def test_snippet_blocks_pack_complete_programs(tok: Tokenizer, small_files: tuple[list[Path], list[Path]]) -> None:
    train, held_out = small_files
    stream = TrainingStream(tok, 256, seed=5, snippet_fraction=1.0, snippet_tokens=(40, 120),
                            files=train, held_out_files=held_out)
    n_programs = 0
    for block, _ in zip(stream.blocks(), range(6)):
        assert block.answer_mask.any()
        text = tok.decode(block.ids.tolist())
        for program in filter(None, text.split(EOT)):
            if program.endswith("\n"):  # complete: the last line states the answer
                prompt, answer = program[:-1].rsplit("# ->", 1)
                assert exec_output(prompt + "# ->") == answer.strip()
                n_programs += 1
        answers = tok.decode(block.ids[block.answer_mask].tolist())
        assert answers.startswith(" ")
    assert n_programs >= 6


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_snippets_are_answerable_and_deterministic(tok: Tokenizer, kind: str) -> None:
    gen = GENERATORS[kind]
    for seed in range(30):
        size = 1 + seed % 17
        kwargs = {"filler_lines": seed % 4}
        if kind == "kv_lookup":
            kwargs |= {"n_queries": 1 + seed % min(3, size), "joint": seed % 2 == 0}
        snippet = gen(random.Random(seed), size, **kwargs)
        assert snippet == gen(random.Random(seed), size, **kwargs)
        assert snippet.answer.startswith(" ") and "\n" not in snippet.answer
        assert exec_output(snippet.prompt) == snippet.answer.strip()
        assert tok.encode(snippet.prompt) + tok.encode(snippet.answer) == tok.encode(snippet.prompt + snippet.answer)


def test_snippet_shapes() -> None:
    rng = random.Random(0)
    s = kv_lookup(rng, 20, 3)
    assert s.prompt.count("# ->") == 3 and s.prompt.count('": ') == 20
    assert len(kv_lookup(rng, 20, 3, joint=True).answer.split()) == 3
    assert var_chain(rng, 12, hops=4).prompt.count(" = ") == 12
    assert copy_list(rng, 7).answer.count(",") == 6


@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("context_len", [64, 300, 1024])
def test_snippet_for_context_fits(tok: Tokenizer, kind: str, context_len: int) -> None:
    for seed in range(3):
        snippet = snippet_for_context(kind, random.Random(seed), tok, context_len)
        n = len(tok.encode(snippet.prompt))
        assert context_len - max(16, 0.1 * context_len) <= n <= context_len  # within about one item
        assert snippet == snippet_for_context(kind, random.Random(seed), tok, context_len)
    with pytest.raises(ValueError):
        snippet_for_context(kind, random.Random(0), tok, 3)


# ---------------------------------------------------------------- probe


def test_is_exact() -> None:
    assert is_exact(" 4821\nprint(", " 4821") and is_exact(" 4821", " 4821")
    assert not is_exact(" 48210", " 4821") and not is_exact(" 482", " 4821") and not is_exact("4821", " 4821")


@pytest.mark.parametrize("kind", sorted(PROBE_KINDS))
def test_probe_scores_oracle_and_junk(tok: Tokenizer, kind: str) -> None:
    def oracle(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        answer = " " + exec_output(tok.decode(prompt_ids))
        return (tok.encode(answer + "\nx = 1") + [tok.eos_token_id])[:max_new_tokens]

    def junk(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return tok.encode(" 0 junk\n")[:max_new_tokens]

    good = retrieval_probe(oracle, tok, kind, 200, n=10)
    assert good.exact_match == 1.0 and good.n == 10
    assert all(e.prompt_len <= 200 for e in good.examples)
    assert retrieval_probe(junk, tok, kind, 200, n=10).exact_match == 0.0
