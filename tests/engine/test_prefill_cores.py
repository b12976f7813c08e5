"""Compiled twins of the chunked recurrent pass (app/engine/prefill.py, `compile_prefill`) against the eager pass:
the op on random inputs (padded tails, several sequences, states inside a piece), and an engine on the zoo model."""

from __future__ import annotations

import torch

from app.engine.compiled import CompiledPackages
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.prefill import chunk_counts, geometries
from app.engine.request import SamplingParams
from app.ops.chunk import chunk_kda, chunk_states_at, compiled_cores, core_key
from tests.helpers import load_zoo


def test_geometries_and_chunk_counts_of_the_zoo():
    kda, _ = load_zoo("kda-tiny")
    gdn, _ = load_zoo("gdn-tiny")
    assert geometries(kda) == {core_key(True, 16, 4, 32, 32, 32**-0.5)}
    assert geometries(gdn) == {core_key(False, 64, 4, 32, 32, 32**-0.5)}
    assert chunk_counts(512, 16) == [1, 2, 4, 8, 16, 32]
    assert chunk_counts(300, 64) == [1, 2, 4, 8] and chunk_counts(16, 16) == [1] and chunk_counts(17, 16) == [1, 2]


class _Tiny:
    """A model-shaped stand-in with one KDA layer of 2 heads of width 8 and chunks of 8 tokens (fast to compile)."""

    chunk_size = 8
    linear_layers = [0]

    def __init__(self) -> None:
        from types import SimpleNamespace

        from app.models.geometry import UnitGeometry

        mixer = SimpleNamespace(state_shapes=lambda: ((24, 3), (2, 8, 8)),
                                geometry=SimpleNamespace(units=UnitGeometry(0, "kda", 2, 8, 8)))
        self.model = SimpleNamespace(layers=[SimpleNamespace(mixer=mixer)])


def _inputs(B: int, T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, 2, 8, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, 2, 8, generator=gen)
    g = -torch.rand(B, T, 2, 8, generator=gen)
    return q, k, v, g, torch.rand(B, T, 2, generator=gen), torch.randn(B, 2, 8, 8, generator=gen)


def test_compiled_cores_give_the_eager_pass(tmp_path):
    """Cores for 1 and 2 chunks: passes of 1..16 tokens run on them (their tails padded), any batch; the states
    inside a piece come out of the same pass; a pass of 3 chunks, or one that needs gradients, runs eagerly."""
    cfg = EngineConfig(chunk_size=16, compile_prefill=True, compile_background=False, compile_cache_dir=str(tmp_path))
    packages = CompiledPackages(_Tiny(), cfg, None)  # built by the compile child; the start waits for them
    cores, report = packages.cores, packages.prefill_report
    assert list(cores.values())[0].keys() == {1, 2} and report.compiled == 2
    calls = []
    for n, core in list(cores.values())[0].items():
        def counted(*xs, core=core, n=n):
            calls.append(n)
            return core(*xs)
        cores[next(iter(cores))][n] = counted
    for B, T in [(1, 5), (3, 8), (2, 13), (1, 16), (2, 20)]:
        q, k, v, g, beta, S0 = _inputs(B, T, seed=T)
        want = chunk_states_at([T // 2], q, k, v, g, beta, initial_state=S0, chunk_size=8)
        with torch.no_grad(), compiled_cores(cores):
            got = chunk_states_at([T // 2], q, k, v, g, beta, initial_state=S0, chunk_size=8)
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() < 1e-5
    assert calls == [1, 1, 2, 2]  # 20 tokens are 3 chunks: no core holds them
    with compiled_cores(cores):  # gradients on: the eager pass
        chunk_kda(*_inputs(1, 5, seed=1)[:5], chunk_size=8)
    assert calls == [1, 1, 2, 2]
    again = CompiledPackages(_Tiny(), cfg, None).prefill_report
    assert (again.loaded, again.compiled) == (2, 0)


def test_an_engine_with_compiled_prefill_answers_as_the_eager_one(compiled_kda):
    """Prompts of 3..70 tokens through pieces of at most 16 tokens (one chunk: one core, loaded from the session's
    package cache, tests/conftest.py), with hits and prompt-end checkpoints cut inside pieces: the greedy tokens and
    cached lengths of the eager engine."""
    root, model, tok = compiled_kda[:3]
    ids = tok.encode(open(__file__).read())
    header = ids[:30]
    prompts = [header + ids[40 + 7 * i : 40 + 7 * i + n] for i, n in enumerate([3, 11, 25, 40])] + [ids[200:207]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(chunk_size=16, compile_prefill=True, compile_cache_dir=str(root))
    compiled = Engine(model, tok, cfg)
    assert compiled.snapshot()["compiled_prefill"]["packages_loaded"] == 1
    plain = Engine(model, tok, EngineConfig(chunk_size=16))
    for _ in range(2):  # the second round resumes from the first one's checkpoints
        got, want = compiled.generate(prompts, params), plain.generate(prompts, params)
        assert [o[0].output_ids for o in got] == [o[0].output_ids for o in want]
        assert [o[0].cached_tokens for o in got] == [o[0].cached_tokens for o in want]
    compiled.check_integrity()
