"""dasc: selection plans, exact byte accounting, W_max = 0 exactness, INT8, nr/wr load policies, TP placement.

- Plans keep exactly the units whose static horizon exceeds W_max; the random selector is count-matched.
- Every byte figure equals the storage really allocated; capacity gains follow the paper's section 4.1.
- W_max = 0 through the dasc codec and engine is bit-identical to dense (tokens and logits).
- INT8 rows are within half a quantization step; omitted units load as exact zeros (nr).
- wr: window rule on hand-picked horizons; a replay covering the whole prefix restores the dense local units.
- Placement: slot widths, moves, and an exact pack -> store_move -> load_move -> unpack round trip.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import load_zoo, record_logits
from app.cache.checkpoint import CheckpointPool, DenseCodec, physical_slots
from app.dasc.codec import DascCodec, retained_rows
from app.dasc.horizons import EPS, STATIC_A, model_geometry, model_horizons
from app.dasc.layout import slot_bytes, slots_for_budget
from app.dasc.placement import (MODES, load_move, pack_per_rank, plan_placement, split_sizes, store_move,
                                traffic_bytes, unpack_per_rank)
from app.dasc.plan import LayerPlan, SelectionPlan, UnitGeometry, decay_plan, make_plan, random_plan
from app.dasc.policy import local_rows, refresh_local_units, unit_window, wr_window
from app.dasc.quant import dequantize_rows, quantize_rows
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.batch import BatchLayout, ContiguousKV, LinearStates
from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer

# KDA-like: 4 heads x 32 channels; GDN-like: 4 value heads over 2 key heads (bundles of 2), d = 32
KDA = [UnitGeometry(i, "kda", 4, 32, 32) for i in (0, 1, 2, 4)]
GDN = [UnitGeometry(i, "gdn", 4, 32, 32, bundle=2) for i in (0, 1, 2, 4, 5)]
CONV = (96, 3)  # conv window [C, W-1] per layer
HALF_STEP = 0.5 + 3e-5  # half a quantization step, plus fp32 rounding of x / s and q * s (<= 2 * 127 ulp)


def _horizons(geometry: list[UnitGeometry], seed: int) -> list[torch.Tensor]:
    """Log-uniform horizons in [0.5, 2000): every W_max in {16, 64, 512} splits the units."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in geometry:
        shape = (g.heads, g.d_k) if g.kind == "kda" else (g.heads,)
        out.append(0.5 * 4000 ** torch.rand(shape, generator=gen, dtype=torch.float64))
    return out


def _plans(geometry: list[UnitGeometry], seeds=range(4)) -> list[SelectionPlan]:
    """Decay and count-matched random plans over several W_max (a sample that keeps some units)."""
    plans = []
    for seed in seeds:
        for w in (0, 16, 64, 512):
            plan = decay_plan(geometry, _horizons(geometry, seed), w)
            if plan.retained_units:
                plans += [plan, random_plan(plan, seed)]
    return plans


def _template(geometry: list[UnitGeometry], seed: int = 0) -> LinearStates:
    gen = torch.Generator().manual_seed(seed)
    return LinearStates([torch.randn(1, *CONV, generator=gen) for _ in geometry],
                        [torch.randn(1, g.heads, g.d_k, g.d_v, generator=gen) for g in geometry])


def _rows(state: LinearStates, j: int) -> torch.Tensor:
    return state.ssm[j][0].reshape(-1, state.ssm[j].shape[-1])


def _tensor_bytes(codec) -> int:
    tensors = [codec.values, codec.scales, codec.conv] if isinstance(codec, DascCodec) else [codec.conv, codec.ssm]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------------------------------------- 1. plans
def test_decay_plan_keeps_exactly_the_units_above_w_max():
    for geometry in (KDA, GDN):
        horizons = _horizons(geometry, 0)
        horizons[0].view(-1)[:3] = torch.tensor([16.0, math.nextafter(16.0, math.inf), 15.999],
                                                   dtype=torch.float64)  # the boundary
        for w in (16, 64, 512):
            plan = decay_plan(geometry, horizons, w)
            assert plan.w_max == w and plan.selector == "decay"
            for lp, h in zip(plan.layers, horizons):
                assert list(lp.keep) == torch.nonzero(h.reshape(-1) > w).flatten().tolist()
                assert lp.keep_mask().sum().item() == lp.r and lp.n == h.numel()
                assert sum(lp.retained_per_head()) == lp.r
            if w == 16:  # 16 itself is local, the next float above it global
                assert plan.layers[0].keep[0] == 1 and plan.layers[0].horizons[0] == 16.0
        dense = decay_plan(geometry, horizons, 0)
        assert dense.is_dense and dense.retained_fraction == 1.0
        assert all(lp.keep == tuple(range(lp.n)) for lp in dense.layers)
        assert dense.offsets == tuple(sum(lp.n for lp in dense.layers[:i]) for i in range(len(geometry) + 1))


def test_model_horizons_follow_the_static_gate():
    model = load_model(ZOO_DIR / "kda-tiny")
    mixer = model.model.layers[model.linear_layers[0]].mixer.forget_gate
    A, dt = mixer.A_log.detach().double().exp().flatten(), mixer.dt_bias.detach().double().reshape(4, 32)
    want = math.log(EPS) / (-A[:, None] * torch.nn.functional.softplus(STATIC_A + dt))
    got = model_horizons(model)
    assert torch.allclose(got[0], want, rtol=1e-12) and len(got) == len(model.linear_layers)
    assert all(g.kind == "kda" and (g.heads, g.d_k, g.bundle) == (4, 32, 1) for g in model_geometry(model))


def test_random_plan_is_count_matched_and_seeded():
    for geometry in (KDA, GDN):
        plan = decay_plan(geometry, _horizons(geometry, 1), 64)
        a, b, c = random_plan(plan, 7), random_plan(plan, 7), random_plan(plan, 8)
        assert a == b and a.selector == "random:7"
        assert a != c, "a different seed should draw different units"
        for lp, ra in zip(plan.layers, a.layers):
            assert ra.r == lp.r and ra.n == lp.n and ra.horizons == lp.horizons
            assert list(ra.keep) == sorted(set(ra.keep)) and all(0 <= u < ra.n for u in ra.keep)
        assert make_plan(geometry, _horizons(geometry, 1), 64, "random:7") == a
        with pytest.raises(ValueError, match="selector"):
            make_plan(geometry, _horizons(geometry, 1), 64, "topk")


def test_plan_dict_and_json_round_trip():
    for geometry in (KDA, GDN):
        for plan in _plans(geometry, seeds=[2]):
            d = plan.to_dict()
            assert d["n"] == [lp.n for lp in plan.layers] and d["r"] == [lp.r for lp in plan.layers]
            assert SelectionPlan.from_dict(d) == plan
            assert SelectionPlan.from_dict(json.loads(plan.to_json())) == plan


# ---------------------------------------------------------------------------------------------- 2. bytes
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_allocated_bytes_equal_accounting(geometry):
    template = _template(geometry)
    conv_bytes = len(geometry) * CONV[0] * CONV[1] * 4
    dense_temporal = sum(g.heads * g.d_k * g.d_v for g in geometry) * 4
    for plan in _plans(geometry):
        n, r = sum(lp.n for lp in plan.layers), [lp.r for lp in plan.layers]
        rows = [len(retained_rows(lp)) for lp in plan.layers]
        for layout in ("ragged", "padded"):
            for quant in ("none", "int8"):
                codec = DascCodec(template, plan, layout, quant)
                codec.allocate(3)
                want = slot_bytes(plan, layout, quant, conv_bytes)
                assert codec.allocated_bytes_per_slot == codec.bytes_per_slot == want.total
                assert _tensor_bytes(codec) == 3 * want.total and want.conv == conv_bytes
                values = codec.values[0].numel() * codec.values.element_size()
                assert values == want.values + want.padding
                if quant == "none":
                    stored = sum(r) if layout == "ragged" else len(r) * max(r)
                    assert Fraction(dense_temporal, values) == Fraction(n, stored)  # C_temp, section 4.1
                else:  # INT8: 1 byte per value, plus one fp32 scale per (layer, head, k) stored row
                    stored_rows = sum(rows) if layout == "ragged" else len(rows) * max(rows)
                    assert codec.scales[0].numel() == stored_rows and want.scales == 4 * stored_rows
                    assert want.temporal == stored_rows * codec.d_v + 4 * stored_rows
        if plan.is_dense:  # W_max = 0 ragged costs exactly what the dense codec costs
            assert DascCodec(template, plan).bytes_per_slot == DenseCodec(template).bytes_per_slot
    with pytest.raises(ValueError, match="quant must be one of"):
        DascCodec(template, plan, "ragged", "fp8")
    with pytest.raises(ValueError, match="layout must be one of"):
        DascCodec(template, plan, "jagged")


def test_slots_for_budget_is_eq8_and_pools_fit_their_budget():
    assert [slots_for_budget(b, 100) for b in (0, 99, 100, 199, 200, 1000, 1099)] == [0, 0, 0, 0, 1, 9, 9]
    template = _template(KDA)
    for plan in _plans(KDA, seeds=[0])[:4]:
        for quant in ("none", "int8"):
            per_slot = DascCodec(template, plan, "ragged", quant).bytes_per_slot
            for budget in (0, per_slot - 1, per_slot, 2 * per_slot, 7 * per_slot + per_slot // 2):
                codec = DascCodec(template, plan, "ragged", quant)
                physical = physical_slots(codec.bytes_per_slot, budget_bytes=budget)
                codec.allocate(physical)  # what a worker allocates for the pool
                pool = CheckpointPool(codec.bytes_per_slot, physical)
                assert pool.num_slots == slots_for_budget(budget, per_slot)
                assert _tensor_bytes(codec) <= budget and pool.allocated_bytes <= budget
                assert codec.allocated_bytes_per_slot == per_slot  # measured, even with no slot allocated


# ---------------------------------------------------------------------------------------------- 3. W_max = 0
@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_w_max_0_codec_is_bit_identical_to_dense(geometry, layout):
    template = _template(geometry)
    plan = decay_plan(geometry, _horizons(geometry, 0), 0)
    dense, dasc = DenseCodec(template), DascCodec(template, plan, layout)
    dense.allocate(3)
    dasc.allocate(3)
    for slot, seed in ((1, 1), (2, 2)):
        state = _template(geometry, seed)
        dense.store(slot, state)
        dasc.store(slot, state)
    for slot in (1, 2):
        a, b = dense.load(slot), dasc.load(slot)
        for x, y in zip(a.conv + a.ssm, b.conv + b.ssm):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.fixture(scope="module", params=["kda-tiny", "gdn-tiny"])
def zoo(request):
    return load_zoo(request.param)


def _serve(engine: Engine, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0][0] for p in prompts]  # one at a time: later prompts hit


def test_w_max_0_engines_equal_dense_engine(zoo):
    model, tok = zoo
    head = tok.encode("def read(path):\n    with open(path) as f:\n        return f.read()\n\n")
    prompts = [head, head + tok.encode("def write(path, text):\n"), head + tok.encode("x = read('a')\n"), head]
    cfg = dict(checkpoint_slots=16, interval=16, chunk_size=24)
    engines = {"dense": Engine(model, tok, EngineConfig(**cfg)),
               "nr": Engine(model, tok, EngineConfig(**cfg, w_max=0)),
               "wr": Engine(model, tok, EngineConfig(**cfg, w_max=0, policy="wr"))}
    assert isinstance(engines["nr"].codec, DascCodec) and isinstance(engines["dense"].codec, DenseCodec)
    logits = {k: record_logits(e) for k, e in engines.items()}
    outs = {k: _serve(e, prompts) for k, e in engines.items()}
    for k in ("nr", "wr"):
        assert [o.output_ids for o in outs[k]] == [o.output_ids for o in outs["dense"]], k
        assert [o.cached_tokens for o in outs[k]] == [o.cached_tokens for o in outs["dense"]], k
        assert logits[k].keys() == logits["dense"].keys()
        assert all(torch.equal(logits[k][key], v) for key, v in logits["dense"].items()), k
        engines[k].check_integrity()
    assert sum(o.cached_tokens for o in outs["dense"]) > 0 and engines["nr"].cache.counters.loads >= 3
    assert engines["wr"].telemetry.wr_replay_tokens == 0  # nothing omitted: nothing to replay


# ---------------------------------------------------------------------------------------------- 4. INT8
def _check_half_step(x: torch.Tensor) -> None:
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() <= 127
    assert torch.equal(s, x.abs().amax(-1).clamp_min(1e-8) / 127)
    err = (dequantize_rows(q, s).double() - x.double()).abs()
    assert (err <= HALF_STEP * s.double()[:, None]).all(), (err / s.double()[:, None]).max()


def test_int8_rows_within_half_a_step_on_a_grid():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 64, generator=gen)
    rows = [base * m for m in (1e-30, 1e-12, 1e-9, 1e-8, 1e-3, 1.0, 1e3, 1e30)]
    rows.append(torch.zeros(3, 64))
    spiky = torch.randn(4, 64, generator=gen) * 1e-6
    spiky[:, 0] = torch.tensor([1e4, -1e4, 1.0, -3e30])  # one huge element, the rest far below a step
    rows.append(spiky)
    rows.append(torch.linspace(-1, 1, 255)[None].repeat(2, 1))  # exact multiples and midpoints of 1/127
    for x in rows:
        _check_half_step(x)
    q, s = quantize_rows(torch.zeros(2, 5))
    assert torch.equal(dequantize_rows(q, s), torch.zeros(2, 5))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32), min_size=1, max_size=16),
                min_size=1, max_size=4).filter(lambda r: len({len(x) for x in r}) == 1))
def test_int8_rows_within_half_a_step_property(rows):
    _check_half_step(torch.tensor(rows, dtype=torch.float32))


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_int8_codec_round_trip(geometry, layout):
    template = _template(geometry)
    state = _template(geometry, 3)
    state.ssm[0][0, 0] *= 1e4  # rows of very different magnitude
    for plan in _plans(geometry, seeds=[3]):
        codec = DascCodec(template, plan, layout, "int8")
        codec.allocate(2)
        codec.store(1, state)
        out = codec.load(1)
        for j, rows in enumerate(codec.rows):
            got, want = _rows(out, j), _rows(state, j)
            scales = codec._block(codec.scales, 1, j)
            assert torch.equal(scales, want[rows].abs().amax(-1).clamp_min(1e-8) / 127)
            err = (got[rows].double() - want[rows].double()).abs()
            assert (err <= HALF_STEP * scales.double()[:, None]).all()
            omitted = torch.ones(got.shape[0], dtype=torch.bool)
            omitted[rows] = False
            assert torch.count_nonzero(got[omitted]) == 0
        assert all(torch.equal(a, b) for a, b in zip(out.conv, state.conv))


# ---------------------------------------------------------------------------------------------- 5. nr
@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_nr_load_zero_fills_omitted_units_and_keeps_retained_exact(geometry, layout):
    template = _template(geometry)
    for plan in _plans(geometry, seeds=[4]):
        codec = DascCodec(template, plan, layout)
        codec.allocate(3)
        state = _template(geometry, 5)
        codec.store(2, state)
        out = codec.load(2)
        for j, (lp, local) in enumerate(zip(plan.layers, local_rows(plan))):
            got, want = _rows(out, j), _rows(state, j)
            keep = retained_rows(lp)
            assert torch.equal(got[keep], want[keep]) and torch.count_nonzero(got[local]) == 0
            assert len(keep) + len(local) == got.shape[0]
        assert all(torch.equal(a, b) for a, b in zip(out.conv, state.conv))
        before = out.clone()
        out.ssm[0].fill_(7.0)  # the loaded state is a private copy: the checkpoint does not change
        out.conv[0].fill_(7.0)
        again = codec.load(2)
        assert all(torch.equal(a, b) for a, b in zip(again.conv + again.ssm, before.conv + before.ssm))


@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_fused_store_and_load_equal_the_per_layer_ones(geometry, layout, quant):
    """The one-call store and load a GPU uses and the layer-by-layer ones the CPU uses fill a slot and restore
    a state identically."""
    template = _template(geometry)
    state = _template(geometry, 6)
    for plan in _plans(geometry, seeds=[6]):
        codec = DascCodec(template, plan, layout, quant)
        codec.allocate(3)
        codec._store_layers(1, state)
        codec._store_fused(2, state)
        assert torch.equal(codec.values[1], codec.values[2])
        assert codec.scales is None or torch.equal(codec.scales[1], codec.scales[2])
        assert all(torch.equal(a, b) for a, b in zip(codec._load_fused(1), codec._load_layers(1)))


# ---------------------------------------------------------------------------------------------- 6. wr window
def test_unit_window_rule():
    cases = {16: {0.5: 4, 3: 4, 4: 4, 5: 8, 16: 16, 17: 16, 1000: 16},
             64: {0.5: 4, 3: 4, 4: 4, 5: 8, 17: 32, 32: 32, 33: 64, 1000: 64, math.inf: 64},
             1024: {1000: 1024, 513: 1024, 512: 512, 1: 4}}
    for w, table in cases.items():
        assert {h: unit_window(h, w) for h in table} == table, w
    assert unit_window(math.nextafter(16.0, math.inf), 64) == 32  # just above a power of two rounds up


def _hand_plan(w_max: float, keep: tuple[int, ...], horizons: tuple[float, ...]) -> SelectionPlan:
    return SelectionPlan(w_max, "decay", (LayerPlan(0, "kda", 2, 4, 4, keep, horizons),))


def test_wr_window_is_the_max_over_local_units():
    h = (0.5, 3.0, 5.0, 17.0, 900.0, 1000.0, 2.0, 1.0)
    assert wr_window(_hand_plan(64, (4, 5), h)) == 32  # local maximum 17 -> 32; retained 1000 ignored
    assert wr_window(_hand_plan(16, (4, 5), h)) == 16  # clamped to W_max
    assert wr_window(_hand_plan(64, (2, 3, 4, 5), h)) == 4  # locals 0.5, 3, 2, 1 -> clamp to 4
    assert wr_window(_hand_plan(64, (0, 1, 2, 3, 5, 6, 7), h)) == 64  # a random plan may omit a long unit
    assert wr_window(_hand_plan(0, tuple(range(8)), h)) == 0  # nothing omitted
    for geometry in (KDA, GDN):
        assert wr_window(decay_plan(geometry, _horizons(geometry, 0), 0)) == 0
        plan = decay_plan(geometry, _horizons(geometry, 0), 64)
        assert wr_window(plan) == max(unit_window(lp.horizons[u], 64) for lp in plan.layers
                                      for u in range(lp.n) if u not in lp.keep)


def _prefix_state(model, tokens: list[int], pieces: tuple[int, ...]):
    """Dense state and attention KV after `tokens`, computed in chunks of `pieces` tokens."""
    kv, state, pos = ContiguousKV(), model.empty_states(1), 0
    for n in pieces:
        _, state = model(torch.tensor(tokens[pos : pos + n]), BatchLayout((n,), (pos,)), kv, state)
        pos += n
    assert pos == len(tokens)
    storage = {i: kv._store[(i, 0)] for i in model.attention_layers}
    return state, storage, torch.arange(len(tokens))


def _nr_load(model, plan: SelectionPlan, state: LinearStates) -> LinearStates:
    codec = DascCodec(model.empty_states(1), plan)
    codec.allocate(1)
    codec.store(0, state)
    return codec.load(0)


def test_refresh_changes_only_omitted_rows(zoo):
    model, tok = zoo
    tokens = tok.encode("for i in range(10):\n    print(i * i)\n" * 3)
    dense, storage, slots = _prefix_state(model, tokens, (len(tokens),))
    for w in (0, 16):
        plan = make_plan(model_geometry(model), model_horizons(model), w)
        loaded = _nr_load(model, plan, dense)
        state = loaded.clone()
        n = refresh_local_units(model, [tokens], storage, [slots], state, plan, local_rows(plan))
        assert n == min(wr_window(plan), len(tokens))
        assert all(torch.equal(a, b) for a, b in zip(state.conv, loaded.conv))
        for j, (lp, local) in enumerate(zip(plan.layers, local_rows(plan))):
            keep = retained_rows(lp)
            assert torch.equal(_rows(state, j)[keep], _rows(loaded, j)[keep])
        if w == 0:
            assert n == 0 and all(torch.equal(a, b) for a, b in zip(state.ssm, loaded.ssm))
        else:
            assert plan.retained_units < plan.total_units and n > 0
            changed = [torch.count_nonzero(_rows(state, j)[loc]).item() for j, loc in enumerate(local_rows(plan))]
            assert sum(changed) > 0


# ---------------------------------------------------------------------------------------------- 7. wr replay
def test_wr_replay_over_the_whole_prefix_restores_dense_local_units(zoo):
    """Two prefixes shorter than the window, refreshed in one batched replay: each replay starts at position 0."""
    model, tok = zoo
    prefixes = [tok.encode("def add(a, b):\n    return a + b\n"), tok.encode("x = [i for i in y]")]
    plan = make_plan(model_geometry(model), model_horizons(model), 64)
    assert max(map(len, prefixes)) < wr_window(plan) and plan.retained_units < plan.total_units
    assert len(prefixes[0]) != len(prefixes[1])
    dense, storage, slots = [], {i: [] for i in model.attention_layers}, []
    for p in prefixes:  # dense state computed in two chunks, unlike the replay
        state, kv, _ = _prefix_state(model, p, (7, len(p) - 7))
        dense.append(state)
        slots.append(torch.arange(len(p)) + sum(map(len, slots)))
        for i in storage:
            storage[i].append(kv[i])
    storage = {i: torch.cat(parts) for i, parts in storage.items()}
    state = LinearStates.cat([_nr_load(model, plan, d) for d in dense])
    n = refresh_local_units(model, prefixes, storage, slots, state, plan, local_rows(plan))
    assert n == sum(map(len, prefixes))
    for b, want_state in enumerate(dense):
        for j, (lp, local) in enumerate(zip(plan.layers, local_rows(plan))):
            got, want = _rows(state.select([b]), j), _rows(want_state, j)
            assert torch.equal(got[retained_rows(lp)], want[retained_rows(lp)])
            if local.numel():  # a GDN layer may keep every head
                assert (got[local] - want[local]).abs().max().item() <= 1e-5
                assert torch.count_nonzero(want[local]) > 0  # the dense local units are not zero


def test_wr_engine_on_short_prompts_matches_dense(zoo):
    """Prompts shorter than the wr window: every hit replays from position 0, so wr is exact."""
    model, tok = zoo
    prompt = tok.encode("def add(a, b):\n    return a + b\n")
    cfg = dict(checkpoint_slots=8)
    dense = Engine(model, tok, EngineConfig(**cfg))
    wr = Engine(model, tok, EngineConfig(**cfg, w_max=64, policy="wr"))
    assert len(prompt) < wr_window(wr.plan)
    got_d, got_w = _serve(dense, [prompt, prompt]), _serve(wr, [prompt, prompt])
    assert got_w[1].cached_tokens == len(prompt) - 1 and wr.telemetry.wr_replay_tokens == len(prompt) - 1
    assert [o.output_ids for o in got_w] == [o.output_ids for o in got_d]


# ---------------------------------------------------------------------------------------------- 8. placement
KDA8 = [UnitGeometry(i, "kda", 8, 4, 4) for i in range(4)]
GDN8 = [UnitGeometry(i, "gdn", 16, 4, 4, bundle=2) for i in range(3)]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("geometry", [KDA8, GDN8], ids=["kda", "gdn"])
def test_placement_widths_and_moves(geometry, tp):
    fewer = 0  # plans where stage 1 really helps
    for plan in _plans(geometry, seeds=range(6)):
        placements = {m: plan_placement(plan, tp, m) for m in MODES}
        storage_local = tuple(sum(sum(lp.retained_per_head()[r * lp.heads // tp : (r + 1) * lp.heads // tp])
                                  for lp in plan.layers) for r in range(tp))
        c = math.ceil(plan.retained_units / tp)
        assert placements["off"].local_units == placements["storage"].local_units == storage_local
        assert placements["off"].width == max(storage_local) and placements["off"].moves == ()
        for m in ("storage", "balanced"):
            p = placements[m]
            assert p.width == c and sum(p.local_units) == plan.retained_units
            assert p.units_moved() == sum(max(u - c, 0) for u in p.local_units)
            assert all(p.local_units[s] > c > p.local_units[d] for s, d, _ in p.moves)  # only surplus moves
            assert [(s, d) for s, d, _ in p.moves] == sorted({(s, d) for s, d, _ in p.moves})  # all_to_all order
            after = [u - s + r for u, s, r in zip(p.local_units, p.sent_by_rank(), p.received_by_rank())]
            assert max(after) <= c and all(a == c for a, u in zip(after, p.local_units) if u >= c)
            sizes = split_sizes(p)
            assert [sum(row) for row in sizes] == p.sent_by_rank() and all(sizes[r][r] == 0 for r in range(tp))
        assert placements["balanced"].units_moved() <= placements["storage"].units_moved()
        fewer += placements["balanced"].units_moved() < placements["storage"].units_moved()
        for lp, order in zip(plan.layers, placements["balanced"].head_order):
            assert sorted(order) == list(range(lp.heads))
            block = lp.heads // tp
            for r in range(tp):  # bundles stay whole on one rank
                owned = set(order[r * block : (r + 1) * block])
                assert all({b - b % lp.bundle + i for i in range(lp.bundle)} <= owned for b in owned)
        for m, p in placements.items():
            t = traffic_bytes(p, 136)
            assert t.sent == [136 * n for n in p.sent_by_rank()] and sum(t.sent) == sum(t.received)
            assert sum(t.sent) == 136 * p.units_moved() and (m != "off" or sum(t.sent) == 0)
    assert fewer > 0


def test_balanced_never_moves_more_than_storage_when_greedy_loses():
    """Retained units per head [0, 0, 0, 1] and [2, 2, 0, 3] at TP 2: the identity split is already even
    (4, 4), while heaviest-first greedy over the layers ends at (5, 3); balanced must keep the identity."""
    counts = [(0, 0, 0, 1), (2, 2, 0, 3)]
    layers = tuple(LayerPlan(i, "kda", 4, 4, 4, tuple(h * 4 + k for h, n in enumerate(c) for k in range(n)),
                             (1.0,) * 16) for i, c in enumerate(counts))
    plan = SelectionPlan(16.0, "decay", layers)
    storage, balanced = plan_placement(plan, 2, "storage"), plan_placement(plan, 2, "balanced")
    assert storage.local_units == (4, 4) and storage.units_moved() == 0
    assert balanced.width == 4 and balanced.units_moved() == 0


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("geometry", [KDA8, GDN8], ids=["kda", "gdn"])
def test_placement_round_trip_is_exact(geometry, tp):
    for plan in _plans(geometry, seeds=range(3)):
        # every row a distinct nonzero value per element, so a misplaced unit cannot go unnoticed
        full, start = [], 1
        for lp in plan.layers:
            full.append(torch.arange(start, start + lp.heads * lp.d_k * lp.d_v, dtype=torch.float32)
                        .reshape(lp.heads * lp.d_k, lp.d_v))
            start += full[-1].numel()
        for mode in MODES:
            p = plan_placement(plan, tp, mode)
            local = pack_per_rank(plan, p, full)
            assert [b.shape[0] for b in local] == list(p.local_units)
            slots = store_move(p, local)
            assert all(s.shape == (p.width, plan.layers[0].unit_elems) for s in slots)
            stored = torch.cat(slots)
            real = stored[stored.abs().sum(-1) > 0]
            assert real.shape[0] == plan.retained_units  # every retained unit once, the rest zero padding
            assert torch.equal(real[:, 0].sort().values, torch.cat(local)[:, 0].sort().values)
            back = load_move(p, slots)
            assert all(torch.equal(a, b) for a, b in zip(back, local))
            rows = unpack_per_rank(plan, p, back)
            for lp, got, want in zip(plan.layers, rows, full):
                keep = retained_rows(lp)
                omitted = torch.ones(got.shape[0], dtype=torch.bool)
                omitted[keep] = False
                assert torch.equal(got[keep], want[keep]) and torch.count_nonzero(got[omitted]) == 0


def test_placement_rejects_head_counts_that_do_not_divide():
    kda = decay_plan(KDA, _horizons(KDA, 0), 16)
    with pytest.raises(ValueError, match=r"4 head bundles \(4 heads in bundles of 1\).*TP size 8"):
        plan_placement(kda, 8, "balanced")
    gdn = decay_plan(GDN, _horizons(GDN, 0), 16)  # 4 value heads in 2 bundles: TP 2 works, TP 4 does not
    assert plan_placement(gdn, 2, "storage").tp == 2
    with pytest.raises(ValueError, match=r"2 head bundles \(4 heads in bundles of 2\).*TP size 4"):
        plan_placement(gdn, 4, "off")
    odd = decay_plan([UnitGeometry(0, "kda", 6, 4, 4)], [torch.rand(6, 4) * 100], 16)
    with pytest.raises(ValueError, match=r"6 head bundles.*TP size 4"):
        plan_placement(odd, 4, "storage")
    with pytest.raises(ValueError, match="placement must be one of"):
        plan_placement(kda, 2, "greedy")
