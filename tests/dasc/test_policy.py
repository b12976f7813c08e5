"""Load policies: the wr window rule, refresh touches only omitted rows, a whole-prefix replay restores
the dense local units, wr on short prompts equals dense."""

from __future__ import annotations

import math

import torch

from app.dasc.codec import retained_rows
from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.policy import local_rows, refresh_local_units, unit_window, wr_window
from app.dasc.selection import LayerPlan, SelectionPlan, decay_plan, make_plan
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.models.batch import LinearStates
from tests.dasc.common import GDN, KDA, nr_load, prefix_state, random_horizons, serve_in_turn, state_rows


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
        assert wr_window(decay_plan(geometry, random_horizons(geometry, 0), 0)) == 0
        plan = decay_plan(geometry, random_horizons(geometry, 0), 64)
        assert wr_window(plan) == max(unit_window(lp.horizons[u], 64) for lp in plan.layers
                                      for u in range(lp.n) if u not in lp.keep)


def test_refresh_changes_only_omitted_rows(zoo):
    model, tok = zoo
    tokens = tok.encode("for i in range(10):\n    print(i * i)\n" * 3)
    dense, storage, slots = prefix_state(model, tokens, (len(tokens),))
    for w in (0, 16):
        plan = make_plan(model_geometry(model), model_horizons(model), w)
        loaded = nr_load(model, plan, dense)
        state = loaded.clone()
        n = refresh_local_units(model, [tokens], storage, [slots], state, plan, local_rows(plan))
        assert n == min(wr_window(plan), len(tokens))
        assert all(torch.equal(a, b) for a, b in zip(state.conv, loaded.conv))
        for j, lp in enumerate(plan.layers):
            keep = retained_rows(lp)
            assert torch.equal(state_rows(state, j)[keep], state_rows(loaded, j)[keep])
        if w == 0:
            assert n == 0 and all(torch.equal(a, b) for a, b in zip(state.ssm, loaded.ssm))
        else:
            assert plan.retained_units < plan.total_units and n > 0
            changed = [torch.count_nonzero(state_rows(state, j)[loc]).item() for j, loc in enumerate(local_rows(plan))]
            assert sum(changed) > 0


def test_wr_replay_over_the_whole_prefix_restores_dense_local_units(zoo):
    """Two prefixes shorter than the window, refreshed in one batched replay: each replay starts at position 0."""
    model, tok = zoo
    prefixes = [tok.encode("def add(a, b):\n    return a + b\n"), tok.encode("x = [i for i in y]")]
    plan = make_plan(model_geometry(model), model_horizons(model), 64)
    assert max(map(len, prefixes)) < wr_window(plan) and plan.retained_units < plan.total_units
    assert len(prefixes[0]) != len(prefixes[1])
    dense, storage, slots = [], {i: [] for i in model.attention_layers}, []
    for p in prefixes:  # dense state computed in two chunks, unlike the replay
        state, kv, _ = prefix_state(model, p, (7, len(p) - 7))
        dense.append(state)
        slots.append(torch.arange(len(p)) + sum(map(len, slots)))
        for i in storage:
            storage[i].append(kv[i])
    storage = {i: torch.cat(parts) for i, parts in storage.items()}
    state = LinearStates.cat([nr_load(model, plan, d) for d in dense])
    n = refresh_local_units(model, prefixes, storage, slots, state, plan, local_rows(plan))
    assert n == sum(map(len, prefixes))
    for b, want_state in enumerate(dense):
        for j, (lp, local) in enumerate(zip(plan.layers, local_rows(plan))):
            got, want = state_rows(state.select([b]), j), state_rows(want_state, j)
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
    got_d, got_w = serve_in_turn(dense, [prompt, prompt]), serve_in_turn(wr, [prompt, prompt])
    assert got_w[1].cached_tokens == len(prompt) - 1 and wr.telemetry.wr_replay_tokens == len(prompt) - 1
    assert [o.output_ids for o in got_w] == [o.output_ids for o in got_d]
