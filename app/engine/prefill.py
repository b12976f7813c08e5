"""Compiled twins of the chunked gated-delta pass of prefill pieces (`EngineConfig.compile_prefill`), CPU only.

Eager, a prefill piece's recurrent layers spend most of their time dispatching the chunked pass's few hundred
small ops (`app.ops.chunk._chunk_core`: 1.1 ms of a 64-token KDA layer, against 0.3 ms compiled). The pass has no
weights, so one compiled core serves every layer of a geometry (gate per channel or per head, chunk size, heads,
key and value widths, scale) and every model that shares it. Each core is an AOTInductor package for a number
of chunks (1, 2, 4, .. up to a piece of `chunk_size` tokens), any batch of sequences; a pass of N chunks runs on
the core of the next count up, its tail padded with tokens that leave the state unchanged (zero k, v, g and
beta). Packages live in the decode steps' cache (app/engine/aot.py: key, privacy, lock, cap), are built by the
compile child (app/engine/compile_child.py) and installed by the worker's `CompiledPackages`
(app/engine/compiled.py), and are in force only inside the worker's forwards (`app.ops.chunk.compiled_cores`).
"""

from __future__ import annotations

import torch
from torch import nn

from app.engine.aot import Package
from app.models.hybrid import HybridForCausalLM
from app.ops.chunk import _chunk_core, core_key

# Inductor options of the cores: no weights to freeze, no GEMM against a weight to pick a kernel for
OPTIONS: dict = {}


class _Core(nn.Module):
    def __init__(self, scale: float, C: int) -> None:
        super().__init__()
        self.scale, self.C = scale, C

    def forward(self, q, k, v, g, beta, S0):
        return _chunk_core(q, k, v, g, beta, S0, self.scale, self.C)


class PackagedCore:
    """A core package, called like `_chunk_core` with C and scale fixed (inputs made contiguous, as exported)."""

    def __init__(self, package: Package) -> None:
        self.package = package

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        return self.package(*(t.contiguous() for t in tensors))


def geometries(model: HybridForCausalLM) -> set[tuple]:
    """The `core_key`s of the model's recurrent layers (their passes run with the default scale K ** -0.5)."""
    keys = set()
    for i in model.linear_layers:
        mixer = model.model.layers[i].mixer
        h, k, v = mixer.state_shapes()[1]
        keys.add(core_key(mixer.geometry.units.kind == "kda", model.chunk_size, h, k, v, k**-0.5))
    return keys


def chunk_counts(piece_tokens: int, C: int) -> list[int]:
    """The chunk counts to compile: powers of two up to the one that holds a piece of `piece_tokens` tokens."""
    top = max(1, -(-piece_tokens // C))
    return [1 << i for i in range((top - 1).bit_length() + 1)]


def core_name(core: tuple, n: int) -> str:
    """The name a core package's key starts with."""
    return f"chunk-{'kda' if core[0] else 'gdn'}-n{n}"


def build_core(key: tuple, n: int, out) -> None:
    """Export the core of `key` for n chunks (the batch symbolic: examples of 2 sequences) and compile it to `out`."""
    per_channel, C, H, K, V, scale = key
    B, T = 2, n * C
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(B, T, H, K, generator=gen) for _ in range(2)]
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K if per_channel else 1, generator=gen)
    beta, S0 = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    with torch.no_grad():
        program = torch.export.export(_Core(scale, C), (*x, v, g, beta, S0), dynamic_shapes=({0: batch},) * 6,
                                      strict=False)
    torch._inductor.aoti_compile_and_package(program, package_path=str(out), inductor_configs=dict(OPTIONS))
