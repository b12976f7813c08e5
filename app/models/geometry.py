"""Recurrent-state geometry: what one sequence's state of each linear-attention layer holds, per family.

The family config classes derive it (`KimiLinearConfig.recurrent_geometry()`,
`Qwen3NextConfig.recurrent_geometry()`), one `RecurrentGeometry` per recurrent decoder layer, in layer order.
The mixers are built from it and report their state shapes through it; the selection plans, horizons and the
plan tool of `app.dasc` read it, the plan tool from config.json alone without building the model.

    kind  heads                d_k, d_v                       bundle   conv channels            decay tensors
    kda   linear_num_heads     linear_head_dim (both)         1        3 * H * d_k (q, k, v)    self_attn[.forget_gate].
    gdn   value heads Hv       linear_{key,value}_head_dim    Hv / Hk  2 * Hk * d_k + Hv * d_v  linear_attn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KINDS = ("kda", "gdn")


@dataclass(frozen=True)
class UnitGeometry:
    """Shape of one recurrent layer's delta-rule state: decoder layer index, kind ('kda' or 'gdn'), heads, d_k,
    d_v (state [heads, d_k, d_v]) and the TP bundle: heads that stay on one TP rank together (GDN value heads
    sharing a key head; 1 for KDA). A unit is a KDA (head, key channel) or a GDN head."""

    layer: int
    kind: str
    heads: int
    d_k: int
    d_v: int
    bundle: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer {self.layer}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.layer < 0 or min(self.heads, self.d_k, self.d_v, self.bundle) < 1:
            raise ValueError(f"layer {self.layer}: layer must be >= 0 and heads, d_k, d_v, bundle >= 1 "
                             f"(got {self.heads}, {self.d_k}, {self.d_v}, {self.bundle})")
        if self.heads % self.bundle or (self.kind == "kda" and self.bundle != 1):
            raise ValueError(f"layer {self.layer}: {self.heads} {self.kind} heads do not form bundles of "
                             f"{self.bundle} (KDA bundles are single heads)")

    @property
    def units_per_head(self) -> int:
        return self.d_k if self.kind == "kda" else 1

    @property
    def num_units(self) -> int:
        return self.heads * self.units_per_head

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.heads, self.d_k, self.d_v


@dataclass(frozen=True)
class RecurrentGeometry:
    """One recurrent decoder layer: its delta-rule state (`units`), its depthwise short convolution over
    `conv_channels` channels with `conv_kernel` taps (state: the last conv_kernel - 1 inputs), and where its
    decay tensors live in a checkpoint: `{prefix}A_log` and `{prefix}dt_bias` for the first prefix the
    checkpoint has (hub names first, then transformers' runtime names)."""

    units: UnitGeometry
    conv_channels: int
    conv_kernel: int
    decay_prefixes: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.conv_channels < 1 or self.conv_kernel < 2:
            raise ValueError(f"layer {self.layer}: conv needs channels >= 1 and kernel >= 2, got "
                             f"{self.conv_channels} and {self.conv_kernel}")
        if self.conv_channels % self.bundles:
            raise ValueError(f"layer {self.layer}: {self.conv_channels} conv channels do not split over "
                             f"{self.bundles} head bundles")
        if not self.decay_prefixes:
            raise ValueError(f"layer {self.layer}: no decay tensor prefix")

    @property
    def layer(self) -> int:
        return self.units.layer

    @property
    def bundles(self) -> int:
        """Head bundles (KDA heads, GDN key heads): the count TP splits."""
        return self.units.heads // self.units.bundle

    @property
    def conv_window(self) -> int:
        return self.conv_kernel - 1

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [C, W-1], delta-rule state [H, d_k, d_v]) of one sequence."""
        return (self.conv_channels, self.conv_window), self.units.state_shape

    def decay_names(self, leaf: str) -> tuple[str, ...]:
        """The checkpoint names `leaf` ('A_log' or 'dt_bias') of this layer may have, in the order to try."""
        return tuple(p + leaf for p in self.decay_prefixes)

    def shard(self, tp: int) -> RecurrentGeometry:
        """What one of `tp` ranks holds: bundles // tp whole head bundles and their conv channels."""
        if self.bundles % tp:
            raise ValueError(f"layer {self.layer}: {self.bundles} head bundles do not divide over tp_size {tp}")
        units = replace(self.units, heads=self.units.heads // tp)
        return replace(self, units=units, conv_channels=self.conv_channels // tp)
