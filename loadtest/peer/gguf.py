"""GGUF f32 conversions of the zoo models for llama-server, cached outside the repository.

`convert(name)` -> ~/.cache/dasc-serve/gguf/<name>-<hash>.gguf, the hash over the zoo files the conversion
reads and `RECIPE` (so a changed checkpoint or preparation converts again). It writes a prepared copy of the
checkpoint under ~/.cache/dasc-serve/gguf/ (never in the repository), runs llama.cpp's convert_hf_to_gguf.py on it
(`--outtype f32`, our venv's python, PYTHONPATH=<tree>/gguf-py) through `_convert.py`, which names the BPE
pre-tokenizer, and deletes the copy. What the copy changes, each the same function as the zoo checkpoint:

- kda-tiny (`kimi_for_llama`): `num_experts_per_token` 0 where there are no routed experts (llama-server asserts
  that a model without experts uses none), and the dense MLP's tensors under `mlp.` (the converter's name for a
  dense FFN) instead of `block_sparse_moe.`.
- gdn-tiny (`moe_from_dense`): llama.cpp's Qwen3-Next needs experts, so each layer's dense MLP becomes one routed
  expert (router weights zero: softmax over one expert gives it weight 1) and a shared expert of width
  `SHARED_WIDTH` whose down projection is zero (it adds exactly 0). llama-server then runs its MoE path
  (mul_mat_id) for what is a dense MLP: tests/loadtest/test_peer.py checks that transformers computes the same
  logits on both checkpoints.
- Qwen3.5 (`text_only`, the random checkpoints of loadtest/peer/agreement.py): the vision-tower and MTP tensors
  dropped; llama.cpp converts the vision tower into a separate mmproj file, and this comparison is of text.
- the tokenizer: the converter does not know the zoo tokenizer's pre-tokenizer hash; its split rules are those
  of the converter's `starcoder` entry (`PRE_TOKENIZER`), with which llama-server's /tokenize gives our ids
  (bench_peer.py checks it on every run).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.models.qwen3_5 import NOT_TEXT
from loadtest.peer import llama

PRE_TOKENIZER = "starcoder"
RECIPE = "1"  # part of the cache key: change it when the preparation below changes
SHARED_WIDTH = 1  # llama.cpp's Qwen3-Next needs a shared expert of width > 0 (0 falls back to the dense width)
READS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONVERTER = Path(__file__).with_name("_convert.py")


def zoo_hash(model_dir: str | Path) -> str:
    """12 hex digits of sha256 over RECIPE and the files of `READS` that the checkpoint has (names and bytes)."""
    h = hashlib.sha256(f"recipe {RECIPE}\n".encode())
    for name in READS:
        f = Path(model_dir) / name
        if f.exists():
            h.update(f"{name} {f.stat().st_size}\n".encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:12]


def gguf_path(name: str, model_dir: str | Path) -> Path:
    return llama.cache_root() / "gguf" / f"{name}-{zoo_hash(model_dir)}.gguf"


def kimi_for_llama(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """kda-tiny as llama.cpp's converter and loader take it (see the module doc); the same function."""
    config = dict(config)
    if not config.get("num_experts"):
        config["num_experts_per_token"] = 0
    out = {}
    for k, t in tensors.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if k.endswith(f".block_sparse_moe.{proj}.weight"):
                k = k.replace(f".block_sparse_moe.{proj}.", f".mlp.{proj}.")
        out[k] = t
    return config, out


def moe_from_dense(config: dict, tensors: dict[str, torch.Tensor],
                   shared_width: int = SHARED_WIDTH) -> tuple[dict, dict[str, torch.Tensor]]:
    """A Qwen3-Next with dense MLPs written as one routed expert per layer plus an inert shared expert (hub
    layout: mlp.experts.0.*, mlp.gate, mlp.shared_expert.*, mlp.shared_expert_gate); the same function."""
    if config.get("num_experts"):
        raise ValueError("the checkpoint already has routed experts")
    hidden, ff = config["hidden_size"], config["intermediate_size"]
    config = {**config, "num_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": ff,
              "shared_expert_intermediate_size": shared_width, "norm_topk_prob": True, "decoder_sparse_step": 1,
              "mlp_only_layers": []}
    out, layers = {}, set()
    for k, t in tensors.items():
        head, sep, proj = k.partition(".mlp.")
        if sep and proj in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            out[f"{head}.mlp.experts.0.{proj}"] = t
            layers.add(head)
        else:
            out[k] = t
    if len(layers) != config["num_hidden_layers"]:
        raise ValueError(f"dense MLPs found in {len(layers)} of {config['num_hidden_layers']} layers")
    dtype = next(iter(tensors.values())).dtype
    for head in layers:
        out[f"{head}.mlp.gate.weight"] = torch.zeros(1, hidden, dtype=dtype)  # router: one expert, weight 1
        out[f"{head}.mlp.shared_expert.gate_proj.weight"] = torch.zeros(shared_width, hidden, dtype=dtype)
        out[f"{head}.mlp.shared_expert.up_proj.weight"] = torch.zeros(shared_width, hidden, dtype=dtype)
        out[f"{head}.mlp.shared_expert.down_proj.weight"] = torch.zeros(hidden, shared_width, dtype=dtype)
        out[f"{head}.mlp.shared_expert_gate.weight"] = torch.zeros(1, hidden, dtype=dtype)
    return config, out


def text_only(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A Qwen3.5 checkpoint without its vision-tower and MTP tensors (a text GGUF); the same text model."""
    return config, {k: t for k, t in tensors.items() if not k.startswith(NOT_TEXT)}


PREPARE = {"kimi_linear": kimi_for_llama, "qwen3_next": moe_from_dense, "qwen3_5": text_only, "qwen3_5_moe": text_only}
# converter flags by model_type: its Qwen3-Next and Qwen3.5 assert that the checkpoint has MTP layers unless told
# there are none
CONVERT_FLAGS = {"qwen3_next": ("--no-mtp",), "qwen3_5": ("--no-mtp",), "qwen3_5_moe": ("--no-mtp",)}


def prepare(model_dir: str | Path, out_dir: str | Path) -> Path:
    """The checkpoint in `model_dir` rewritten for llama.cpp (`PREPARE` by model_type) into `out_dir`, with its
    tokenizer files."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config, tensors = PREPARE[config["model_type"]](config, load_file(model_dir / "model.safetensors"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: t.contiguous() for k, t in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    for name in READS[2:]:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir


def convert(name: str, model_dir: str | Path, say: Callable[[str], None] = print) -> Path:
    """The cached GGUF f32 of the zoo checkpoint `name` in `model_dir`, converted first if it is not there."""
    out = gguf_path(name, model_dir)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tree = llama.tree()
    if not (tree / "convert_hf_to_gguf.py").exists():
        llama.ensure_server(say)  # unpacks the tree
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f"prep-{name}-") as tmp:
        prepared = prepare(model_dir, Path(tmp) / name)
        flags = CONVERT_FLAGS.get(json.loads((prepared / "config.json").read_text())["model_type"], ())
        part = Path(tmp) / out.name
        log = out.with_suffix(".log")
        say(f"converting {name} to {out} (log {log})")
        env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
        with open(log, "w") as f:
            r = subprocess.run([sys.executable, str(CONVERTER), str(tree), PRE_TOKENIZER, "--outtype", "f32", *flags,
                                "--outfile", str(part), str(prepared)], env=env, stdout=f, stderr=subprocess.STDOUT)
        if r.returncode or not part.exists():
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {name} (exit {r.returncode}); see {log}")
        part.replace(out)
    return out
