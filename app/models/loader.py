"""Checkpoint directories: resolve a zoo name or path, read config.json, load and save safetensors weights.

A checkpoint directory holds `config.json`, `model.safetensors` (or shards with `model.safetensors.index.json`)
and the tokenizer files. Weights are written in the hub layout that `transformers` itself saves and converts on
load, and read from either the hub layout or transformers' runtime names:

    hub (on disk)                                      runtime (module names here and in transformers)
    kimi  self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}  self_attn.forget_gate.{...}
    kimi  self_attn.{q,k,v}_conv1d.weight              self_attn.conv1d.weight (concatenated, dim 0)
    kimi  block_sparse_moe.                            mlp.
    kimi  ...experts.E.{w1,w3}.weight / w2.weight      mlp.experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I]
    qwen  mlp.experts.E.{gate,up}_proj / down_proj     mlp.experts.gate_up_proj / down_proj
    qwen3.5 (ConditionalGeneration)  model.language_model.   model.
Tensors with no place in the text model (a vision tower's `model.visual.*`, an MTP head's `mtp.*`) are skipped and
named once in the log; any other tensor the model lacks, or a parameter the checkpoint lacks, is an error.
Tensors are read one at a time with `safe_open`, so only what is asked for is in memory.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from app.models.hybrid import HybridForCausalLM
from app.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from app.models.qwen3_5 import MODEL_TYPES as QWEN3_5_TYPES
from app.models.qwen3_5 import NOT_TEXT, Qwen3_5Config, Qwen3_5ForCausalLM, text_name
from app.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

log = logging.getLogger(__name__)
ZOO_DIR = Path(__file__).parent / "zoo"
# config.json's model_type -> (config class, model class); a config's own model_type names its family
FAMILIES = {
    "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    **{t: (Qwen3_5Config, Qwen3_5ForCausalLM) for t in QWEN3_5_TYPES},
}


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A zoo name (`kda-tiny`) or a checkpoint directory."""
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").exists():
        return p
    z = ZOO_DIR / str(name_or_path)
    if z.is_dir() and (z / "config.json").exists():
        return z
    zoo = sorted(d.name for d in ZOO_DIR.iterdir() if (d / "config.json").exists()) if ZOO_DIR.is_dir() else []
    raise FileNotFoundError(f"no model {name_or_path!r}: not a checkpoint directory, and the zoo has {zoo}")


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def family_config(config: dict) -> KimiLinearConfig | Qwen3NextConfig | Qwen3_5Config:
    """The config class of the family named by config['model_type'], read from a config.json dict (either
    layout). Raises ValueError for an unknown family, KeyError for a missing required key."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[family][0].from_dict(config)


def build_model(config: dict) -> HybridForCausalLM:
    """An uninitialised model of the family named by config['model_type']."""
    cfg = family_config(config)
    return FAMILIES[cfg.model_type][1](cfg)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the shard index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def read_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only `names`, opening each shard once."""
    where = checkpoint_files(model_dir)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for n in names:
        by_file[where[n]].append(n)
    out = {}
    for f, ns in by_file.items():
        with safe_open(f, "pt") as h:
            out.update({n: h.get_tensor(n) for n in ns})
    return out


_KIMI_RENAMES = [
    (re.compile(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)"), r"self_attn.forget_gate.\1"),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^(.*\.self_attn)\.(q|k|v)_conv1d\.weight$")


def runtime_plan(names: list[str], skipped: list[str] | None = None) -> dict[str, list[str]]:
    """Runtime tensor name -> the hub tensor names it is built from (in concatenation order). Names with no
    place in a text model are appended to `skipped` when given."""
    plan: dict[str, list[str]] = {}
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for name in names:
        target = text_name(name)
        if target is None:
            if skipped is not None:
                skipped.append(name)
            continue
        for pat, rep in _KIMI_RENAMES:
            target = pat.sub(rep, target)
        if m := _EXPERT.match(target):
            experts[m.group(1)][int(m.group(2))][m.group(3)] = name
        elif m := _CONV.match(target):
            plan.setdefault(f"{m.group(1)}.conv1d.weight", [None, None, None])["qkv".index(m.group(2))] = name
        else:
            plan[target] = [name]
    for prefix, per_expert in experts.items():
        order = sorted(per_expert)
        kimi = "w1" in per_expert[order[0]]
        gate, up, down = ("w1", "w3", "w2") if kimi else ("gate_proj", "up_proj", "down_proj")
        plan[f"{prefix}.gate_up_proj"] = [per_expert[e][w] for e in order for w in (gate, up)]
        plan[f"{prefix}.down_proj"] = [per_expert[e][down] for e in order]
    return plan


def _assemble(target: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:  # stored as the runtime tensor (experts saved fused, as [E, 2I, D] / [E, D, I])
        return parts[0]
    if target.endswith("gate_up_proj"):
        return torch.stack([torch.cat(parts[i : i + 2], dim=0) for i in range(0, len(parts), 2)])
    if target.endswith("experts.down_proj"):
        return torch.stack(parts)
    return torch.cat(parts, dim=0)


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> HybridForCausalLM:
    """Build the model a checkpoint directory describes and load its weights (strict: every parameter once)."""
    model_dir = resolve_model_dir(name_or_path)
    config = read_config(model_dir)
    model = build_model(config)
    model.config_dict = config
    model.model_dir = model_dir
    skipped: list[str] = []
    plan = runtime_plan(list(checkpoint_files(model_dir)), skipped)
    if skipped:
        log.info("%s: skipped %d tensors with no place in the text model: %s", model_dir, len(skipped),
                 _summary(skipped))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        plan.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(plan)), sorted(set(plan) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not fit {config['model_type']}: "
                         f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    raw = read_tensors(model_dir, [n for parts in plan.values() for n in parts])
    with torch.no_grad():
        for target, parts in plan.items():
            t = _assemble(target, [raw[p] for p in parts])
            if t.shape != expected[target].shape:
                t = t.reshape(expected[target].shape)  # e.g. A_log [H] vs [1, 1, H, 1]
            expected[target].copy_(t)
    return cast_model(model, dtype).eval()


def _summary(names: list[str]) -> str:
    """Tensor names grouped by the part they belong to: 'model.visual.* (12), mtp.* (5)'."""
    groups: dict[str, int] = defaultdict(int)
    for n in names:
        groups[next((p for p in NOT_TEXT if n.startswith(p)), n) + "*"] += 1
    return ", ".join(f"{g} ({c})" for g, c in sorted(groups.items()))


def cast_model(model: HybridForCausalLM, dtype: torch.dtype) -> HybridForCausalLM:
    """Floating parameters to `dtype`, except the decay parameters (A_log, dt_bias) and the router bias, which
    stay fp32 as transformers keeps them: the recurrent layers read them in fp32 anyway."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if name.endswith(_DECAY_FP32) else dtype)
    return model


def hub_tensors(model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under hub-layout names (the inverse of `runtime_plan`)."""
    kimi = model.config.model_type == "kimi_linear"
    out = {}
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().contiguous()
        if kimi:
            name = name.replace(".forget_gate.", ".").replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".conv1d.weight") and kimi:
            for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                out[name.replace(".conv1d.", f".{part}_conv1d.")] = chunk.contiguous()
        elif name.endswith("experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}.{e}.{'w1' if kimi else 'gate_proj'}.weight"] = gate.contiguous()
                out[f"{base}.{e}.{'w3' if kimi else 'up_proj'}.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len(".down_proj")]
            for e, w in enumerate(t):
                out[f"{base}.{e}.{'w2' if kimi else 'down_proj'}.weight"] = w.contiguous()
        else:
            out[name] = t
    return out


def save_model(model: HybridForCausalLM, config: dict, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors (hub layout) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hub_tensors(model)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() and not _keep_fp32(k) else v) for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


_DECAY_FP32 = ("A_log", "dt_bias", "e_score_correction_bias")


def _keep_fp32(name: str) -> bool:
    """Decay parameters and router tensors stay fp32, as transformers keeps them (`_keep_in_fp32_modules`)."""
    return name.endswith(_DECAY_FP32) or name.endswith("gate.weight")
