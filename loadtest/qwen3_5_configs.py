"""The published config.json of six Qwen3.5 checkpoints, in the hub's form, for the offline fakes of
`loadtest.fake_checkpoints` (no hub download is possible here).

Form: `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (`model_type` `qwen3_5` /
`qwen3_5_moe`), the text model's keys under `text_config`, the vision tower's under `vision_config`, the
multimodal token ids and `tie_word_embeddings` at the top. Keys and values are the published ones; a key is
written only where a source gives it (no `transformers_version`, no `bos`/`pad` token ids: the copies seen
disagree on them and none of them matters to the text model's geometry).

Sources. The hub pages themselves cannot be fetched from here, so every value below comes from public copies,
and the GDN geometry (layers, layer pattern, linear heads, head dims) and the attention / MLP sizes of each
model from at least two independent ones:
  [card]   the Qwen model cards ("Model Overview": layers, hidden layout, linear-attention heads V / QK, head dim
           128, attention heads Q / KV, head dim 256, experts), as transcribed on 2026-03-04 from the Qwen
           hub pages in a public GitHub file (search-index id 52472844883), mirrored at friendli.ai (0.8B) and
           restated by third-party cards: hugingapi.com TevunahAi/Qwen3.5-27B-TevunahAi-GPTQ (27B),
           hf.031202.xyz mlx-community/Qwen3.5-397B-A17B-4bit (397B)
  [slime]  THUDM/slime scripts/models/qwen3.5-{0.8B,9B,27B,35B-A3B}.sh (HEAD 624b824a) and
           qwen3.5-397B-A17B.sh (aa84536b): Megatron arguments read off each config.json (layers, hidden,
           ffn / moe-ffn sizes, attention heads, query groups, kv-channels, rotary 0.25, rotary base 1e7,
           vocab 248320, untied embeddings where `--untie-embeddings-and-output-weights`)
  [apxml]  apxml.com/models/qwen35-{2b,9b,27b,397b-a17b} (hidden, layers, heads, head dim, FFN size, vocab,
           rope theta)
  [copy]   config.json copies inside public test fixtures and recipes, named where they appear below.
`transformers`' defaults (Qwen3_5TextConfig, "Qwen3.5-27B" checkpoint docstring; its values are the 9B's)
were used only as a check, never as a source.
"""

from __future__ import annotations

__all__ = ["QWEN3_5_CONFIGS", "SOURCES"]


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Every `interval`-th layer full attention, the rest Gated DeltaNet (all six: 3 GDN + 1 attention)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


# shared by every Qwen3.5 text_config: the linear_* head dims and conv kernel, head_dim, context and MTP layer
# are in every model's [card] / [copy] sources; rope_parameters in the [copy] sources of 0.8B, 9B, 27B, 35B-A3B
# and [slime] (rotary 0.25, base 1e7) for all; the remaining boilerplate keys (dtype, hidden_act,
# initializer_range, attention_*, mamba_ssm_dtype, use_cache) are as in the 9B, 27B and 35B-A3B copies and taken
# as the family's.
_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
         "rope_theta": 10000000, "rope_type": "default"}
_TEXT_COMMON = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": 248320,
}
_TOKENS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
           "vision_end_token_id": 248054}
# the 27-block vision tower of 9B, 27B and 35B-A3B ([copy]); out_hidden_size is the text model's hidden_size
_VISION_27 = {"deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
              "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "num_heads": 16,
              "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}


def _dense(layers: int, hidden: int, ffn: int, heads: int, kv: int, hv: int, tie: bool, vision: dict) -> dict:
    text = {**_TEXT_COMMON, "hidden_size": hidden, "intermediate_size": ffn, "layer_types": _layer_types(layers),
            "linear_num_value_heads": hv, "model_type": "qwen3_5_text", "num_attention_heads": heads,
            "num_hidden_layers": layers, "num_key_value_heads": kv, "rope_parameters": dict(_ROPE),
            "tie_word_embeddings": tie}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], **_TOKENS, "model_type": "qwen3_5",
            "text_config": dict(sorted(text.items())), "tie_word_embeddings": tie,
            "vision_config": {"model_type": "qwen3_5", **vision, "out_hidden_size": hidden}}


def _moe(layers: int, hidden: int, heads: int, kv: int, hv: int, experts: int, top_k: int, expert_ffn: int,
         shared_ffn: int, vision: dict) -> dict:
    text = {**_TEXT_COMMON, "hidden_size": hidden, "layer_types": _layer_types(layers),
            "linear_num_value_heads": hv, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": expert_ffn,
            "num_attention_heads": heads, "num_experts": experts, "num_experts_per_tok": top_k,
            "num_hidden_layers": layers, "num_key_value_heads": kv, "output_router_logits": False,
            "rope_parameters": dict(_ROPE), "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": shared_ffn, "tie_word_embeddings": False}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], **_TOKENS, "model_type": "qwen3_5_moe",
            "text_config": dict(sorted(text.items())), "tie_word_embeddings": False,
            "vision_config": {"model_type": "qwen3_5_moe", **vision, "out_hidden_size": hidden}}


# Qwen/Qwen3.5-0.8B. 24 layers (6 x [3 GDN + 1 attention]), hidden 1024, MLP 3584, attention 8 Q / 2 KV heads of
# 256, GDN 16 V / 16 QK heads of 128, tied embeddings.
# [card] layers, layout, 16 V / 16 QK heads of 128, 8 Q / 2 KV of 256, rope dims 64 (friendli.ai mirror + the
# 2026-03-04 transcription); [slime] qwen3.5-0.8B.sh: 24 layers, hidden 1024, ffn 3584, 8 heads, 2 groups,
# kv-channels 256, embeddings tied (no --untie); [copy] "compact mirror of Qwen/Qwen3.5-0.8B's config.json" in a
# public C++ test (search-index id 54905607740): every text_config value above, tie_word_embeddings true at both
# levels, rope_parameters, and the vision tower below (12 blocks of 768, 12 heads, MLP 3072, out 1024); a Zig
# test fixture (id 67218334807) repeats the vision tower and rope values.
QWEN3_5_0_8B = _dense(24, 1024, 3584, 8, 2, 16, True, {
    "deepstack_visual_indexes": [], "depth": 12, "hidden_size": 768, "in_channels": 3, "intermediate_size": 3072,
    "num_heads": 12, "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2})

# Qwen/Qwen3.5-2B. 24 layers (6 x [3 GDN + 1 attention]), hidden 2048, MLP 6144, attention 8 Q / 2 KV, GDN 16 V /
# 16 QK heads of 128, tied embeddings.
# [card] layers, layout, 16 V / 16 QK, 8 Q / 2 KV; [apxml] hidden 2048, 24 layers, 8 / 2 heads of 256, FFN 6144,
# vocab 248320, rope theta 1e7; [copy] a Megatron argument file "derived from the HF checkpoint's config.json +
# text_config" (search-index id 58249390875): 24 layers, hidden 2048, ffn 6144, 8 heads, 2 groups, kv-channels
# 256, rotary 0.25 / 1e7, "tie_word_embeddings=true (from config.json)".
# Not found: the 2B's vision tower (depth, width); vision_config keeps only out_hidden_size = hidden_size, which
# the patch merger's output must equal.
QWEN3_5_2B = _dense(24, 2048, 6144, 8, 2, 16, True, {})

# Qwen/Qwen3.5-9B. 32 layers (8 x [3 GDN + 1 attention]), hidden 4096, MLP 12288, attention 16 Q / 4 KV, GDN 32 V /
# 16 QK heads of 128, untied.
# [card] layers, layout, 32 V / 16 QK, 16 Q / 4 KV; [slime] qwen3.5-9B.sh: 32 layers, hidden 4096, ffn 12288,
# 16 heads, 4 groups, kv-channels 256, --untie-embeddings-and-output-weights; [apxml] the same sizes;
# [copy] medrl's probe test (search-index id 71387934500): the full text_config (incl. linear_* and
# rope_parameters, tie_word_embeddings false) and this vision tower with out_hidden_size 4096.
QWEN3_5_9B = _dense(32, 4096, 12288, 16, 4, 32, False, _VISION_27)

# Qwen/Qwen3.5-27B. 64 layers (16 x [3 GDN + 1 attention]), hidden 5120, MLP 17408, attention 24 Q / 4 KV, GDN 48 V
# / 16 QK heads of 128, untied.
# [card] layers, layout, 48 V / 16 QK, 24 Q / 4 KV (transcription; TevunahAi card: 48 GDN + 16 attention layers,
# intermediate_size 17408, hidden 5120, vision 27 blocks of 1152, mrope [11, 11, 10], 1 MTP layer); [slime]
# qwen3.5-27B.sh: 64 layers, hidden 5120, ffn 17408, 24 heads, 4 groups, untied; [apxml] the same sizes;
# [copy] a Rust test's Qwen3.5-shaped text_config (id 60933566945: hidden 5120, ffn 17408, 24 / 4, 16 / 48 linear
# heads, rope_parameters) and an RTX 5090 recipe's text and vision config (id 57098678286, for Qwen3.6-27B,
# which the transformers docs give the same architecture and model_type).
QWEN3_5_27B = _dense(64, 5120, 17408, 24, 4, 48, False, _VISION_27)

# Qwen/Qwen3.5-35B-A3B. 40 layers (10 x [3 GDN + 1 attention]), hidden 2048, attention 16 Q / 2 KV, GDN 32 V / 16
# QK heads of 128, 256 experts of 512, 8 routed + 1 shared of 512, untied.
# [card] layers, layout, 32 V / 16 QK, 16 Q / 2 KV, 256 experts (8 routed + 1 shared); [slime]
# qwen3.5-35B-A3B.sh: 40 layers, hidden 2048, 16 heads, 2 groups, moe-ffn 512, shared 512, top-8 of 256,
# linear 16 key / 32 value heads of 128, conv kernel 4 (the 10cefc3b version), untied; [copy] the text_config
# "transcribed" from NVIDIA's quantized releases (id 70254044795: every key above incl. router_aux_loss_coef
# 0.001), a fine-tune's saved config.json (id 54536357361) and the published Qwen3.6-35B-A3B config.json in a
# test (id 57034692230): this vision tower, model_type qwen3_5_moe, out_hidden_size 2048.
QWEN3_5_35B_A3B = _moe(40, 2048, 16, 2, 32, 256, 8, 512, 512, _VISION_27)

# Qwen/Qwen3.5-397B-A17B. 60 layers (15 x [3 GDN + 1 attention]), hidden 4096, attention 32 Q / 2 KV, GDN 64 V /
# 16 QK heads of 128, 512 experts of 1024, 10 routed + 1 shared of 1024, untied.
# [card] layers, layout, 64 V / 16 QK, 32 Q / 2 KV, 512 experts (10 routed + 1 shared), expert size 1024
# (mlx-community card); [slime] qwen3.5-397B-A17B.sh: 60 layers, hidden 4096, 32 heads, 2 groups, kv-channels
# 256, moe-ffn 1024, shared 1024, top-10 of 512, untied; [apxml] the same sizes; [copy] a simulator's known-model
# table (id 57982277923) and a flash-pack test (id 52187504714): the same sizes incl. linear 16 / 64 heads of
# 128, conv kernel 4, shared_expert_intermediate_size 1024. (Megatron-Bridge's test fixture for this model gives
# shared_expert_intermediate_size 4096 and intermediate_size 1024: it disagrees with every other source and is
# not used.)
# Not found: the 397B's vision tower; vision_config keeps only out_hidden_size = hidden_size.
QWEN3_5_397B_A17B = _moe(60, 4096, 32, 2, 64, 512, 10, 1024, 1024, {})

QWEN3_5_CONFIGS = {
    "qwen3.5-0.8b": QWEN3_5_0_8B,
    "qwen3.5-2b": QWEN3_5_2B,
    "qwen3.5-9b": QWEN3_5_9B,
    "qwen3.5-27b": QWEN3_5_27B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "qwen3.5-397b-a17b": QWEN3_5_397B_A17B,
}

# hub repository of each, and the public copies its values were taken from (see the comments above)
SOURCES = {
    "qwen3.5-0.8b": ("Qwen/Qwen3.5-0.8B", "card (friendli.ai mirror, 2026-03-04 transcription); THUDM/slime "
                     "scripts/models/qwen3.5-0.8B.sh; C++ test config mirror (index 54905607740)"),
    "qwen3.5-2b": ("Qwen/Qwen3.5-2B", "card (2026-03-04 transcription); apxml.com/models/qwen35-2b; Megatron args "
                   "from config.json (index 58249390875)"),
    "qwen3.5-9b": ("Qwen/Qwen3.5-9B", "card (transcription); THUDM/slime scripts/models/qwen3.5-9B.sh; "
                   "apxml.com/models/qwen35-9b; medrl probe test config (index 71387934500)"),
    "qwen3.5-27b": ("Qwen/Qwen3.5-27B", "card (transcription, TevunahAi mirror); THUDM/slime "
                    "scripts/models/qwen3.5-27B.sh; apxml.com/models/qwen35-27b; Rust test text_config "
                    "(index 60933566945)"),
    "qwen3.5-35b-a3b": ("Qwen/Qwen3.5-35B-A3B", "card (transcription); THUDM/slime "
                        "scripts/models/qwen3.5-35B-A3B.sh; NVIDIA-release text_config transcription "
                        "(index 70254044795)"),
    "qwen3.5-397b-a17b": ("Qwen/Qwen3.5-397B-A17B", "card (transcription, mlx-community mirror); THUDM/slime "
                          "scripts/models/qwen3.5-397B-A17B.sh; apxml.com/models/qwen35-397b-a17b; "
                          "known-model table (index 57982277923)"),
}

