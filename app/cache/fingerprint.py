"""Fingerprints that key the disk tier's entries (app/cache/disk_format.py): a checkpoint written by one model or
codec must never be loaded by another.

- `model_fingerprint`: SHA-256 over the model's config and, per parameter and buffer in name order, its name,
  dtype, shape and the bytes of its first and last `sample` elements. Hashing every byte of a 48B-parameter model
  would delay each start by minutes; a retrained or differently converted checkpoint changes its tensors'
  bytes at both ends of nearly every tensor, and a changed shape or dtype always shows.
- `codec_fingerprint`: SHA-256 over what makes stored bytes mean something: W_max, the load policy, quantization,
  layout, selector, the recompute tail, TP size and placement.
"""

from __future__ import annotations

import hashlib
import json

import torch


def model_fingerprint(model: torch.nn.Module, config: dict, sample: int = 4096) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in sorted(tensors):
        t = tensors[name].detach().reshape(-1)
        h.update(f"\x00{name}\x00{t.dtype}\x00{tuple(tensors[name].shape)}".encode())
        for part in (t[:sample], t[-sample:]) if t.numel() else ():
            h.update(part.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def codec_fingerprint(w_max: float | None, policy: str, quant: str, layout: str, selector: str, tail: int,
                      tp_size: int = 1, placement: str = "off") -> str:
    settings = {"w_max": w_max, "policy": policy, "quant": quant, "layout": layout, "selector": selector,
                "tail": tail, "tp_size": tp_size, "placement": placement}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
