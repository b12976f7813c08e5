"""The production-shape figures of bench_tiers' shapes section against arithmetic done by hand from the configs."""

from loadtest import fake_checkpoints, tiers_shapes
from loadtest.tiers_shapes import Shape


def test_kimi_linear_48b_bytes_and_flops_follow_its_config():
    s = tiers_shapes.read_shape("kimi", fake_checkpoints.write_kimi_linear_48b, 16.0)
    cfg = fake_checkpoints.KIMI_LINEAR_48B_CONFIG
    lin = cfg["linear_attn_config"]
    kda, mla = len(lin["kda_layers"]), len(lin["full_attn_layers"])
    heads, dk = lin["num_heads"], lin["head_dim"]
    conv = kda * 3 * heads * dk * (lin["short_conv_kernel_size"] - 1) * 2
    assert s.state_bytes["dense"] == kda * heads * dk * dk * 4 + conv
    assert conv < s.state_bytes["dasc W16 INT8"] < s.state_bytes["dasc W16"] < s.state_bytes["dense"]
    assert s.kv_bytes_per_token == mla * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    # per attention layer 4 x (heads x (nope + rope) for scores + heads x v for the weighted sum) per pair
    assert s.flops_per_pair == mla * 4 * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
                                                  + cfg["v_head_dim"])
    assert 2 * 2.5e9 < s.flops_per_token < 2 * 3.2e9  # "A3B": about 3B active parameters, embeddings aside


def test_qwen3_next_80b_kv_is_its_gqa_keys_and_values():
    s = tiers_shapes.read_shape("qwen", fake_checkpoints.write_qwen3_next_80b, 16.0)
    cfg = fake_checkpoints.QWEN3_NEXT_80B_CONFIG
    full = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    assert s.kv_bytes_per_token == full * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert 2 * 2.5e9 < s.flops_per_token < 2 * 3.6e9


def test_break_even_is_the_first_prefix_a_fetch_wins():
    s = Shape("toy", {"dense": 10_000_000}, 1.0, kv_bytes_per_token=1000, flops_per_token=1e9, flops_per_pair=0.0)
    n = s.break_even("dense", bandwidth=1e9, fixed_s=0.01, mfu=1.0, peak=1e12, limit=1 << 16)
    # fetch 0.01 + (1e7 + 1000 n) / 1e9 = 0.02 + 1e-6 n against recompute 1e9 n / 1e12 = 1e-3 n: n > 20.02
    assert n == 21
    assert s.fetch_s("dense", n, 1e9, 0.01) < s.recompute_s(n, 1.0, 1e12)
    assert s.fetch_s("dense", n - 1, 1e9, 0.01) >= s.recompute_s(n - 1, 1.0, 1e12)
    slow = Shape("toy", {"dense": 0}, 1.0, kv_bytes_per_token=10**6, flops_per_token=1e9, flops_per_pair=0.0)
    assert slow.break_even("dense", bandwidth=1e9, fixed_s=0.0, mfu=1.0, peak=1e12, limit=1 << 16) is None
