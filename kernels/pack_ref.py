"""Torch reference of the checkpoint pack/unpack kernels (the CPU path, and the twin of `pack_triton`).

A recurrent state is viewed as rows of length D = d_v: KDA unit (h, k) is one row, a GDN head is d_k rows.
pack:   values[i] = src[rows[i]]                    (fp32), or INT8 with one fp32 scale per row
unpack: dst = zeros(n_rows, D); dst[rows[i]] = values[i] (dequantised when scales are given)
"""

from __future__ import annotations

import torch

from kernels.quant import dequantize_rows, quantize_rows


def pack_rows(src: torch.Tensor, rows: torch.Tensor, quant: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """src: [R, D] fp32; rows: [M] int64 -> (values [M, D] fp32 or int8, scales [M] fp32 or None)."""
    picked = src.index_select(0, rows)
    if not quant:
        return picked.float(), None
    return quantize_rows(picked)


def unpack_rows(values: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """-> dst [n_rows, D] fp32 with the omitted rows zero-filled."""
    dst = torch.zeros(n_rows, values.shape[-1], dtype=torch.float32, device=values.device)
    dst.index_copy_(0, rows, values.float() if scales is None else dequantize_rows(values, scales))
    return dst
