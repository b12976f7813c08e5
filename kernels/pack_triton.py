"""Triton checkpoint pack/unpack with the INT8 rule fused in: the fast twin of `kernels/pack_ref.py`.

Same signatures and contract as the reference (rows of length D = d_v, see `kernels/quant.py`):
    pack:   values[i] = src[rows[i]]  (fp32), or  s_i = max(max_d |src[rows[i], d]|, 1e-8) / 127,
            values[i] = clip(round(src[rows[i]] / s_i), -127, 127) as int8, scales[i] = s_i
    unpack: dst = zeros(n_rows, D); dst[rows[i]] = values[i] (times scales[i] when scales are given)

One program handles BLOCK_ROWS rows x BLOCK_D = next_pow2(D) columns; columns >= D are masked.

  src [R, D]            values [M, D]
  +---------+           +---------+
  |         |  rows[0]  | row 0   |  <- program 0: rows[0 : BLOCK_ROWS]
  | rows[i] |---------> | ...     |
  |         |           | row M-1 |  <- program cdiv(M, BLOCK_ROWS) - 1
  +---------+           +---------+

Exactness versus the reference:
  * the scale and x / s use IEEE round-to-nearest division (`tl.math.div_rn`), as torch does; a plain `/`
    lowers to an approximate division on NVIDIA GPUs and could move a value across a rounding boundary.
  * round() is round half to even via the fp32 magic-constant trick (x + 1.5 * 2^23) - 1.5 * 2^23, exact for
    |x| < 2^22 (here |x / s| <= ~127) and identical to torch.round there; it runs in the interpreter, unlike
    libdevice.rint, which is an extern call the interpreter does not support. It relies on the compiler not
    reassociating fp32 adds (Triton emits no fast-math reassociation; the sm_90 PTX keeps div.rn.f32 and the
    two add.f32 with +-0f4B400000). -0.5 rounds to +0.0 rather than -0.0, invisible after the int8 cast.
  * no multiply feeds an add, so FMA contraction (TRITON_DEFAULT_FP_FUSION) cannot change a result.
  So INT8 values and scales are expected bit-exact; the tests still allow one quantisation step.
  Rows holding NaN are undefined here (the GPU max may drop a NaN where torch.amax propagates it).

Preconditions (unchecked, to stay sync-free on CUDA): rows in [0, R) (pack) or [0, n_rows) (unpack), and
unique for unpack. Wrappers run compiled on CUDA tensors, and on CPU tensors in a process that set
TRITON_INTERPRET=1 before importing triton.language and keeps it set (see tests/kernels/test_pack.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals read inside @triton.jit code must be constexpr.
QMAX = tl.constexpr(127.0)  # kernels.quant.QMAX
EPS = tl.constexpr(1e-8)  # kernels.quant.EPS
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it keeps no fraction bits for fp32 |x| < 2^22

# Elements per program: small tiles on a GPU; large ones in the interpreter, whose cost is per program.
_GPU_TILE = 4096
_INTERP_TILE = 1 << 16


@triton.jit
def _pack_rows_kernel(
    src_ptr, rows_ptr, out_ptr, scales_ptr, M, D, stride_src,
    QUANT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_d < D)[None, :]
    r = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    x = tl.load(src_ptr + r[:, None] * stride_src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    out_offs = offs_m.to(tl.int64)[:, None] * D + offs_d[None, :]
    if QUANT:
        absmax = tl.max(tl.abs(x), axis=1)
        s = tl.math.div_rn(tl.maximum(absmax, EPS), QMAX)
        y = tl.math.div_rn(x, s[:, None])
        y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(out_ptr + out_offs, y.to(tl.int8), mask=mask)
        tl.store(scales_ptr + offs_m, s, mask=mask_m)
    else:
        tl.store(out_ptr + out_offs, x, mask=mask)


@triton.jit
def _unpack_rows_kernel(
    values_ptr, scales_ptr, rows_ptr, dst_ptr, M, D,
    HAS_SCALES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_d < D)[None, :]
    v = tl.load(values_ptr + offs_m.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    if HAS_SCALES:
        s = tl.load(scales_ptr + offs_m, mask=mask_m, other=0.0)
        v = v * s[:, None]
    r = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    tl.store(dst_ptr + r[:, None] * D + offs_d[None, :], v, mask=mask)


def _tiling(M: int, D: int, device: torch.device) -> tuple[int, int]:
    """-> (BLOCK_ROWS, BLOCK_D): BLOCK_D covers a whole row; BLOCK_ROWS fills the tile budget, at most M."""
    block_d = triton.next_power_of_2(D)
    tile = _GPU_TILE if device.type == "cuda" else _INTERP_TILE
    block_rows = max(1, min(tile // block_d, triton.next_power_of_2(M)))
    return block_rows, block_d


def pack_rows(src: torch.Tensor, rows: torch.Tensor, quant: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """src: [R, D] (read as fp32); rows: [M] int64 -> (values [M, D] fp32 or int8, scales [M] fp32 or None)."""
    src = src if src.stride(-1) == 1 else src.contiguous()
    rows = rows.contiguous()
    M, D = rows.numel(), src.shape[1]
    values = torch.empty(M, D, dtype=torch.int8 if quant else torch.float32, device=src.device)
    scales = torch.empty(M, dtype=torch.float32, device=src.device) if quant else None
    if M == 0:
        return values, scales
    block_rows, block_d = _tiling(M, D, src.device)
    _pack_rows_kernel[(triton.cdiv(M, block_rows),)](
        src, rows, values, values if scales is None else scales, M, D, src.stride(0),
        QUANT=quant, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
    )
    return values, scales


def unpack_rows(values: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """values [M, D] fp32 or int8, scales [M] or None, rows [M] int64 -> dst [n_rows, D] fp32, omitted rows 0."""
    M, D = values.shape
    dst = torch.zeros(n_rows, D, dtype=torch.float32, device=values.device)
    if M == 0:
        return dst
    values, rows = values.contiguous(), rows.contiguous()
    scales = None if scales is None else scales.contiguous().float()
    block_rows, block_d = _tiling(M, D, values.device)
    _unpack_rows_kernel[(triton.cdiv(M, block_rows),)](
        values, values if scales is None else scales, rows, dst, M, D,
        HAS_SCALES=scales is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
    )
    return dst
