"""Our model forward against `transformers` on the same weights (fp32, tolerance 1e-5 max abs on logits),
and the stacked projection cache behind it.

Tiny random configs of every family, saved by transformers in its hub layout and loaded by our loader:
whole-prompt prefill, chunked prefill that carries state across chunks, and greedy decode steps after it.
Qwen3.5 in all four forms: text-only dense and MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and the
hub's vision-language checkpoints (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`: text
prompts, the vision tower skipped), two configs each: one a 4-layer GQA model with one full-attention layer, one
with three full-attention layers, odd head counts (3 query heads over 1 KV head, 3 GDN value heads on 1 key
head), tied embeddings and half-rotary heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    DynamicCache,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers import KimiLinearConfig as HFKimiConfig
from transformers import KimiLinearForCausalLM as HFKimi
from transformers import Qwen3NextConfig as HFQwenConfig
from transformers import Qwen3NextForCausalLM as HFQwen

from app.models.batch import BatchLayout, ContiguousKV
from app.models.layers import stacked_linear
from app.models.loader import load_model, save_model

TOL = 1e-5  # measured max abs error is below 1e-6; the issue allows up to 1e-4
VOCAB = 97


def _kimi_config(moe: bool, q_lora: int | None) -> HFKimiConfig:
    return HFKimiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        linear_head_dim=16, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"] if moe else ["dense"] * 4,
    )


def _qwen_config(moe: bool) -> HFQwenConfig:
    return HFQwenConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4 if moe else 0, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )


def _qwen3_5_text(moe: bool, odd: bool) -> dict:
    """Text-model keys of a Qwen3.5 config: `odd` has 5 layers (3 full attention), 3 heads on 1 KV head, 3 GDN
    value heads on 1 key head, tied embeddings, half-rotary heads; the other one full-attention layer of 4."""
    shape = dict(vocab_size=VOCAB, hidden_size=48 if odd else 64, num_hidden_layers=5 if odd else 4,
                 num_attention_heads=3 if odd else 4, num_key_value_heads=1 if odd else 2, head_dim=16,
                 linear_key_head_dim=16, linear_value_head_dim=8 if odd else 16, linear_num_key_heads=1 if odd else 2,
                 linear_num_value_heads=3 if odd else 4, tie_word_embeddings=odd, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    if odd:
        shape.update(layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention",
                                  "full_attention"],
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:
        return {**shape, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 24}
    return {**shape, "intermediate_size": 96}


def _qwen3_5_vl(moe: bool, odd: bool):
    text = _qwen3_5_text(moe, odd)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=odd)
    return Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration, config


CASES = {
    "kimi-dense": lambda: (HFKimi, _kimi_config(False, None)),
    "kimi-moe-qlora": lambda: (HFKimi, _kimi_config(True, 32)),
    "qwen-dense": lambda: (HFQwen, _qwen_config(False)),
    "qwen-moe": lambda: (HFQwen, _qwen_config(True)),
    **{f"qwen3.5-dense{tag}": (lambda odd=odd: (Qwen3_5ForCausalLM, Qwen3_5TextConfig(**_qwen3_5_text(False, odd))))
       for tag, odd in (("", False), ("-odd", True))},
    **{f"qwen3.5-moe{tag}": (lambda odd=odd: (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**_qwen3_5_text(True, odd))))
       for tag, odd in (("", False), ("-odd", True))},
    **{f"qwen3.5-vl-{kind}{tag}": (lambda moe=moe, odd=odd: _qwen3_5_vl(moe, odd))
       for kind, moe in (("dense", False), ("moe", True)) for tag, odd in (("", False), ("-odd", True))},
}
# a vision-language checkpoint's text model, as our save writes it (the text-only form) and transformers reads it
TEXT_ONLY = {Qwen3_5ForConditionalGeneration: Qwen3_5ForCausalLM,
             Qwen3_5MoeForConditionalGeneration: Qwen3_5MoeForCausalLM}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(reference transformers model, our model loaded from the reference's save_pretrained directory)."""
    torch.manual_seed(0)
    cls, cfg = CASES[request.param]()
    ref = cls(cfg).eval()
    with torch.no_grad():  # move norm weights and routers off their init so every parameter matters
        for name, p in ref.named_parameters():
            if "norm" in name or "gate.weight" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(out, max_shard_size="100KB")  # several shards and an index: the lazy sharded path
    assert (out / "model.safetensors.index.json").exists()
    ours = load_model(out)
    return ref, ours


def _ref_logits(ref, ids: torch.Tensor, cache=None) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=ids, cache=cache, use_cache=cache is not None).logits


def test_whole_prompt_prefill(pair):
    ref, ours = pair
    ids = torch.randint(3, VOCAB, (2, 150))
    want = _ref_logits(ref, ids)
    with torch.no_grad():
        got = ours.forward_train(ids)
    assert (got - want).abs().max().item() < TOL


def test_chunked_prefill_then_decode(pair):
    ref, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, 130))
    cache = DynamicCache(config=ref.config)
    kv, states = ContiguousKV(), None
    done = 0
    for chunk in (50, 47, 33):  # chunk boundaries off the 16/64 op chunk grid
        piece = ids[:, done : done + chunk]
        want = _ref_logits(ref, piece, cache)
        with torch.no_grad():
            got, states = ours(piece[0], BatchLayout((chunk,), (done,)), kv, states, all_logits=True)
        assert (got - want[0]).abs().max().item() < TOL, f"chunk at {done}"
        done += chunk
    token = want[:, -1:].argmax(-1)
    for step in range(6):
        want = _ref_logits(ref, token, cache)
        with torch.no_grad():
            got, states = ours(token[0], BatchLayout((1,), (done,)), kv, states)
        assert (got - want[:, -1]).abs().max().item() < TOL, f"decode step {step}"
        assert got.argmax(-1).item() == want[0, -1].argmax().item()
        token = want[:, -1:].argmax(-1)
        done += 1


def test_mixed_flat_batch_equals_separate_runs(pair):
    """One flat batch holding a 40-token prefill, a decode step and a 17-token continuation chunk."""
    _, ours = pair
    torch.manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (40, 30, 45)]
    kv, states = ContiguousKV(), ours.empty_states(3)
    with torch.no_grad():
        # warm sequences 1 and 2 alone: 29 and 28 tokens
        _, st1 = ours(prompts[1][:29], BatchLayout((29,), (0,)), _Offset(kv, 1), states.select([1]))
        _, st2 = ours(prompts[2][:28], BatchLayout((28,), (0,)), _Offset(kv, 2), states.select([2]))
        mixed_states = type(states).cat([states.select([0]), st1, st2])
        flat = torch.cat([prompts[0], prompts[1][29:30], prompts[2][28:45]])
        got, _ = ours(flat, BatchLayout((40, 1, 17), (0, 29, 28)), kv, mixed_states)
        want = [ours.forward_train(p[None])[0, -1] for p in prompts[:2]] + [ours.forward_train(prompts[2][None])[0, -1]]
    for i in range(3):
        assert (got[i] - want[i]).abs().max().item() < TOL


class _Offset:
    """KV view that files batch slot 0 under another sequence id (to warm one sequence alone)."""

    def __init__(self, kv: ContiguousKV, seq: int) -> None:
        self.kv, self.seq = kv, seq

    def extend(self, layer, seq, entries):
        return self.kv.extend(layer, self.seq, entries)


def test_save_load_round_trip(pair, tmp_path):
    """Our save (hub layout; a vision-language checkpoint's text model in the text-only form) loads back into
    ours and into transformers with identical logits."""
    ref, ours = pair
    text_cls = TEXT_ONLY.get(type(ref))
    config = ref.config.to_dict() if text_cls is None else ref.config.text_config.to_dict()
    if text_cls is not None:
        config["tie_word_embeddings"] = ref.config.tie_word_embeddings
    save_model(ours, config, tmp_path)
    again = load_model(tmp_path)
    ref2 = (text_cls or type(ref)).from_pretrained(tmp_path).eval()
    ids = torch.randint(3, VOCAB, (1, 70))
    with torch.no_grad():
        a, b = ours.forward_train(ids), again.forward_train(ids)
    assert torch.equal(a, b)
    assert (a - _ref_logits(ref2, ids)).abs().max().item() < TOL


def test_mla_absorbed_decode_equals_expanded_attention():
    """The batched decode path attends on MLA's latent entries (kv_b_proj folded into q and the output);
    it must equal expanding every cached entry to per-head keys and values, with ragged history lengths."""
    from app.models.layers import _padded_decode_attention
    from app.models.loader import resolve_model_dir

    model = load_model(resolve_model_dir("kda-tiny"))
    mla = next(layer.mixer for layer in model.model.layers if not layer.mixer.is_linear)
    g = torch.Generator().manual_seed(0)
    b, s = 5, 37
    q = torch.randn(b, mla.heads, mla.nope + mla.rope, generator=g)
    history = torch.randn(b, s, mla.kv_entry_width, generator=g)
    mask = torch.arange(s)[None, :] < torch.tensor([1, 9, 20, 36, 37])[:, None]
    k, v = mla._expand(history.flatten(0, 1))
    ref = _padded_decode_attention(q, k.view(b, s, *k.shape[1:]), v.view(b, s, *v.shape[1:]),
                                   mask[:, None, None, :], mla.scale)
    got = mla._absorbed_decode(q, history, mask)
    assert (got - ref).abs().max().item() < 1e-5


def test_stacked_linear_follows_weight_changes():
    """The cached stacked weight is rebuilt after in-place updates, replaced parameters, swapped .data and
    resharding (new shapes); with autograd the linears run separately and gradients reach them."""
    a, b = nn.Linear(4, 3, bias=False), nn.Linear(4, 2, bias=False)
    x = torch.randn(5, 4)

    def check():
        with torch.no_grad():
            want = torch.cat([F.linear(x, a.weight), F.linear(x, b.weight)], -1)
            assert torch.allclose(stacked_linear(x, [a, b]), want, atol=1e-6)

    check()
    with torch.no_grad():
        a.weight.mul_(2)
    check()
    b.weight = nn.Parameter(torch.randn(2, 4))
    check()
    a.weight.data = torch.randn(3, 4)
    check()
    b.weight = nn.Parameter(b.weight[:1].clone())
    check()
    stacked_linear(x, [a, b]).sum().backward()
    assert a.weight.grad is not None and b.weight.grad is not None
