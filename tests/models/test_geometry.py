"""The recurrent geometry a family config derives equals what the built model's mixers hold and produce.

Zoo models: the states a forward from zero state returns, the conv weights and the decay tensors of the
checkpoint. The full-size fake Kimi-Linear-48B / Qwen3-Next-80B configs the plan-tool tests write: the weights
of the model built on the meta device (no memory), and the geometry the plan tool reads from their checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from app.dasc import plan as plan_tool
from app.dasc.horizons import model_geometry
from app.models.batch import BatchLayout
from app.models.geometry import RecurrentGeometry, UnitGeometry
from app.models.loader import ZOO_DIR, build_model, checkpoint_files, family_config, load_model, read_config
from app.models.shard import shard_model
from loadtest.fake_checkpoints import (
    KIMI_LINEAR_48B_CONFIG,
    QWEN3_NEXT_80B_CONFIG,
    decay_tensor_names,
    write_kimi_linear_48b,
    write_qwen3_next_80b,
)

FAKES = {"kimi": (KIMI_LINEAR_48B_CONFIG, write_kimi_linear_48b), "qwen": (QWEN3_NEXT_80B_CONFIG, write_qwen3_next_80b)}


def _decay_holder(mixer):
    return getattr(mixer, "forget_gate", mixer)


def _check_weights(model, geometry: tuple[RecurrentGeometry, ...]) -> None:
    """Every recurrent mixer's conv and decay parameters have the sizes its geometry states."""
    assert [g.layer for g in geometry] == model.linear_layers
    assert model_geometry(model) == [g.units for g in geometry]
    for geo in geometry:
        mixer = model.model.layers[geo.layer].mixer
        assert tuple(mixer.conv1d.weight.shape) == (geo.conv_channels, 1, geo.conv_kernel)
        holder = _decay_holder(mixer)
        assert holder.A_log.numel() == geo.units.heads
        assert holder.dt_bias.numel() == geo.units.num_units
        assert mixer.state_shapes() == geo.state_shapes()


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_zoo_geometry_equals_the_built_mixers_and_their_states(name):
    d = ZOO_DIR / name
    geometry = family_config(read_config(d)).recurrent_geometry()
    model = load_model(d)
    _check_weights(model, geometry)
    assert geometry == tuple(model.model.layers[i].mixer.geometry for i in model.linear_layers)
    names = set(checkpoint_files(d))
    for geo in geometry:
        assert any(n in names for n in geo.decay_names("A_log"))
        assert any(n in names for n in geo.decay_names("dt_bias"))
    with torch.no_grad():
        _, states = model(torch.arange(2 * 5) % 100, BatchLayout.uniform(2, 5))
    for geo, conv, ssm in zip(geometry, states.conv, states.ssm):
        conv_shape, ssm_shape = geo.state_shapes()
        assert tuple(conv.shape) == (2, *conv_shape) and tuple(ssm.shape) == (2, *ssm_shape)


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_a_tp_shard_holds_its_share_of_the_geometry(name):
    model = load_model(ZOO_DIR / name)
    full = [model.model.layers[i].mixer.geometry for i in model.linear_layers]
    shard_model(model, 1, 2)
    for whole in full:
        geo, mixer = whole.shard(2), model.model.layers[whole.layer].mixer
        assert mixer.geometry == geo and 2 * geo.units.heads == whole.units.heads
        assert tuple(mixer.conv1d.weight.shape) == (geo.conv_channels, 1, geo.conv_kernel)
        assert _decay_holder(mixer).dt_bias.numel() == geo.units.num_units
    assert [tuple(c.shape[1:]) for c in model.empty_states(1).conv] == [g.shard(2).state_shapes()[0] for g in full]


@pytest.mark.parametrize("name", ["kimi", "qwen"])
def test_production_geometry_equals_the_meta_model_and_the_plan_tool(name, tmp_path):
    config, write = FAKES[name]
    geometry = family_config(config).recurrent_geometry()
    with torch.device("meta"):
        model = build_model(config)
    _check_weights(model, geometry)

    d = write(tmp_path, ballast=False)
    ckpt = plan_tool.read_checkpoint(d)
    assert ckpt.geometry == tuple(g.units for g in geometry)
    assert (ckpt.conv_channels, ckpt.conv_window) == (geometry[0].conv_channels, geometry[0].conv_window)
    assert sorted(ckpt.tensors_read) == decay_tensor_names(d)
    hub_names = [g.decay_names(leaf)[0] for g in geometry for leaf in ("A_log", "dt_bias")]
    assert sorted(ckpt.tensors_read) == sorted(hub_names)


def test_production_geometry_figures():
    kimi = family_config(KIMI_LINEAR_48B_CONFIG).recurrent_geometry()
    assert [g.layer + 1 for g in kimi] == KIMI_LINEAR_48B_CONFIG["linear_attn_config"]["kda_layers"]
    assert kimi[0] == RecurrentGeometry(UnitGeometry(0, "kda", 32, 128, 128, 1), 3 * 32 * 128, 4,
                                        ("model.layers.0.self_attn.", "model.layers.0.self_attn.forget_gate."))
    qwen = family_config(QWEN3_NEXT_80B_CONFIG).recurrent_geometry()
    assert [g.layer for g in qwen] == [i for i in range(48) if (i + 1) % 4]
    assert qwen[0] == RecurrentGeometry(UnitGeometry(0, "gdn", 32, 128, 128, 2), 2 * 16 * 128 + 32 * 128, 4,
                                        ("model.layers.0.linear_attn.",))
    rank = qwen[0].shard(8)  # 2 of the 16 key heads, with their 4 value heads
    assert qwen[0].bundles == 16 and rank.units.heads == 4 and rank.conv_channels == 2 * 2 * 128 + 4 * 128


@pytest.mark.parametrize("geo", [
    lambda: UnitGeometry(0, "mamba", 4, 8, 8),
    lambda: UnitGeometry(0, "gdn", 6, 8, 8, bundle=4),
    lambda: UnitGeometry(0, "kda", 4, 8, 8, bundle=2),
    lambda: UnitGeometry(0, "kda", 0, 8, 8),
    lambda: RecurrentGeometry(UnitGeometry(0, "gdn", 4, 8, 8, 2), 41, 4, ("linear_attn.",)),
    lambda: RecurrentGeometry(UnitGeometry(0, "kda", 4, 8, 8), 96, 1, ("self_attn.",)),
])
def test_inconsistent_geometry_is_rejected(geo):
    with pytest.raises(ValueError):
        geo()
