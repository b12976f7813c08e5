"""The shipped zoo checkpoints: within the size and shape limits, loadable by transformers and by us, and
greedy continuations that agree token for token between the two. Also the CLI on them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer
from app.training.generate import generate

ZOO = ["kda-tiny", "gdn-tiny"]
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Config:\n    def __init__(self, path):\n        self.",
    'table = {\n    "path": 41,\n    "size": "plum",\n    "mode": 7,\n}\nprint(table["size"])  # ->',
    "for i in range(10):\n    if i % 2 == 0:\n",
    "# Copyright (C) Python Software Foundation\n\"\"\"Utilities for",
]


def _zoo_dir(name):
    d = ZOO_DIR / name
    if not (d / "model.safetensors").exists():
        pytest.fail(f"zoo checkpoint {name} is missing from {ZOO_DIR}")
    return d


@pytest.mark.parametrize("name", ZOO)
def test_zoo_limits(name):
    d = _zoo_dir(name)
    cfg = json.loads((d / "config.json").read_text())
    assert (d / "model.safetensors").stat().st_size <= 16 * 2**20
    types = cfg["layer_types"]
    assert types.count("full_attention") * 4 >= len(types)
    assert cfg.get("max_position_embeddings", cfg.get("model_max_length", 0)) >= 2048
    assert (d / "REPORT.md").exists() and (d / "loss_curve.png").exists()


@pytest.mark.parametrize("name", ZOO)
def test_zoo_greedy_agrees_with_transformers(name):
    d = _zoo_dir(name)
    ours = load_model(d)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(d)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        mine = generate(ours, ids, 32)
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert mine == theirs, f"{name} diverges on {prompt!r}"


def test_cli_generate_matches_library():
    d = _zoo_dir("kda-tiny")
    prompt = "def add(a, b):\n    return"
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", "kda-tiny", "--prompt", prompt,
                          "--max-tokens", "12", "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    tok = Tokenizer.from_dir(d)
    ids = generate(load_model(d), tok.encode(prompt), 12, stop_ids=tok.stop_token_ids)
    if ids and ids[-1] in tok.stop_token_ids:
        ids = ids[:-1]
    assert out.stdout == tok.decode(ids) + "\n"


def test_cli_rejects_unknown_model():
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--model", "no-such-model", "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no model 'no-such-model'" in out.stderr
