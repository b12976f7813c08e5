"""The plan tool (`python -m app.dasc.plan`) on full-geometry fake Kimi-Linear-48B and Qwen3-Next-80B checkpoints.

Every figure it prints is recomputed here from the raw decay tensors with plain numpy, without the project's
plan / layout / placement code: horizons, r_l, sum n_l / sum r_l, L * max r_l, per-rank units (off: contiguous
head blocks; storage and balanced: ceil(sum / T)), conv and INT8 bytes, slots (Eq. 8). The fakes carry
full-vocabulary embedding and LM-head shards (sparse on disk, > 1 GiB if read), so the RSS bound and the
safe_open spy show the tool reads the decay tensors and nothing else. The six Qwen3.5 fakes (published configs,
hub ConditionalGeneration layout, no ballast) are read through the `model.language_model.` prefix and checked
the same way.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

import app.models.loader as loader
from app.dasc import plan as plan_tool
from loadtest.fake_checkpoints import (
    KIMI_LINEAR_48B_CONFIG,
    QWEN3_NEXT_80B_CONFIG,
    decay_tensor_names,
    write_kimi_linear_48b,
    write_qwen3_5,
    write_qwen3_next_80b,
)
from loadtest.qwen3_5_configs import QWEN3_5_CONFIGS

W_MAX = [16, 64, 128, 512]
TP = 8
# paper appendix C.1: per-rank budgets equal to 128 dense physical slots (127 deployable)
BUDGET = {"kimi": 694_681_600, "qwen": 1_236_271_104}
PAPER_PROFILE = {"kimi": (0.471, 0.170, 0.774), "qwen": (0.969, 0.894, 0.997)}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_ckpts")
    return {"kimi": write_kimi_linear_48b(root / "kimi"), "qwen": write_qwen3_next_80b(root / "qwen")}


def _run_json(argv: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan_tool.main(argv) == 0
    return json.loads(buf.getvalue())


# ---------------------------------------------------------------------------------------------------------
# the independent reference
def _reference_horizons(model_dir: Path) -> tuple[dict, list[np.ndarray]]:
    """(geometry, horizons [H, units per head] per recurrent layer) straight from config.json and the shards."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    # hub ConditionalGeneration form (Qwen3.5): the text model's keys under text_config, weights under
    # model.language_model.
    layers_prefix = "model.language_model.layers" if "text_config" in cfg else "model.layers"
    cfg = cfg.get("text_config", cfg)
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] == "kimi_linear":
        lin = cfg["linear_attn_config"]
        heads, k = lin["num_heads"], lin["head_dim"]
        geo = dict(layers=[j - 1 for j in lin["kda_layers"]], heads=heads, per_head=k, unit_elems=k, scales=1,
                   bundle=1, conv_channels=3 * heads * k, conv_window=lin["short_conv_kernel_size"] - 1,
                   prefix="self_attn", num_layers=n)
    else:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        geo = dict(layers=[i for i in range(n) if (i + 1) % cfg["full_attention_interval"]], heads=hv, per_head=1,
                   unit_elems=dk * dv, scales=dk, bundle=hv // hk, conv_channels=2 * hk * dk + hv * dv,
                   conv_window=cfg["linear_conv_kernel_dim"] - 1, prefix="linear_attn", num_layers=n)

    def read(name):
        with safe_open(model_dir / weight_map[name], "np") as f:
            return f.get_tensor(name).astype(np.float64)

    horizons = []
    for i in geo["layers"]:
        a_log = read(f"{layers_prefix}.{i}.{geo['prefix']}.A_log").reshape(-1)
        dt = read(f"{layers_prefix}.{i}.{geo['prefix']}.dt_bias").reshape(geo["heads"], geo["per_head"])
        g = -np.exp(a_log)[:, None] * np.logaddexp(0.0, -0.3 + dt)
        horizons.append(np.log(1e-3) / g)
    return geo, horizons


def _reference_figures(geo: dict, horizons: list[np.ndarray], w: float, tp: int, budget: int) -> dict:
    keep = [h > w if w > 0 else np.ones(h.shape, bool) for h in horizons]
    L, n = len(keep), geo["heads"] * geo["per_head"]
    r = [int(k.sum()) for k in keep]
    block = geo["heads"] // tp
    per_rank = [sum(int(k[q * block : (q + 1) * block].sum()) for k in keep) for q in range(tp)]
    width = {"off": max(per_rank), "storage": math.ceil(sum(per_rank) / tp)}
    width["balanced"] = width["storage"]
    conv_rank = math.ceil(L * geo["conv_channels"] * geo["conv_window"] * 2 / tp)
    fp32 = {m: u * geo["unit_elems"] * 4 + conv_rank for m, u in width.items()}
    int8 = {m: u * (geo["unit_elems"] + 4 * geo["scales"]) + conv_rank for m, u in width.items()}
    return dict(r=r, total=L * n, padded_units=L * max(r), ragged_units=sum(r), per_rank=per_rank, width=width,
                fp32=fp32, int8=int8, moved_storage=sum(max(u - width["storage"], 0) for u in per_rank),
                slots={m: budget // b - 1 for m, b in fp32.items()},
                int8_slots={m: budget // b - 1 for m, b in int8.items()})


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kimi", "qwen"])
def test_every_figure_matches_an_independent_recount(ckpts, name):
    d = ckpts[name]
    rep = _run_json([str(d), "--w-max", *map(str, W_MAX), "--tp", str(TP), "--budget-bytes", str(BUDGET[name]),
                     "--json"])
    geo, horizons = _reference_horizons(d)
    assert rep["recurrent_layers"] == geo["layers"]
    assert (rep["heads"], rep["bundle"], rep["units_per_layer"]) == (geo["heads"], geo["bundle"],
                                                                     geo["heads"] * geo["per_head"])
    assert rep["conv"]["bytes"] == len(geo["layers"]) * geo["conv_channels"] * geo["conv_window"] * 2
    assert sorted(rep["tensors_read"]) == decay_tensor_names(d)

    dense = _reference_figures(geo, horizons, 0, TP, BUDGET[name])
    assert rep["dense"]["placements"]["off"]["bottleneck_bytes"] == dense["fp32"]["off"]
    assert all(pl["slots"] == 127 for pl in rep["dense"]["placements"].values())  # the paper's 127 dense slots
    assert [row["w_max"] for row in rep["rows"]] == W_MAX
    for row, w in zip(rep["rows"], W_MAX):
        ref = _reference_figures(geo, horizons, w, TP, BUDGET[name])
        assert row["retained_per_layer"] == ref["r"]
        assert row["retained_units"] == ref["ragged_units"] and row["total_units"] == ref["total"]
        assert row["retained_fraction"] == pytest.approx(ref["ragged_units"] / ref["total"], rel=1e-12)
        assert row["temporal_ratio"]["ragged"] == pytest.approx(ref["total"] / ref["ragged_units"], rel=1e-12)
        assert row["temporal_ratio"]["padded"] == pytest.approx(ref["total"] / ref["padded_units"], rel=1e-12)
        for mode, pl in row["placements"].items():
            assert pl["bottleneck_units"] == ref["width"][mode], mode
            assert pl["bottleneck_bytes"] == ref["fp32"][mode], mode
            assert pl["int8_bottleneck_bytes"] == ref["int8"][mode], mode
            assert pl["complete_ratio"] == pytest.approx(dense["fp32"][mode] / ref["fp32"][mode], rel=1e-12)
            assert pl["int8_complete_ratio"] == pytest.approx(dense["fp32"][mode] / ref["int8"][mode], rel=1e-12)
            assert pl["slots"] == ref["slots"][mode] and pl["int8_slots"] == ref["int8_slots"][mode], mode
            assert sum(pl["local_units"]) == ref["ragged_units"]
        assert row["placements"]["off"]["local_units"] == ref["per_rank"]
        assert row["placements"]["storage"]["units_moved"] == ref["moved_storage"]
        assert max(row["placements"]["balanced"]["local_units"]) <= max(ref["per_rank"])
        assert row["placements"]["balanced"]["units_moved"] <= ref["moved_storage"]
        assert row["complete_ratio"] == row["placements"]["balanced"]["complete_ratio"]


@pytest.mark.parametrize("name", ["kimi", "qwen"])
def test_fake_decay_profile_matches_the_paper(ckpts, name):
    _, horizons = _reference_horizons(ckpts[name])
    alpha = np.exp(np.log(1e-3) / np.concatenate([h.ravel() for h in horizons]))
    median, lo, hi = PAPER_PROFILE[name]
    assert np.quantile(alpha, [0.25, 0.5, 0.75]) == pytest.approx([lo, median, hi], abs=0.005)


def test_reads_only_the_decay_tensors(ckpts, monkeypatch):
    opened, fetched = [], []
    real = loader.safe_open

    class Spy:
        def __init__(self, path, framework, *args, **kwargs):
            opened.append(Path(path).name)
            self._cm = real(path, framework, *args, **kwargs)

        def __enter__(self):
            self._h = self._cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            fetched.append(name)
            return self._h.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    for d in ckpts.values():
        opened.clear()
        fetched.clear()
        _run_json([str(d), "--tp", str(TP), "--json"])
        weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(fetched) == decay_tensor_names(d)
        assert len(opened) == len(set(opened)), "a shard was opened twice"
        assert {weight_map[n] for n in decay_tensor_names(d)} == set(opened)
        assert weight_map["model.embed_tokens.weight"] not in opened and weight_map["lm_head.weight"] not in opened


_PROBE = """
import contextlib, io, json, resource, runpy, sys
import torch, app.models.loader  # the tool's own imports: outside the measured growth
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
touch, model_dir, *rest = sys.argv[1:]
if touch != "-":  # negative control: materialise one weight the tool must never read
    app.models.loader.read_tensors(model_dir, [touch])[touch].clone().add_(1)  # real pages, not a mapped hole
sys.argv = ["python -m app.dasc.plan", model_dir, *rest]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    runpy.run_module("app.dasc.plan", run_name="__main__", alter_sys=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rss_base_kb": base, "rss_peak_kb": peak, "report": json.loads(out.getvalue())}))
"""
RSS_LIMIT = 2**30  # the requirement; the tool itself needs ~20 MB (plans of 82k horizons), see RSS_EXPECTED
RSS_EXPECTED = 256 * 2**20


def _probe(model_dir: Path, touch: str = "-") -> tuple[dict, int]:
    """(probe output, peak RSS growth in bytes after the imports)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, touch, str(model_dir), "--w-max", *map(str, W_MAX),
                           "--tp", str(TP), "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout)
    return probe, (probe["rss_peak_kb"] - probe["rss_base_kb"]) * 1024


@pytest.mark.parametrize("name", ["kimi", "qwen"])
def test_cli_process_stays_small(ckpts, name):
    """The `python -m app.dasc.plan` entry point as its own process: peak RSS growth past the imports < 1 GiB (in
    fact < 256 MiB) on a checkpoint whose full-vocabulary embedding and LM head alone would add more than 1 GiB
    if the tool read and used them. Its speed follows from what it reads: the decay tensors only
    (test_reads_only_the_decay_tensors), a few MB here."""
    d = ckpts[name]
    assert json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["total_size"] > 2**30
    probe, growth = _probe(d)
    assert growth < RSS_LIMIT and growth < RSS_EXPECTED, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    assert probe["report"] == _run_json([str(d), "--w-max", *map(str, W_MAX), "--tp", str(TP), "--json"])


@pytest.mark.parametrize("name,tp,numbers", [("kimi", 3, ["32 KDA heads", "--tp 3", "32 % 3 = 2"]),
                                             ("qwen", 32, ["16 GDN key heads", "32 value heads", "--tp 32"]),
                                             ("qwen", 3, ["16 GDN key heads", "--tp 3", "16 % 3 = 1"])])
def test_heads_not_divisible_by_tp_error_clearly(ckpts, capsys, name, tp, numbers):
    with pytest.raises(SystemExit) as exc:
        plan_tool.main([str(ckpts[name]), "--tp", str(tp), "--json"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ")
    for text in numbers:
        assert text in captured.err


def test_plot_writes_both_pngs(ckpts, tmp_path, capsys):
    for name, d in ckpts.items():
        out = tmp_path / name
        assert plan_tool.main([str(d), "--w-max", *map(str, W_MAX), "--tp", str(TP), "--plot", str(out)]) == 0
        assert "W_max" in capsys.readouterr().out  # the table still prints
        for png in ("decay_profile.png", "retained_map.png"):
            data = (out / png).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png


def test_runtime_names_and_single_file_checkpoint(ckpts, tmp_path):
    """transformers' runtime naming (self_attn.forget_gate.*) in one unsharded file reads the same horizons."""
    src = ckpts["kimi"]
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name in decay_tensor_names(src):
        with safe_open(src / weight_map[name], "pt") as f:
            tensors[name.replace("self_attn.", "self_attn.forget_gate.")] = f.get_tensor(name)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    a, b = plan_tool.read_checkpoint(src), plan_tool.read_checkpoint(tmp_path)
    assert [g.layer for g in a.geometry] == [g.layer for g in b.geometry]
    assert all((x == y).all() for x, y in zip(a.horizons, b.horizons))
    assert all(".forget_gate." in n for n in b.tensors_read)


@pytest.mark.parametrize("config,edit,message", [
    (KIMI_LINEAR_48B_CONFIG, lambda c: c["linear_attn_config"].update(kda_layers=[0, 1, 28]),
     "linear_attn_config.kda_layers is 1-indexed over 27 layers; out of range: [0, 28]"),
    (KIMI_LINEAR_48B_CONFIG, lambda c: c.pop("num_hidden_layers"),
     "config.json lacks 'num_hidden_layers' for kimi_linear"),
    (KIMI_LINEAR_48B_CONFIG, lambda c: c.update(layer_types=["full_attention"] * 27),
     "config.json names no linear-attention layers"),
    (QWEN3_NEXT_80B_CONFIG, lambda c: c.update(linear_num_value_heads=24),
     "linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16"),
    (QWEN3_NEXT_80B_CONFIG, lambda c: c.update(model_type="llama"), "unsupported model_type 'llama'"),
])
def test_bad_config_json_errors_clearly(tmp_path, capsys, config, edit, message):
    """Bad config.json content stops the tool before any tensor is read, with the reason on stderr."""
    config = copy.deepcopy(config)
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        plan_tool.main([str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


# ---------------------------------------------------------------------------------------------------------
# Qwen3.5: published configs in the hub's ConditionalGeneration form (loadtest/qwen3_5_configs.py)
QWEN3_5 = sorted(QWEN3_5_CONFIGS)
# the model cards' figures, typed in independently of the config module: (layers, GDN value heads, GDN key heads,
# attention Q heads, KV heads, tied embeddings)
QWEN3_5_CARDS = {
    "qwen3.5-0.8b": (24, 16, 16, 8, 2, True), "qwen3.5-2b": (24, 16, 16, 8, 2, True),
    "qwen3.5-9b": (32, 32, 16, 16, 4, False), "qwen3.5-27b": (64, 48, 16, 24, 4, False),
    "qwen3.5-35b-a3b": (40, 32, 16, 16, 2, False), "qwen3.5-397b-a17b": (60, 64, 16, 32, 2, False),
}


@pytest.fixture(scope="module")
def qwen3_5_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_qwen3_5")
    return {name: write_qwen3_5(name, root / name, ballast=False) for name in QWEN3_5}


def _gdn_geometry(name: str) -> dict:
    text = QWEN3_5_CONFIGS[name]["text_config"]
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    return dict(layers=[i for i in range(text["num_hidden_layers"]) if (i + 1) % text["full_attention_interval"]],
                hk=hk, hv=hv, dk=dk, dv=dv, conv_channels=2 * hk * dk + hv * dv,
                conv_window=text["linear_conv_kernel_dim"] - 1)


def test_qwen3_5_configs_match_the_model_cards():
    for name, (layers, hv, hk, q, kv, tied) in QWEN3_5_CARDS.items():
        cfg = QWEN3_5_CONFIGS[name]
        text = cfg["text_config"]
        moe = text.get("num_experts", 0) > 0
        assert cfg["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5"), name
        assert text["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text"), name
        assert (text["num_hidden_layers"], text["linear_num_value_heads"], text["linear_num_key_heads"],
                text["num_attention_heads"], text["num_key_value_heads"]) == (layers, hv, hk, q, kv), name
        assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128 and text["head_dim"] == 256
        assert cfg["tie_word_embeddings"] is text["tie_word_embeddings"] is tied, name
        assert text["layer_types"] == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                       for i in range(layers)], name
        assert cfg["vision_config"]["out_hidden_size"] == text["hidden_size"], name


@pytest.mark.parametrize("name", QWEN3_5)
def test_qwen3_5_fake_reads_through_the_conditional_generation_prefix(qwen3_5_ckpts, name):
    d, geo = qwen3_5_ckpts[name], _gdn_geometry(name)
    rep = _run_json([str(d), "--w-max", "16", "64", "--tp", str(TP), "--json"])
    assert rep["family"] == "qwen3_5" and rep["kind"] == "gdn"
    assert rep["num_hidden_layers"] == QWEN3_5_CONFIGS[name]["text_config"]["num_hidden_layers"]
    assert rep["recurrent_layers"] == geo["layers"]
    assert (rep["heads"], rep["d_k"], rep["d_v"], rep["bundle"], rep["units_per_layer"]) == (
        geo["hv"], geo["dk"], geo["dv"], geo["hv"] // geo["hk"], geo["hv"])
    assert (rep["conv"]["channels"], rep["conv"]["window"]) == (geo["conv_channels"], geo["conv_window"])
    assert sorted(rep["tensors_read"]) == decay_tensor_names(d)
    assert len(rep["tensors_read"]) == 2 * len(geo["layers"])
    assert all(n.startswith("model.language_model.layers.") for n in rep["tensors_read"])
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.startswith("model.layers.") for n in weight_map)  # only the prefixed names exist
    assert "mtp.norm.weight" in weight_map  # a decoy outside the text model


@pytest.mark.parametrize("name", QWEN3_5)
def test_qwen3_5_dense_bytes_equal_the_formula(qwen3_5_ckpts, name):
    """Dense checkpoint = GDN layers x Hv x d_k x d_v x 4 (fp32 state) + layers x (2 Hk d_k + Hv d_v) x (K - 1) x 2
    (BF16 conv window); under TP 8 every rank holds an eighth; INT8 units are d_k d_v bytes + d_k fp32 scales."""
    d, geo = qwen3_5_ckpts[name], _gdn_geometry(name)
    L, hv, dk, dv = len(geo["layers"]), geo["hv"], geo["dk"], geo["dv"]
    conv = L * geo["conv_channels"] * geo["conv_window"] * 2
    dense = L * hv * dk * dv * 4 + conv
    whole = _run_json([str(d), "--w-max", "16", "--tp", "1", "--json"])
    assert whole["conv"]["bytes"] == conv
    assert whole["unit_bytes"] == {"fp32": dk * dv * 4, "int8": dk * dv + 4 * dk}
    assert all(pl["bottleneck_bytes"] == dense for pl in whole["dense"]["placements"].values())
    assert whole["dense"]["placements"]["off"]["int8_bottleneck_bytes"] == L * hv * (dk * dv + 4 * dk) + conv
    row = whole["rows"][0]
    assert row["placements"]["off"]["bottleneck_bytes"] == row["retained_units"] * dk * dv * 4 + conv
    tp8 = _run_json([str(d), "--w-max", "16", "--tp", str(TP), "--json"])
    assert all(pl["bottleneck_bytes"] == math.ceil(dense / TP) for pl in tp8["dense"]["placements"].values())


@pytest.mark.parametrize("name", QWEN3_5)
def test_qwen3_5_figures_match_an_independent_recount(qwen3_5_ckpts, name):
    d = qwen3_5_ckpts[name]
    geo, horizons = _reference_horizons(d)
    assert geo["layers"] == _gdn_geometry(name)["layers"]
    budget = 128 * _reference_figures(geo, horizons, 0, TP, 1)["fp32"]["off"]  # 128 dense slots per rank
    rep = _run_json([str(d), "--w-max", "16", "64", "--tp", str(TP), "--budget-bytes", str(budget), "--json"])
    assert all(pl["slots"] == 127 for pl in rep["dense"]["placements"].values())
    for row, w in zip(rep["rows"], [16, 64]):
        ref = _reference_figures(geo, horizons, w, TP, budget)
        assert row["retained_per_layer"] == ref["r"]
        assert row["placements"]["off"]["local_units"] == ref["per_rank"]
        for mode, pl in row["placements"].items():
            assert pl["bottleneck_bytes"] == ref["fp32"][mode], mode
            assert pl["int8_bottleneck_bytes"] == ref["int8"][mode], mode
            assert pl["slots"] == ref["slots"][mode], mode


def test_qwen3_5_fake_decay_profile_is_the_gdn_profile(qwen3_5_ckpts):
    median, lo, hi = PAPER_PROFILE["qwen"]
    for name, d in qwen3_5_ckpts.items():
        _, horizons = _reference_horizons(d)
        alpha = np.exp(np.log(1e-3) / np.concatenate([h.ravel() for h in horizons]))
        assert np.quantile(alpha, [0.25, 0.5, 0.75]) == pytest.approx([lo, median, hi], abs=0.005), name


def test_qwen3_5_key_heads_not_divisible_by_tp_error_clearly(qwen3_5_ckpts, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_tool.main([str(qwen3_5_ckpts["qwen3.5-397b-a17b"]), "--tp", "3", "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for text in ("16 GDN key heads", "bundling 4 of the 64 value heads", "--tp 3", "16 % 3 = 1"):
        assert text in err
