"""config.json contents of the shipped zoo models (keys as transformers writes them, so both loaders read them)."""

from __future__ import annotations

VOCAB_SIZE = 4096
CONTEXT = 4096
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}


def kda_tiny() -> dict:
    """kimi_linear: 8 layers, KDA 4 heads x 32 channels, 3 MLA layers (1, 2, 5), dense SwiGLU MLP.

    Attention sits early and adjacent (after one KDA layer, whose short conv gives the NoPE MLA the previous
    token) because that is what let induction heads, and with them in-context retrieval, form within the
    one-hour CPU training budget; layers with attention only every 4th layer did not learn copying in time."""
    layers = 8
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
        "layer_types": _pattern("laallall"),
        "mlp_layer_types": ["dense"] * layers, "moe_intermediate_size": 128, "num_experts": 0,
        "num_experts_per_token": 1, "num_shared_experts": 1, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,  # transformers' KimiLinearForCausalLM does not tie
        "model_max_length": CONTEXT, "hidden_act": "silu", **SPECIAL_IDS,
    }


def gdn_tiny() -> dict:
    """qwen3_next: 8 layers, GDN 2 key x 4 value heads of 32, 3 gated-attention layers (0, 1, 5), dense MLP.

    Early adjacent attention (RoPE) for the same reason as kda-tiny: fast induction-head formation."""
    layers = 8
    return {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "layer_types": _pattern("aalllall"),
        "num_experts": 0, "num_experts_per_tok": 1, "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": CONTEXT,
        "hidden_act": "silu", **SPECIAL_IDS,
    }


def _pattern(p: str) -> list[str]:
    """'a' full attention, 'l' linear attention, one letter per layer."""
    return ["full_attention" if c == "a" else "linear_attention" for c in p]


PRESETS = {"kda-tiny": kda_tiny, "gdn-tiny": gdn_tiny}
