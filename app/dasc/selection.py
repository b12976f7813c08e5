"""Selection plans: which recurrent-state units each linear-attention layer keeps in a checkpoint.

A unit is one GDN head (state [d_k, d_v]) or one KDA key channel of one head (row [d_v] of the k-major
state). Units are numbered head-major within a layer: KDA unit u = h * d_k + k, GDN unit u = h. A unit is
*global* (kept) when its static horizon exceeds W_max, *local* (dropped) otherwise; W_max = 0 keeps all.
n_l / r_l are the total / retained units of layer l; the ragged layout packs layer l's retained units at
offsets [o_l, o_l + r_l) with o_0 = 0, o_{l+1} = o_l + r_l.

The count-matched random selector keeps, per layer, the same r_l units drawn uniformly with a seed: same
compression, no decay awareness (the paper's Random baseline). Layer shapes (`UnitGeometry`) come from the
family configs through `app.models.geometry`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from app.models.geometry import UnitGeometry


@dataclass(frozen=True)
class LayerPlan:
    """layer: decoder layer index; kind 'kda' or 'gdn'; heads; d_k, d_v; keep: retained unit ids, ascending;
    horizons: static horizon of every unit (for the wr window rule); bundle: heads that must stay on one TP
    rank together (GDN value heads sharing a key head; 1 for KDA)."""

    layer: int
    kind: str
    heads: int
    d_k: int
    d_v: int
    keep: tuple[int, ...]
    horizons: tuple[float, ...]
    bundle: int = 1

    @property
    def units_per_head(self) -> int:
        return self.d_k if self.kind == "kda" else 1

    @property
    def n(self) -> int:
        return self.heads * self.units_per_head

    @property
    def r(self) -> int:
        return len(self.keep)

    @property
    def unit_elems(self) -> int:
        """fp32 values per unit: d_v (KDA channel) or d_k * d_v (GDN head)."""
        return self.d_v if self.kind == "kda" else self.d_k * self.d_v

    @property
    def scales_per_unit(self) -> int:
        """INT8 scales per unit: one per (head, k), so 1 for a KDA channel and d_k for a GDN head."""
        return 1 if self.kind == "kda" else self.d_k

    def keep_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[list(self.keep)] = True
        return mask

    def retained_per_head(self) -> list[int]:
        counts = [0] * self.heads
        for u in self.keep:
            counts[u // self.units_per_head] += 1
        return counts


@dataclass(frozen=True)
class SelectionPlan:
    w_max: float
    selector: str  # "decay" or "random:<seed>"
    layers: tuple[LayerPlan, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for lp in self.layers:
            out.append(out[-1] + lp.r)
        return tuple(out)

    @property
    def total_units(self) -> int:
        return sum(lp.n for lp in self.layers)

    @property
    def retained_units(self) -> int:
        return sum(lp.r for lp in self.layers)

    @property
    def retained_fraction(self) -> float:
        return self.retained_units / self.total_units

    @property
    def is_dense(self) -> bool:
        return self.retained_units == self.total_units

    def to_dict(self) -> dict:
        return {"w_max": self.w_max, "selector": self.selector,
                "layers": [{**lp.__dict__, "keep": list(lp.keep), "horizons": list(lp.horizons)} for lp in self.layers],
                "n": [lp.n for lp in self.layers], "r": [lp.r for lp in self.layers], "offsets": list(self.offsets)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "SelectionPlan":
        layers = tuple(LayerPlan(lp["layer"], lp["kind"], lp["heads"], lp["d_k"], lp["d_v"], tuple(lp["keep"]),
                                 tuple(lp["horizons"]), lp.get("bundle", 1)) for lp in d["layers"])
        return cls(d["w_max"], d["selector"], layers)


def decay_plan(geometry: list[UnitGeometry], horizons: list[torch.Tensor], w_max: float) -> SelectionPlan:
    """Keep the units whose static horizon exceeds w_max (all of them when w_max == 0).

    horizons[i]: [heads, d_k] for a KDA layer, [heads] for a GDN layer."""
    layers = []
    for geo, h in zip(geometry, horizons):
        flat = h.reshape(-1).double()
        keep = range(flat.numel()) if w_max <= 0 else torch.nonzero(flat > w_max).flatten().tolist()
        layers.append(LayerPlan(geo.layer, geo.kind, geo.heads, geo.d_k, geo.d_v, tuple(keep),
                                tuple(flat.tolist()), geo.bundle))
    return SelectionPlan(float(w_max), "decay", tuple(layers))


def random_plan(plan: SelectionPlan, seed: int) -> SelectionPlan:
    """Count-matched random selector: per layer the same r_l, units drawn uniformly (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for lp in plan.layers:
        keep = tuple(sorted(torch.randperm(lp.n, generator=gen)[: lp.r].tolist()))
        layers.append(LayerPlan(lp.layer, lp.kind, lp.heads, lp.d_k, lp.d_v, keep, lp.horizons, lp.bundle))
    return SelectionPlan(plan.w_max, f"random:{seed}", tuple(layers))


def make_plan(geometry: list[UnitGeometry], horizons: list[torch.Tensor], w_max: float,
              selector: str = "decay") -> SelectionPlan:
    """`selector` is 'decay' or 'random:<seed>'."""
    plan = decay_plan(geometry, horizons, w_max)
    if selector == "decay":
        return plan
    if selector.startswith("random:"):
        return random_plan(plan, int(selector.split(":", 1)[1]))
    raise ValueError(f"selector must be 'decay' or 'random:<seed>', got {selector!r}")

