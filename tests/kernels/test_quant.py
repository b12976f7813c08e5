"""INT8 rows (kernels/quant.py): the round trip stays within half a quantization step."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.quant import dequantize_rows, quantize_rows

HALF_STEP = 0.5 + 3e-5  # half a quantization step, plus fp32 rounding of x / s and q * s (<= 2 * 127 ulp)


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
