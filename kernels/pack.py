"""Checkpoint pack/unpack entry points: the Triton kernels on CUDA tensors, the torch reference otherwise.

Import cost stays low: Triton is imported only when a CUDA tensor arrives.
"""

from __future__ import annotations

import torch

from kernels import pack_ref


def pack_rows(src: torch.Tensor, rows: torch.Tensor, quant: bool):
    if src.is_cuda:
        from kernels import pack_triton

        return pack_triton.pack_rows(src, rows, quant)
    return pack_ref.pack_rows(src, rows, quant)


def unpack_rows(values: torch.Tensor, scales, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    if values.is_cuda:
        from kernels import pack_triton

        return pack_triton.unpack_rows(values, scales, rows, n_rows)
    return pack_ref.unpack_rows(values, scales, rows, n_rows)
