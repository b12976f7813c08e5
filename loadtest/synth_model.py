"""A random-weight checkpoint of a chosen size, for benchmarks beyond the tiny zoo models:
`python -m loadtest.synth_model OUT_DIR [--hidden 2048 --layers 12 ...] [--family qwen3_5 [--experts 8]]`.

Qwen3-Next geometry (every 4th layer full attention, the rest Gated DeltaNet, dense SwiGLU MLPs) scaled by the
flags, weights from `app.training.init` (normal projections, decay parameters on the family's horizon
profile), the zoo tokenizer (vocabulary 4096). The files are what `load_model` and transformers'
`Qwen3NextForCausalLM` both read. Outputs of such a model are meaningless text; timings and cache behaviour
are what it is for.

`--family qwen3_5` writes the same geometry as a Qwen3.5 checkpoint in the hub's vision-language form
(`Qwen3_5ForConditionalGeneration`, or `Qwen3_5MoeForConditionalGeneration` with `--experts`: the text model's
keys under `text_config`, its weights under `model.language_model.`), with a few vision-tower and MTP-head tensors
beside them, as published checkpoints have, which text serving skips.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.models.loader import ZOO_DIR, build_model, read_config, save_model
from app.models.qwen3_5 import TEXT_PREFIX
from app.training.init import init_weights

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


def qwen3_5_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, linear_k_heads: int,
                   linear_v_heads: int, linear_head_dim: int, intermediate: int, experts: int = 0,
                   experts_per_tok: int = 2) -> dict:
    """A Qwen3.5 config.json in the hub's vision-language form; MoE (every layer routed, a shared expert of the
    routed width) when `experts` > 0."""
    text = qwen3_next_config(hidden, layers, heads, kv_heads, head_dim, linear_k_heads, linear_v_heads,
                             linear_head_dim, intermediate)
    for key in ("architectures", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "rope_theta",
                "partial_rotary_factor", "model_type"):
        text.pop(key, None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    if experts:
        text.pop("intermediate_size")
        text.update(num_experts=experts, num_experts_per_tok=experts_per_tok, moe_intermediate_size=intermediate,
                    shared_expert_intermediate_size=intermediate)
    moe = "_moe" if experts else ""
    text["model_type"] = f"qwen3_5{moe}_text"
    return {"architectures": [f"Qwen3_5{'Moe' if experts else ''}ForConditionalGeneration"],
            "model_type": f"qwen3_5{moe}", "text_config": text, "tie_word_embeddings": False,
            "vision_config": {"model_type": f"qwen3_5{moe}", "depth": 1, "hidden_size": 32, "num_heads": 2,
                              "intermediate_size": 32, "out_hidden_size": hidden}}


# a few tensors of the parts text serving skips (real names, tiny shapes): the vision tower and the MTP head
_NOT_TEXT = {"model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16), "model.visual.merger.linear_fc2.weight":
             (8, 32), "mtp.fc.weight": (8, 16), "mtp.layers.0.input_layernorm.weight": (8,)}


def write(out_dir: str | Path, config: dict, seed: int = 0) -> tuple[Path, int]:
    """-> (the checkpoint directory, parameter count of the text model). BF16 weights, the decay parameters and
    routers fp32 (as transformers keeps them); a vision-language config (`text_config`) is written in that layout."""
    model = build_model(config)
    init_weights(model, seed=seed)
    out = save_model(model, config, out_dir, dtype=torch.bfloat16)
    if "text_config" in config:
        tensors = {TEXT_PREFIX + k.removeprefix("model.") if k.startswith("model.") else k: v
                   for k, v in load_file(out / "model.safetensors").items()}
        gen = torch.Generator().manual_seed(seed)
        tensors.update({k: torch.randn(shape, generator=gen).to(torch.bfloat16) for k, shape in _NOT_TEXT.items()})
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
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
    p.add_argument("--family", choices=("qwen3_next", "qwen3_5"), default="qwen3_next")
    p.add_argument("--experts", type=int, default=0, help="qwen3_5: routed experts per layer (0: dense MLPs)")
    a = p.parse_args(argv)
    shape = (a.hidden, a.layers, a.heads, a.kv_heads, a.head_dim, a.linear_k_heads, a.linear_v_heads,
             a.linear_head_dim, a.intermediate)
    config = qwen3_5_config(*shape, experts=a.experts) if a.family == "qwen3_5" else qwen3_next_config(*shape)
    out, n = write(a.out_dir, config, a.seed)
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, {a.layers} layers")


if __name__ == "__main__":
    main()
