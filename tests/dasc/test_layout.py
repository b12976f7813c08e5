"""Byte accounting: every figure equals the storage really allocated; slots follow Eq. 8."""

from __future__ import annotations

from fractions import Fraction

import pytest

from app.cache.checkpoint import CheckpointPool, DenseCodec, physical_slots
from app.dasc.codec import DascCodec, retained_rows
from app.dasc.layout import slot_bytes, slots_for_budget
from tests.dasc.common import CONV, GDN, KDA, codec_tensor_bytes, random_states, sample_plans


@pytest.mark.parametrize("geometry", [KDA, GDN], ids=["kda", "gdn"])
def test_allocated_bytes_equal_accounting(geometry):
    template = random_states(geometry)
    conv_bytes = len(geometry) * CONV[0] * CONV[1] * 4
    dense_temporal = sum(g.heads * g.d_k * g.d_v for g in geometry) * 4
    for plan in sample_plans(geometry):
        n, r = sum(lp.n for lp in plan.layers), [lp.r for lp in plan.layers]
        rows = [len(retained_rows(lp)) for lp in plan.layers]
        for layout in ("ragged", "padded"):
            for quant in ("none", "int8"):
                codec = DascCodec(template, plan, layout, quant)
                codec.allocate(3)
                want = slot_bytes(plan, layout, quant, conv_bytes)
                assert codec.allocated_bytes_per_slot == codec.bytes_per_slot == want.total
                assert codec_tensor_bytes(codec) == 3 * want.total and want.conv == conv_bytes
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
    template = random_states(KDA)
    for plan in sample_plans(KDA, seeds=[0])[:4]:
        for quant in ("none", "int8"):
            per_slot = DascCodec(template, plan, "ragged", quant).bytes_per_slot
            for budget in (0, per_slot - 1, per_slot, 2 * per_slot, 7 * per_slot + per_slot // 2):
                codec = DascCodec(template, plan, "ragged", quant)
                physical = physical_slots(codec.bytes_per_slot, budget_bytes=budget)
                codec.allocate(physical)  # what a worker allocates for the pool
                pool = CheckpointPool(codec.bytes_per_slot, physical)
                assert pool.num_slots == slots_for_budget(budget, per_slot)
                assert codec_tensor_bytes(codec) <= budget and pool.allocated_bytes <= budget
                assert codec.allocated_bytes_per_slot == per_slot  # measured, even with no slot allocated
