"""Synthetic tokenizers of the families' chat formats (for tests, and for benchmarks of a chat format the zoo
models were not trained with, such as Qwen3.5's thinking turns): the zoo's BPE vocabulary plus the special tokens of
Qwen3-Next, Kimi-Linear or Qwen3.5, with the vendored template (app/models/templates/), written as a tokenizer
directory that both our `Tokenizer` and transformers' `AutoTokenizer` load.

Qwen3.5's added tokens are its hub tokenizer_config.json's, in their order (ids 248044-248069 there; the zoo's
first three ids are its first three): those through `<|video_pad|>` special, the tool, FIM and think markers not
(as Qwen3's); eos `<|im_end|>`, pad `<|endoftext|>`, no bos."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from app.models.loader import ZOO_DIR
from app.models.tokenizer import TEMPLATES

# (special tokens beyond the zoo's three, eos, template file); Qwen's tool tokens are added but not special
FAMILIES = {
    "qwen3_next": ([("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
                    ("</tool_response>", False)], "<|im_end|>", "qwen3_next.jinja"),
    "kimi_linear": ([("[EOS]", True), ("<|im_user|>", True), ("<|im_assistant|>", True), ("<|im_system|>", True),
                     ("<|im_middle|>", True), ("<|tool_calls_section_begin|>", True),
                     ("<|tool_calls_section_end|>", True), ("<|tool_call_begin|>", True),
                     ("<|tool_call_argument_begin|>", True), ("<|tool_call_end|>", True)], "[EOS]",
                    "kimi_linear.jinja"),
    "qwen3_5": ([(t, True) for t in ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                     "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] +
                [(t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                      "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                                      "<tool_response>", "</tool_response>", "<think>", "</think>")],
                "<|im_end|>", "qwen3_5.jinja"),
}
CONFIGS = {"qwen3_5": {"bos_token": None, "pad_token": "<|endoftext|>"}}  # tokenizer_config.json beyond the zoo's


def write_family_tokenizer(family: str, out: Path, jinja_file: bool = False) -> Path:
    """`jinja_file`: the template as chat_template.jinja beside the config (newer hub repositories), not in it."""
    extra, eos, template = FAMILIES[family]
    backend = Backend.from_file(str(ZOO_DIR / "_tokenizer" / "tokenizer.json"))
    for content, special in extra:
        token = AddedToken(content, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = json.loads((ZOO_DIR / "_tokenizer" / "tokenizer_config.json").read_text())
    decoder = {str(i): {"content": t.content, "lstrip": False, "rstrip": False, "normalized": False,
                        "single_word": False, "special": t.special}
               for i, t in sorted(backend.get_added_tokens_decoder().items())}
    config.update(added_tokens_decoder=decoder, eos_token=eos, chat_template=(TEMPLATES / template).read_text(),
                  **CONFIGS.get(family, {}))
    if jinja_file:
        (out / "chat_template.jinja").write_text(config.pop("chat_template"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return out


def write_family_checkpoint(family: str, out: Path) -> Path:
    """kda-tiny under a family's synthetic tokenizer: the zoo's weights with the embedding and output rows of the
    added tokens zero (never predicted unless a request biases them), so that a request's `logit_bias` can make
    the model open a tool call with the format's one-token opener."""
    import torch
    from safetensors.torch import load_file, save_file

    write_family_tokenizer(family, out)
    size = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]) + len(FAMILIES[family][0])
    config = json.loads((ZOO_DIR / "kda-tiny" / "config.json").read_text())
    weights = load_file(str(ZOO_DIR / "kda-tiny" / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        weights[name] = torch.cat([w, torch.zeros(size - w.shape[0], w.shape[1], dtype=w.dtype)])
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": size}, indent=2))
    save_file(weights, str(out / "model.safetensors"))
    return out
