"""A random-weight checkpoint of a chosen size, for benchmarks beyond the tiny zoo models:
`python -m loadtest.synth_model OUT_DIR [--hidden 2048 --layers 12 ...]`.

Qwen3-Next geometry (every 4th layer full attention, the rest Gated DeltaNet, dense SwiGLU MLPs) scaled by the
flags, weights from `app.training.init` (normal projections, decay parameters on the family's horizon
profile), the zoo tokenizer (vocabulary 4096). The files are what `load_model` and transformers'
`Qwen3NextForCausalLM` both read. Outputs of such a model are meaningless text; timings and cache behaviour
are what it is for.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from app.models.loader import ZOO_DIR, build_model, read_config, save_model
from app.training.init import init_decay, init_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def qwen3_next_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, linear_k_heads: int,
                      linear_v_heads: int, linear_head_dim: int, intermediate: int) -> dict:
    cfg = read_config(ZOO_DIR / "gdn-tiny")  # the tiny model's keys and ids, scaled
    cfg.update({
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "linear_num_key_heads": linear_k_heads, "linear_num_value_heads": linear_v_heads,
        "linear_key_head_dim": linear_head_dim, "linear_value_head_dim": linear_head_dim,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    })
    return cfg


def write(out_dir: str | Path, config: dict, seed: int = 0) -> tuple[Path, int]:
    """-> (the checkpoint directory, parameter count)."""
    model = build_model(config)
    init_weights(model, seed=seed)
    init_decay(model, seed=seed)
    out = save_model(model, config, out_dir, dtype=torch.bfloat16)
    for name in TOKENIZER_FILES:
        shutil.copy(ZOO_DIR / "gdn-tiny" / name, out / name)
    return out, sum(t.numel() for t in model.parameters())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-k-heads", type=int, default=16)
    p.add_argument("--linear-v-heads", type=int, default=32)
    p.add_argument("--linear-head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    config = qwen3_next_config(a.hidden, a.layers, a.heads, a.kv_heads, a.head_dim, a.linear_k_heads,
                               a.linear_v_heads, a.linear_head_dim, a.intermediate)
    out, n = write(a.out_dir, config, a.seed)
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, {config['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()
