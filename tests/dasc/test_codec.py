"""The dasc codec: W_max = 0 is bit-identical to dense (codec and engine), INT8 rows within half a step,
nr zero-fills omitted units, fused and per-layer store/load agree."""

from __future__ import annotations

import pytest
import torch

from app.cache.checkpoint import DenseCodec
from app.dasc.codec import DascCodec, retained_rows
from app.dasc.policy import local_rows
from app.dasc.selection import decay_plan
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from tests.dasc.common import (
    GDN,
    HALF_STEP,
    KDA,
    random_horizons,
    random_states,
    sample_plans,
    serve_in_turn,
    state_rows,
)
from tests.helpers import record_logits


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_w_max_0_codec_is_bit_identical_to_dense(geometry, layout):
    template = random_states(geometry)
    plan = decay_plan(geometry, random_horizons(geometry, 0), 0)
    dense, dasc = DenseCodec(template), DascCodec(template, plan, layout)
    dense.allocate(3)
    dasc.allocate(3)
    for slot, seed in ((1, 1), (2, 2)):
        state = random_states(geometry, seed)
        dense.store(slot, state)
        dasc.store(slot, state)
    for slot in (1, 2):
        a, b = dense.load(slot), dasc.load(slot)
        for x, y in zip(a.conv + a.ssm, b.conv + b.ssm):
            assert x.dtype == y.dtype and torch.equal(x, y)


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
    outs = {k: serve_in_turn(e, prompts) for k, e in engines.items()}
    for k in ("nr", "wr"):
        assert [o.output_ids for o in outs[k]] == [o.output_ids for o in outs["dense"]], k
        assert [o.cached_tokens for o in outs[k]] == [o.cached_tokens for o in outs["dense"]], k
        assert logits[k].keys() == logits["dense"].keys()
        assert all(torch.equal(logits[k][key], v) for key, v in logits["dense"].items()), k
        engines[k].check_integrity()
    assert sum(o.cached_tokens for o in outs["dense"]) > 0 and engines["nr"].cache.counters.loads >= 3
    assert engines["wr"].telemetry.wr_replay_tokens == 0  # nothing omitted: nothing to replay


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_int8_codec_round_trip(geometry, layout):
    template = random_states(geometry)
    state = random_states(geometry, 3)
    state.ssm[0][0, 0] *= 1e4  # rows of very different magnitude
    for plan in sample_plans(geometry, seeds=[3]):
        codec = DascCodec(template, plan, layout, "int8")
        codec.allocate(2)
        codec.store(1, state)
        out = codec.load(1)
        for j, rows in enumerate(codec.rows):
            got, want = state_rows(out, j), state_rows(state, j)
            scales = codec._block(codec.scales, 1, j)
            assert torch.equal(scales, want[rows].abs().amax(-1).clamp_min(1e-8) / 127)
            err = (got[rows].double() - want[rows].double()).abs()
            assert (err <= HALF_STEP * scales.double()[:, None]).all()
            omitted = torch.ones(got.shape[0], dtype=torch.bool)
            omitted[rows] = False
            assert torch.count_nonzero(got[omitted]) == 0
        assert all(torch.equal(a, b) for a, b in zip(out.conv, state.conv))


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_nr_load_zero_fills_omitted_units_and_keeps_retained_exact(geometry, layout):
    template = random_states(geometry)
    for plan in sample_plans(geometry, seeds=[4]):
        codec = DascCodec(template, plan, layout)
        codec.allocate(3)
        state = random_states(geometry, 5)
        codec.store(2, state)
        out = codec.load(2)
        for j, (lp, local) in enumerate(zip(plan.layers, local_rows(plan))):
            got, want = state_rows(out, j), state_rows(state, j)
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
    template = random_states(geometry)
    state = random_states(geometry, 6)
    for plan in sample_plans(geometry, seeds=[6]):
        codec = DascCodec(template, plan, layout, quant)
        codec.allocate(3)
        codec._store_layers(1, state)
        codec._store_fused(2, state)
        assert torch.equal(codec.values[1], codec.values[2])
        assert codec.scales is None or torch.equal(codec.scales[1], codec.scales[2])
        assert all(torch.equal(a, b) for a, b in zip(codec._load_fused(1), codec._load_layers(1)))
