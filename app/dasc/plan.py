"""The plan tool: what dasc would store for a checkpoint, read from config.json and the decay tensors alone.

    python -m app.dasc.plan MODEL_DIR --w-max 16 64 128 512 --tp 8 [--budget-bytes B] [--json] [--plot OUT_DIR]

Only `A_log` and `dt_bias` of the recurrent layers are read (lazily, one shard at a time, via the shard index
when there is one); no projection, expert or embedding weight is touched. The geometry is the family config
class's `recurrent_geometry()` (app.models.geometry), built from config.json as the loader reads it:

    Kimi-Linear  model.layers.{i}.self_attn[.forget_gate].{A_log [1,1,H,1] or [H], dt_bias [H*K]}
                 KDA layers: layer_types or linear_attn_config.kda_layers (1-indexed); unit = (head, channel)
                 conv: q, k, v short convs, C = 3*H*K channels, window short_conv_kernel_size - 1
    Qwen3-Next   model.layers.{i}.linear_attn.{A_log [Hv], dt_bias [Hv]}
                 GDN layers: layer_types or full_attention_interval; unit = value head; TP bundle = Hv / Hk
                 conv: C = 2*Hk*d_k + Hv*d_v channels, window linear_conv_kernel_dim - 1

Per W_max (all bytes from `app.dasc.layout`, placements from `app.dasc.placement`):
    temporal ratio   whole-model fp32 temporal bytes, dense / dasc (TP-free, paper 4.1):
                     padded sum n_l / (L max r_l), ragged sum n_l / sum r_l
    complete ratio   bottleneck-rank bytes of a ragged checkpoint at --tp incl. BF16 conv / T, dense / dasc
    int8 ratio       the same with INT8 values + fp32 scales (still against the dense fp32 checkpoint)
    bottleneck bytes per placement off / storage / balanced; slots = floor(budget / bytes) - 1 (paper Eq. 8)
Dense is the same accounting at W_max = 0 and the same TP.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from app.dasc.horizons import static_horizons
from app.dasc.layout import slot_bytes, slots_for_budget
from app.dasc.placement import MODES, plan_placement
from app.dasc.plots import write_plots
from app.dasc.selection import SelectionPlan, decay_plan
from app.models.geometry import RecurrentGeometry, UnitGeometry
from app.models.loader import checkpoint_files, family_config, read_config, read_tensors, resolve_model_dir

CONV_ELEM_BYTES = 2  # BF16 conv windows (the paper's mixed-precision checkpoint)
DEFAULT_W_MAX = (16, 64, 128, 512, 1024)


@dataclass(frozen=True)
class RecurrentCheckpoint:
    """What the plan needs from one checkpoint. geometry[j] / horizons[j] describe recurrent layer j
    (decoder layer geometry[j].layer); horizons: [H, K] (KDA) or [H] (GDN), fp64."""

    model_dir: Path
    family: str
    num_layers: int
    geometry: tuple[UnitGeometry, ...]
    horizons: tuple[torch.Tensor, ...]
    conv_channels: int
    conv_window: int
    tensors_read: tuple[str, ...]

    @property
    def kind(self) -> str:
        return self.geometry[0].kind

    @property
    def conv_bytes_per_layer(self) -> int:
        return self.conv_channels * self.conv_window * CONV_ELEM_BYTES

    @property
    def conv_bytes(self) -> int:
        return len(self.geometry) * self.conv_bytes_per_layer

    def plan(self, w_max: float) -> SelectionPlan:
        return decay_plan(list(self.geometry), list(self.horizons), w_max)


def read_checkpoint(model_dir: str | Path) -> RecurrentCheckpoint:
    """Geometry from config.json (through the family config class), horizons from the decay tensors (the only
    tensors read)."""
    model_dir = resolve_model_dir(model_dir)
    cfg = read_config(model_dir)
    try:
        config = family_config(cfg)
    except KeyError as e:
        raise ValueError(f"{model_dir}/config.json lacks {e} for {cfg.get('model_type')}") from None
    layers = config.recurrent_geometry()
    if not layers:
        raise ValueError(f"{model_dir}/config.json names no linear-attention layers")
    available = set(checkpoint_files(model_dir))
    names = [(_find(available, geo, "A_log"), _find(available, geo, "dt_bias")) for geo in layers]
    raw = read_tensors(model_dir, [n for pair in names for n in pair])
    horizons = []
    for geo, (a_name, dt_name) in zip(layers, names):
        a, dt, units = raw[a_name], raw[dt_name], geo.units
        if a.numel() != units.heads or dt.numel() != units.num_units:
            raise ValueError(f"{a_name} {tuple(a.shape)} / {dt_name} {tuple(dt.shape)}: config.json implies "
                             f"{units.heads} and {units.num_units} values")
        horizons.append(static_horizons(a, dt))
    return RecurrentCheckpoint(model_dir, config.model_type, config.num_hidden_layers,
                               tuple(geo.units for geo in layers), tuple(horizons), layers[0].conv_channels,
                               layers[0].conv_window, tuple(n for pair in names for n in pair))


def _find(available: set[str], geo: RecurrentGeometry, leaf: str) -> str:
    tried = list(geo.decay_names(leaf))
    for name in tried:
        if name in available:
            return name
    raise ValueError(f"layer {geo.layer}: no decay tensor {leaf} in the checkpoint (looked for {tried})")


def check_tp(ckpt: RecurrentCheckpoint, tp: int) -> None:
    """Every TP rank must own whole head bundles of every recurrent layer."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    geo = ckpt.geometry[0]
    bundles = geo.heads // geo.bundle
    if bundles % tp == 0:
        return
    if ckpt.kind == "kda":
        what = f"{geo.heads} KDA heads per layer"
    else:
        what = f"{bundles} GDN key heads per layer (each bundling {geo.bundle} of the {geo.heads} value heads)"
    raise ValueError(f"the {what} cannot be split evenly over --tp {tp} ({bundles} % {tp} = {bundles % tp}); "
                     f"every TP rank must own whole heads")


def plan_report(ckpt: RecurrentCheckpoint, w_maxes, tp: int, budget_bytes: int | None = None) -> dict:
    check_tp(ckpt, tp)
    geo = ckpt.geometry[0]
    dense_plan = ckpt.plan(0)
    dense = _row(ckpt, dense_plan, tp, budget_bytes, None)
    return {
        "model_dir": str(ckpt.model_dir), "family": ckpt.family, "kind": ckpt.kind,
        "num_hidden_layers": ckpt.num_layers, "recurrent_layers": [g.layer for g in ckpt.geometry],
        "heads": geo.heads, "d_k": geo.d_k, "d_v": geo.d_v, "bundle": geo.bundle,
        "units_per_layer": dense_plan.layers[0].n,
        "unit_bytes": {"fp32": 4 * dense_plan.layers[0].unit_elems,
                       "int8": dense_plan.layers[0].unit_elems + 4 * dense_plan.layers[0].scales_per_unit},
        "conv": {"channels": ckpt.conv_channels, "window": ckpt.conv_window, "dtype": "bf16",
                 "bytes_per_layer": ckpt.conv_bytes_per_layer, "bytes": ckpt.conv_bytes},
        "tp": tp, "budget_bytes": budget_bytes, "tensors_read": list(ckpt.tensors_read),
        "dense": dense,
        "rows": [_row(ckpt, ckpt.plan(w), tp, budget_bytes, dense) for w in w_maxes],
    }


def _row(ckpt: RecurrentCheckpoint, plan: SelectionPlan, tp: int, budget: int | None, dense: dict | None) -> dict:
    temporal = {layout: slot_bytes(plan, layout).temporal for layout in ("padded", "ragged")}
    placements = {}
    for mode in MODES:
        p = plan_placement(plan, tp, mode)
        fp32 = slot_bytes(plan, "ragged", "none", ckpt.conv_bytes, tp, mode).total
        int8 = slot_bytes(plan, "ragged", "int8", ckpt.conv_bytes, tp, mode).total
        placements[mode] = {"bottleneck_units": p.width, "local_units": list(p.local_units),
                            "units_moved": p.units_moved(), "bottleneck_bytes": fp32, "int8_bottleneck_bytes": int8,
                            "slots": _slots(budget, fp32), "int8_slots": _slots(budget, int8)}
    ref = dense or {"temporal_bytes": temporal, "placements": placements}
    for mode, pl in placements.items():
        base = ref["placements"][mode]["bottleneck_bytes"]
        pl["complete_ratio"] = _ratio(base, pl["bottleneck_bytes"])
        pl["int8_complete_ratio"] = _ratio(base, pl["int8_bottleneck_bytes"])
    return {
        "w_max": plan.w_max, "retained_units": plan.retained_units, "total_units": plan.total_units,
        "retained_fraction": plan.retained_fraction, "retained_per_layer": [lp.r for lp in plan.layers],
        "temporal_bytes": temporal,
        "temporal_ratio": {k: _ratio(ref["temporal_bytes"][k], v) for k, v in temporal.items()},
        "complete_ratio": placements["balanced"]["complete_ratio"],
        "int8_complete_ratio": placements["balanced"]["int8_complete_ratio"],
        "placements": placements,
    }


def _ratio(dense: int, dasc: int) -> float | None:
    return dense / dasc if dasc else None  # None: nothing stored (infinite compression)


def _slots(budget: int | None, bottleneck: int) -> int | None:
    return None if budget is None or bottleneck == 0 else slots_for_budget(budget, bottleneck)


def format_table(rep: dict) -> str:
    kind = rep["kind"].upper()
    unit = ("channels" if rep["kind"] == "kda"
            else f"value heads ({rep['d_k']}x{rep['d_v']}), bundles of {rep['bundle']}")
    conv = rep["conv"]
    d = rep["dense"]["placements"]["off"]
    head = f"complete ratio, TP {rep['tp']} balanced"
    lines = [
        f"{rep['family']}  {rep['model_dir']}",
        f"  {len(rep['recurrent_layers'])} {kind} layers of {rep['num_hidden_layers']}; {rep['heads']} heads, "
        f"{rep['units_per_layer']} units per layer ({unit}); unit {rep['unit_bytes']['fp32']:,} B fp32, "
        f"{rep['unit_bytes']['int8']:,} B int8+scales",
        f"  conv {conv['channels']:,} ch x {conv['window']} BF16 = {conv['bytes_per_layer']:,} B per layer; "
        f"TP {rep['tp']}; read {len(rep['tensors_read'])} decay tensors, nothing else",
        f"  dense checkpoint on the bottleneck rank: {d['bottleneck_bytes']:,} B",
        "",
        f"  {'':>6} {'retained':>9} {'temporal ratio':>15}   {head:>30}",
        f"  {'W_max':>6} {'fraction':>9} {'padded':>7} {'ragged':>7}   {'fp32+conv':>14} {'int8+conv':>15}",
    ]
    rows = [rep["dense"]] + rep["rows"]
    for r in rows:
        t = r["temporal_ratio"]
        lines.append(f"  {_w(r, rep):>6} {100 * r['retained_fraction']:>8.2f}% {_x(t['padded']):>7} "
                     f"{_x(t['ragged']):>7}   {_x(r['complete_ratio']):>14} {_x(r['int8_complete_ratio']):>15}")
    budget = rep["budget_bytes"]
    lines += ["", "  bottleneck rank bytes per checkpoint (ragged fp32 + conv/T); moved: units sent in stage 2"
              + (f"; slots in {budget:,} B per rank (Eq. 8)" if budget else ""),
              f"  {'W_max':>6} " + " ".join(f"{m:>12}" for m in MODES) + f" {'moved st/bal':>14}"
              + ("  " + " ".join(f"{'slots ' + m:>14}" for m in MODES) if budget else "")]
    for r in rows:
        pl = r["placements"]
        moved = f"{pl['storage']['units_moved']}/{pl['balanced']['units_moved']}"
        line = f"  {_w(r, rep):>6} " + " ".join(f"{pl[m]['bottleneck_bytes']:>12,}" for m in MODES) + f" {moved:>14}"
        if budget:
            line += "  " + " ".join(f"{pl[m]['slots']:>14,}" for m in MODES)
        lines.append(line)
    return "\n".join(lines)


def _w(row: dict, rep: dict) -> str:
    return "dense" if row is rep["dense"] else f"{row['w_max']:g}"


def _x(v: float | None) -> str:
    return "inf" if v is None else f"{v:.2f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.dasc.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="checkpoint directory (config.json + safetensors) or zoo name")
    ap.add_argument("--w-max", type=float, nargs="+", default=list(DEFAULT_W_MAX), help="thresholds in tokens")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--budget-bytes", type=int, default=None, help="per-rank checkpoint budget for the slot count")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--plot", metavar="OUT_DIR", help="write decay_profile.png and retained_map.png there")
    args = ap.parse_args(argv)
    try:
        if any(w < 0 for w in args.w_max):
            raise ValueError(f"--w-max values must be >= 0, got {args.w_max}")
        ckpt = read_checkpoint(args.model_dir)
        rep = plan_report(ckpt, args.w_max, args.tp, args.budget_bytes)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(rep) if args.json else format_table(rep))
    if args.plot:
        for p in write_plots(ckpt, args.w_max, args.plot):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    main()
