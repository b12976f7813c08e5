"""Shared geometry, random horizons and states, and small helpers of the dasc tests."""

from __future__ import annotations

import torch

from app.dasc.codec import DascCodec
from app.dasc.selection import SelectionPlan, decay_plan, random_plan
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.batch import BatchLayout, ContiguousKV, LinearStates
from app.models.geometry import UnitGeometry

# KDA-like: 4 heads x 32 channels; GDN-like: 4 value heads over 2 key heads (bundles of 2), d = 32
KDA = [UnitGeometry(i, "kda", 4, 32, 32) for i in (0, 1, 2, 4)]
GDN = [UnitGeometry(i, "gdn", 4, 32, 32, bundle=2) for i in (0, 1, 2, 4, 5)]
CONV = (96, 3)  # conv window [C, W-1] per layer
HALF_STEP = 0.5 + 3e-5  # half a quantization step, plus fp32 rounding of x / s and q * s (<= 2 * 127 ulp)


def random_horizons(geometry: list[UnitGeometry], seed: int) -> list[torch.Tensor]:
    """Log-uniform horizons in [0.5, 2000): every W_max in {16, 64, 512} splits the units."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in geometry:
        shape = (g.heads, g.d_k) if g.kind == "kda" else (g.heads,)
        out.append(0.5 * 4000 ** torch.rand(shape, generator=gen, dtype=torch.float64))
    return out


def sample_plans(geometry: list[UnitGeometry], seeds=range(4)) -> list[SelectionPlan]:
    """Decay and count-matched random plans over several W_max (a sample that keeps some units)."""
    plans = []
    for seed in seeds:
        for w in (0, 16, 64, 512):
            plan = decay_plan(geometry, random_horizons(geometry, seed), w)
            if plan.retained_units:
                plans += [plan, random_plan(plan, seed)]
    return plans


def random_states(geometry: list[UnitGeometry], seed: int = 0) -> LinearStates:
    gen = torch.Generator().manual_seed(seed)
    return LinearStates([torch.randn(1, *CONV, generator=gen) for _ in geometry],
                        [torch.randn(1, g.heads, g.d_k, g.d_v, generator=gen) for g in geometry])


def state_rows(state: LinearStates, j: int) -> torch.Tensor:
    return state.ssm[j][0].reshape(-1, state.ssm[j].shape[-1])


def codec_tensor_bytes(codec) -> int:
    tensors = [codec.values, codec.scales, codec.conv] if isinstance(codec, DascCodec) else [codec.conv, codec.ssm]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def serve_in_turn(engine: Engine, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0][0] for p in prompts]  # one at a time: later prompts hit


def prefix_state(model, tokens: list[int], pieces: tuple[int, ...]):
    """Dense state and attention KV after `tokens`, computed in chunks of `pieces` tokens."""
    kv, state, pos = ContiguousKV(), model.empty_states(1), 0
    for n in pieces:
        _, state = model(torch.tensor(tokens[pos : pos + n]), BatchLayout((n,), (pos,)), kv, state)
        pos += n
    assert pos == len(tokens)
    storage = {i: kv._store[(i, 0)] for i in model.attention_layers}
    return state, storage, torch.arange(len(tokens))


def nr_load(model, plan: SelectionPlan, state: LinearStates) -> LinearStates:
    codec = DascCodec(model.empty_states(1), plan)
    codec.allocate(1)
    codec.store(0, state)
    return codec.load(0)
