"""Synthetic stand-ins for the two hub checkpoints the paper evaluates and for six Qwen3.5 checkpoints, for
testing the plan tool offline.

Each directory has the real config.json layout, the real tensor names and shapes and a sharded
`model.safetensors.index.json`, but holds only what the plan tool may touch plus a few decoys:

    decay tensors (fp32, seeded draws)   Kimi  model.layers.{i}.self_attn.A_log [1, 1, 32, 1], .dt_bias [4096]
                                         Qwen  model.layers.{i}.linear_attn.A_log [32], .dt_bias [32]
                                         Qwen3.5  model.language_model.layers.{i}.linear_attn.A_log [Hv],
                                                  .dt_bias [Hv]  (Qwen3_5[Moe]ForConditionalGeneration names)
    small decoys (real names, shapes)    conv weights, norms, router biases / shared-expert gates: a few per
                                         layer, in the same shards; Qwen3.5 also an MTP-head norm and (where
                                         the vision tower's width is known) a vision-block norm
    ballast (optional, sparse on disk)   model.embed_tokens.weight and lm_head.weight at full vocab size
                                         (Kimi 2 x 755 MB, Qwen 2 x 622 MB BF16; Qwen3.5 under
                                         model.language_model., no lm_head where tied) in their own shards; the
                                         data is a hole (no disk), but using a read tensor costs its size in RAM.

The Qwen3.5 configs are the published ones (loadtest/qwen3_5_configs.py, sources there). Qwen3.5's linear
attention is Qwen3-Next's Gated DeltaNet, so its decay tensors are drawn from the same GDN profile: they are not
the real weights, and only the geometry (hence the dense bytes) is exact.

Decay draws follow the paper's per-token decay profile (section 3.3, alpha = exp(g) at a = -0.3):
KDA median 0.471, IQR [0.170, 0.774]; GDN median 0.969, IQR [0.894, 0.997]. As in `app.training.init`,
ln(-g) is drawn normal, A = exp(A_log) ~ U(1, 16) per head, and
dt_bias = softplus^-1(-g / A) + 0.3. The normal's variance is split into layer, head and (KDA) channel
components so layers and heads differ the way the paper's Figures 4-5 show; the pooled draws are then
mapped (each side of the median scaled on its own) so the pooled median and quartiles are the paper's.

    python -m loadtest.fake_checkpoints NAME OUT_DIR [--seed S] [--no-ballast]
    NAME: kimi-linear-48b-a3b, qwen3-next-80b-a3b, qwen3.5-{0.8b,2b,9b,27b,35b-a3b,397b-a17b}
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.dasc.horizons import STATIC_A
from app.training.init import DECAY_PROFILES
from loadtest.qwen3_5_configs import QWEN3_5_CONFIGS

KDA_LAYERS = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]  # 1-indexed
FULL_ATTN_LAYERS = [4, 8, 12, 16, 20, 24, 27]

KIMI_LINEAR_48B_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": FULL_ATTN_LAYERS, "head_dim": 128, "kda_layers": KDA_LAYERS,
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
    "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}

QWEN3_NEXT_80B_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# share of the variance of ln(-g) carried by (layer, head, channel) offsets
_VARIANCE_SPLIT = {"kimi_linear": (0.15, 0.35, 0.50), "qwen3_next": (0.20, 0.80, 0.0)}
_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
_LAYERS_PER_SHARD = 4


def draw_decay(family: str, num_layers: int, heads: int, per_head: int, seed: int = 0):
    """Seeded (A_log [layers, heads], dt_bias [layers, heads, per_head]) in fp32 following the family's profile."""
    # x = ln(-g) falls as alpha rises: alpha's upper quartile is x's lower one and vice versa
    median, alpha_lo, alpha_hi = DECAY_PROFILES[family]
    x_lo, x_mid, x_hi = (math.log(-math.log(q)) for q in (alpha_hi, median, alpha_lo))
    w_layer, w_head, w_chan = _VARIANCE_SPLIT[family]
    gen = torch.Generator().manual_seed(seed)
    z = (math.sqrt(w_layer) * torch.randn(num_layers, 1, 1, generator=gen, dtype=torch.float64)
         + math.sqrt(w_head) * torch.randn(num_layers, heads, 1, generator=gen, dtype=torch.float64)
         + math.sqrt(w_chan) * torch.randn(num_layers, heads, per_head, generator=gen, dtype=torch.float64))
    q25, q50, q75 = torch.quantile(z.flatten(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    # map the draws' own quartiles onto the profile's, each half scaled on its own (x is skewed)
    x = x_mid + torch.where(z < q50, (z - q50) * (x_mid - x_lo) / (q50 - q25), (z - q50) * (x_hi - x_mid) / (q75 - q50))
    neg_g = torch.exp(x).clamp(1e-5, 30.0)
    A = torch.empty(num_layers, heads, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen)
    y = (neg_g / A[..., None]).clamp_min(1e-6)
    dt_bias = y + torch.log(-torch.expm1(-y)) - STATIC_A  # softplus^-1(y) - a
    return A.log().float(), dt_bias.float()


def write_kimi_linear_48b(out_dir: str | Path, seed: int = 0, ballast: bool = True) -> Path:
    """Kimi-Linear-48B-A3B: 27 layers, KDA at the 1-indexed `kda_layers`, MLA at 4, 8, ..., 24, 27."""
    cfg = KIMI_LINEAR_48B_CONFIG
    lin, d, n = cfg["linear_attn_config"], cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, dk = lin["num_heads"], lin["head_dim"]
    A_log, dt_bias = draw_decay("kimi_linear", len(lin["kda_layers"]), heads, dk, seed)
    kda = {j - 1: idx for idx, j in enumerate(lin["kda_layers"])}
    layers = []
    for i in range(n):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": _ones(d), p + "post_attention_layernorm.weight": _ones(d)}
        if i in kda:
            t[p + "self_attn.A_log"] = A_log[kda[i]].view(1, 1, heads, 1).clone()
            t[p + "self_attn.dt_bias"] = dt_bias[kda[i]].reshape(heads * dk).clone()
            t[p + "self_attn.o_norm.weight"] = _ones(dk)
            for part in "qkv":
                t[p + f"self_attn.{part}_conv1d.weight"] = torch.zeros(heads * dk, 1, lin["short_conv_kernel_size"],
                                                                       dtype=torch.bfloat16)
        else:
            t[p + "self_attn.kv_a_layernorm.weight"] = _ones(cfg["kv_lora_rank"])
        if i >= cfg["first_k_dense_replace"]:
            t[p + "block_sparse_moe.gate.e_score_correction_bias"] = torch.zeros(cfg["num_experts"])
        layers.append(t)
    return _write(out_dir, cfg, layers, {"model.norm.weight": _ones(d)}, d, ballast)


def write_qwen3_next_80b(out_dir: str | Path, seed: int = 0, ballast: bool = True) -> Path:
    """Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (36 GDN + 12), 16 key / 32 value heads."""
    cfg = QWEN3_NEXT_80B_CONFIG
    d, n, interval = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["full_attention_interval"]
    hv = cfg["linear_num_value_heads"]
    gdn = [i for i in range(n) if (i + 1) % interval]
    A_log, dt_bias = draw_decay("qwen3_next", len(gdn), hv, 1, seed)
    layers = [_gdn_layer(f"model.layers.{i}.", cfg, gdn, i, A_log, dt_bias, moe=True) for i in range(n)]
    return _write(out_dir, cfg, layers, {"model.norm.weight": _ones(d)}, d, ballast)


def _gdn_layer(p: str, cfg: dict, gdn: list[int], i: int, A_log, dt_bias, moe: bool) -> dict[str, torch.Tensor]:
    """Decoder layer i of a Qwen-style GDN hybrid under the name prefix `p`: its norms, a shared-expert gate when
    `moe`, and its decay tensors, output norm and conv weight (GDN layers) or q/k norms (attention layers)."""
    d, hk, hv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    t = {p + "input_layernorm.weight": _ones(d), p + "post_attention_layernorm.weight": _ones(d)}
    if moe:
        t[p + "mlp.shared_expert_gate.weight"] = torch.zeros(1, d, dtype=torch.bfloat16)
    if i in gdn:
        j = gdn.index(i)
        t[p + "linear_attn.A_log"] = A_log[j].clone()
        t[p + "linear_attn.dt_bias"] = dt_bias[j].reshape(hv).clone()
        t[p + "linear_attn.norm.weight"] = _ones(dv)
        t[p + "linear_attn.conv1d.weight"] = torch.zeros(2 * hk * dk + hv * dv, 1, cfg["linear_conv_kernel_dim"],
                                                         dtype=torch.bfloat16)
    else:
        t[p + "self_attn.q_norm.weight"] = _ones(cfg["head_dim"])
        t[p + "self_attn.k_norm.weight"] = _ones(cfg["head_dim"])
    return t


QWEN3_5_TEXT_PREFIX = "model.language_model."  # the text model's weights in a ConditionalGeneration checkpoint


def write_qwen3_5(name: str, out_dir: str | Path, seed: int = 0, ballast: bool = True) -> Path:
    """One of the Qwen3.5 checkpoints of `loadtest.qwen3_5_configs` in the hub's ConditionalGeneration layout:
    every 4th layer full attention, the rest Gated DeltaNet with Hv value heads bundled Hv / Hk per key head;
    decay draws from the GDN (qwen3_next) profile, as for Qwen3-Next."""
    cfg = QWEN3_5_CONFIGS[name]
    text = cfg["text_config"]
    d, n, hv = text["hidden_size"], text["num_hidden_layers"], text["linear_num_value_heads"]
    gdn = [i for i, kind in enumerate(text["layer_types"]) if kind == "linear_attention"]
    A_log, dt_bias = draw_decay("qwen3_next", len(gdn), hv, 1, seed)
    moe = text.get("num_experts", 0) > 0
    layers = [_gdn_layer(f"{QWEN3_5_TEXT_PREFIX}layers.{i}.", text, gdn, i, A_log, dt_bias, moe) for i in range(n)]
    # outside the text model: the MTP head and the vision tower (the plan tool must not care)
    tail = {QWEN3_5_TEXT_PREFIX + "norm.weight": _ones(d), "mtp.norm.weight": _ones(d),
            "mtp.pre_fc_norm_hidden.weight": _ones(d)}
    if "hidden_size" in cfg["vision_config"]:
        tail["model.visual.blocks.0.norm1.weight"] = _ones(cfg["vision_config"]["hidden_size"])
    return _write(out_dir, cfg, layers, tail, d, ballast, vocab=text["vocab_size"],
                  embed=QWEN3_5_TEXT_PREFIX + "embed_tokens.weight",
                  lm_head=None if cfg["tie_word_embeddings"] else "lm_head.weight")


FAKES = {"kimi-linear-48b-a3b": write_kimi_linear_48b, "qwen3-next-80b-a3b": write_qwen3_next_80b,
         **{name: functools.partial(write_qwen3_5, name) for name in QWEN3_5_CONFIGS}}


def decay_tensor_names(model_dir: str | Path) -> list[str]:
    """Every A_log / dt_bias name in a checkpoint's index (what the plan tool is allowed to read)."""
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    return sorted(k for k in index["weight_map"] if k.endswith((".A_log", ".dt_bias")))


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


def _write(out_dir, cfg: dict, layers: list[dict], tail: dict, hidden: int, ballast: bool, vocab: int | None = None,
           embed: str = "model.embed_tokens.weight", lm_head: str | None = "lm_head.weight") -> Path:
    """Shards: [embed], layers in groups of 4, final norm [+ lm_head]; index with every name and the total size.
    vocab defaults to cfg["vocab_size"]; lm_head None: tied embeddings, no LM-head tensor."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = [dict(kv for t in layers[s : s + _LAYERS_PER_SHARD] for kv in t.items())
              for s in range(0, len(layers), _LAYERS_PER_SHARD)]
    shape = (vocab or cfg["vocab_size"], hidden)
    shards: list[dict] = ([{embed: shape}] if ballast else []) + groups
    shards.append({**tail, **({lm_head: shape} if ballast and lm_head else {})})
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        if any(isinstance(t, tuple) for t in tensors.values()):
            total += _write_sparse_shard(out / name, tensors)
        else:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: name for n in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _write_sparse_shard(path: Path, tensors: dict) -> int:
    """A safetensors file whose tuple-shaped entries are BF16 tensors of that shape left as a hole (reads as
    zeros, occupies no disk); tensor entries are written as usual. Returns the data bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        if isinstance(t, tuple):
            dtype, shape, nbytes, blob = "BF16", list(t), math.prod(t) * 2, None
        else:
            dtype, shape, nbytes = _DTYPES[t.dtype], list(t.shape), t.numel() * t.element_size()
            blob = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        blobs.append((offset, blob))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for off, blob in blobs:
            if blob is not None:
                f.seek(start + off)
                f.write(blob)
        f.truncate(start + offset)
    return offset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.fake_checkpoints", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(FAKES))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ballast", action="store_true", help="leave out the sparse full-size embedding shards")
    args = ap.parse_args(argv)
    print(FAKES[args.name](args.out_dir, seed=args.seed, ballast=not args.no_ballast))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
