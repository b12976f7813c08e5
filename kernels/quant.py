"""INT8 storage of retained state rows (paper Appendix E.1).

The temporal state is a stack of rows of length d_v: row (h, k) of the k-major state is the paper's
column S[h, :, k]. One scale per row, i.e. per (layer, head, k), shared over d_v:
    a = max_v |S[v]|,  s = max(a, 1e-8) / 127,  q = clip(round(S / s), -127, 127)  (int8),  S_hat = q * s
computed in fp32; scales are stored fp32. The round trip error is at most s / 2 per element.
"""

from __future__ import annotations

import torch

QMAX = 127.0
EPS = 1e-8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, D] -> (q [M, D] int8, scales [M] fp32)."""
    x = x.float()
    scales = x.abs().amax(dim=-1).clamp_min(EPS) / QMAX
    q = torch.round(x / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [M, D] int8, scales [M]) -> [M, D] fp32."""
    return q.float() * scales[:, None]
