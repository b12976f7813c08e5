"""Figures of the plan tool: the decay profile (paper Figure 2) and the per-layer retained map (Figure 5)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.dasc.horizons import EPS

if TYPE_CHECKING:
    from app.dasc.plan import RecurrentCheckpoint


def write_plots(ckpt: RecurrentCheckpoint, w_maxes, out_dir: str | Path) -> list[Path]:
    """decay_profile.png (paper Figure 2: per-token static decay of every unit, horizons on a log axis, W_max
    marked) and retained_map.png (Figure 5: retained fraction per layer x head at the smallest W_max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h = torch.cat([x.flatten() for x in ckpt.horizons]).numpy()
    alpha = np.exp(math.log(EPS) / h)  # g = ln(eps) / H_s
    ws = sorted(w for w in w_maxes if w > 0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist(alpha, bins=60, range=(0, 1), color="tab:blue")
    ax1.set(xlabel="per-token static decay alpha = exp(g)", ylabel="units",
            title=f"{ckpt.kind.upper()}: median {np.median(alpha):.3f}, "
                  f"IQR [{np.quantile(alpha, 0.25):.3f}, {np.quantile(alpha, 0.75):.3f}]")
    ax2.hist(h, bins=np.logspace(np.log10(max(h.min(), 1e-2)), np.log10(h.max()), 60), color="tab:green")
    ax2.set(xscale="log", xlabel="static horizon H_s (tokens)", ylabel="units", title="horizons; kept iff H_s > W_max")
    for w in ws:
        ax1.axvline(EPS ** (1 / w), color="red", lw=0.8)
        ax1.text(EPS ** (1 / w), ax1.get_ylim()[1] * 0.95, f"{w:g}", color="red", fontsize=7, ha="right")
        ax2.axvline(w, color="red", lw=0.8)
        ax2.text(w, ax2.get_ylim()[1] * 0.95, f"{w:g}", color="red", fontsize=7, ha="right")
    fig.tight_layout()
    fig.savefig(out / "decay_profile.png", dpi=110)
    plt.close(fig)

    w0 = ws[0] if ws else 0
    plan = ckpt.plan(w0)
    grid = np.full((ckpt.num_layers, plan.layers[0].heads), np.nan)
    for lp in plan.layers:
        grid[lp.layer] = np.array(lp.retained_per_head()) / lp.units_per_head
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgray")
    fig, ax = plt.subplots(figsize=(8, max(4, ckpt.num_layers * 0.2)))
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    what = "channels" if ckpt.kind == "kda" else "heads (0/1)"
    ax.set(xlabel="head", ylabel="decoder layer (gray: full attention)",
           title=f"retained {what} at W_max = {w0:g} ({100 * plan.retained_fraction:.1f}% of units)")
    fig.colorbar(im, ax=ax, label="retained fraction")
    fig.tight_layout()
    fig.savefig(out / "retained_map.png", dpi=110)
    plt.close(fig)
    return [out / "decay_profile.png", out / "retained_map.png"]
