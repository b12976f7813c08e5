"""Decode steps through the graph path (app/engine/graphs.py), on the CPU: the padded, device-tensor-only
step that a GPU captures runs eagerly here, and must give the plain engine's tokens and logits. Capture and
replay themselves run in tests/engine/test_cuda.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from app.cache.pools import padded_rows
from app.engine import graphs
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.tp import build_engine
from app.models import batch as batch_module
from app.models.loader import ZOO_DIR, build_model, read_config
from tests.helpers import load_zoo, record_logits


def _prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """Lengths 5-300: decode histories in several buckets (64, 128, 256, 512), a shared header for hits."""
    ids = tok.encode(open(graphs.__file__).read() * 2)
    rng = random.Random(seed)
    header = ids[:40]
    return [(header if i % 3 == 0 else []) + ids[rng.randint(100, 900):][: rng.randint(5, 260)] for i in range(n)]


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_graph_path_equals_the_plain_engine(name):
    model, tok = load_zoo(name)
    prompts = _prompts(tok, 13)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = dict(max_running=6, interval=32)  # 13 requests through 6 slots: padded batches
    plain = Engine(model, tok, EngineConfig(**cfg, padded_decode=False))  # the general step
    graphed = Engine(model, tok, EngineConfig(**cfg, decode_graphs=True))
    want_logits, got_logits = record_logits(plain), record_logits(graphed)
    for _ in range(2):  # the second round hits the first one's checkpoints
        want = plain.generate(prompts, params)
        got = graphed.generate(prompts, params)
        assert [o[0].output_ids for o in got] == [o[0].output_ids for o in want]
        assert [o[0].cached_tokens for o in got] == [o[0].cached_tokens for o in want]
    assert want_logits.keys() == got_logits.keys()
    assert max((got_logits[k] - v).abs().max().item() for k, v in want_logits.items()) < 1e-4
    stats = graphed.snapshot()["decode_graphs"]
    assert stats["steps"] > 40 and not stats["captured"]
    assert any(b == 8 for b, _ in stats["buckets"])  # 6 sequences padded to 8
    # histories padded to multiples of 64 (uncaptured steps take any length), through several of them
    assert all(s % graphs.MIN_HISTORY == 0 for _, s in stats["buckets"])
    assert len({b for b, _ in stats["buckets"]}) >= 2 and len({s for _, s in stats["buckets"]}) >= 3
    graphed.check_integrity()


def test_graph_path_forks():
    """n > 1: samples start from the leader's state copied at the fork, then decode in graph steps."""
    model, tok = load_zoo("gdn-tiny")
    prompts = _prompts(tok, 3, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3)
    want = Engine(model, tok, EngineConfig(interval=32, padded_decode=False)).generate(prompts, params)
    got = Engine(model, tok, EngineConfig(interval=32, decode_graphs=True)).generate(prompts, params)
    assert [[s.output_ids for s in o] for o in got] == [[s.output_ids for s in o] for o in want]


def _assert_compiled_equals_plain(plain: Engine, compiled: Engine, prompts, params: SamplingParams) -> None:
    """Two rounds, n = 1 then n = 2 (the second hits the first one's checkpoints, and forks): tokens and cached
    tokens equal the plain engine's, logits within float tolerance."""
    want_logits, got_logits = record_logits(plain), record_logits(compiled)
    for n in (1, 2):
        want = plain.generate(prompts, replace(params, n=n))
        got = compiled.generate(prompts, replace(params, n=n))
        assert [[s.output_ids for s in o] for o in got] == [[s.output_ids for s in o] for o in want]
        assert [o[0].cached_tokens for o in got] == [o[0].cached_tokens for o in want]
    assert max((got_logits[k] - v).abs().max().item() for k, v in want_logits.items()) < 1e-4
    stats = compiled.snapshot()["decode_graphs"]
    assert stats["compiled"] and stats["steps"] > 30 and len({s for _, s in stats["buckets"]}) >= 3
    compiled.check_integrity()


def test_compiled_decode_equals_the_plain_engine(compiled_kda):
    """compile_decode on the CPU, started on the session's package cache (tests/conftest.py, built there by a cold
    start in the background): the engine loads its bucket's package at start and decodes with it through several
    history buckets (64-512), hits and n = 2 forks, as the plain engine does. One batch bucket (max_running 1):
    batching and padding are the eager twin's (test_graph_path_equals_the_plain_engine), the same step code."""
    root, model, tok = compiled_kda[:3]
    cfg = EngineConfig(max_running=1, interval=32, compile_decode=True, compile_cache_dir=str(root))
    compiled = Engine(model, tok, cfg)
    stats = compiled.snapshot()["decode_graphs"]
    assert (stats["packages_loaded"], stats["packages_compiled"]) == (1, 0)
    plain = Engine(model, tok, replace(cfg, compile_decode=False, padded_decode=False))
    prompts, params = _prompts(tok, 5, seed=2), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    _assert_compiled_equals_plain(plain, compiled, prompts, params)


def test_compiled_gdn_decode_equals_the_plain_engine(tmp_path):
    """The same for gdn-tiny's decode step (gated DeltaNet and gated attention traced and compiled), compiled by the
    compile child on a cold cache while the start waits for it (`compile_background` off)."""
    model, tok = load_zoo("gdn-tiny")
    cfg = EngineConfig(max_running=1, interval=32, compile_decode=True, compile_background=False,
                       compile_cache_dir=str(tmp_path))
    plain = Engine(model, tok, replace(cfg, compile_decode=False, padded_decode=False))
    _assert_compiled_equals_plain(plain, Engine(model, tok, cfg), _prompts(tok, 5, seed=2),
                                  SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


def test_compile_failure_names_the_setting(monkeypatch, tmp_path):
    """A machine where Inductor cannot build its kernels (no C++ compiler: the compile child finds none) fails at
    an engine start that waits for its packages, saying which setting to turn off, and leaves nothing in the
    cache."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    model, tok = load_zoo("gdn-tiny")
    with pytest.raises(RuntimeError, match="compile_decode: compiling the decode step failed.*decode bucket 1.*or "
                                           "set compile_decode to false"):
        Engine(model, tok, EngineConfig(max_running=2, compile_decode=True, compile_background=False,
                                        compile_cache_dir=str(tmp_path)))
    assert not list(tmp_path.glob("*.pt2")) and not list(tmp_path.glob(".work-*"))


def test_decode_step_reads_nothing_from_the_host(monkeypatch):
    """What a graph captures may not copy host data to the device: such a copy would be recorded once and
    replay stale values. Every host-to-device path raises inside decode_step here."""
    inside = []

    def guarded(host, device):
        already_there = isinstance(host, torch.Tensor) and host.device == device  # passed through, no copy
        assert not inside or already_there, "decode_step copied a host tensor to the device"
        return host_to_device(host, device)

    host_to_device = batch_module.host_to_device
    for module in ("app.models.batch", "app.cache.pools", "app.engine.worker", "app.dasc.policy"):
        monkeypatch.setattr(f"{module}.host_to_device", guarded)
    step = graphs.decode_step

    def watched(*args):
        inside.append(1)
        try:
            return step(*args)
        finally:
            inside.pop()

    monkeypatch.setattr(graphs, "decode_step", watched)
    for name in ["kda-tiny", "gdn-tiny"]:
        model, tok = load_zoo(name)
        engine = Engine(model, tok, EngineConfig(decode_graphs=True))
        outs = engine.generate(_prompts(tok, 4), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert all(len(o[0].output_ids) == 6 for o in outs)
        assert engine.snapshot()["decode_graphs"]["steps"] >= 5


def test_decode_graphs_refuses_routed_experts_and_tensor_parallel():
    config = read_config(ZOO_DIR / "gdn-tiny") | {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    _, tok = load_zoo("gdn-tiny")
    with pytest.raises(ValueError, match="routed experts"):
        Engine(build_model(config), tok, EngineConfig(decode_graphs=True))
    with pytest.raises(ValueError, match="routed experts"):
        Engine(build_model(config), tok, EngineConfig(compile_decode=True))
    for flag in ("decode_graphs", "compile_decode"):
        with pytest.raises(ValueError, match="one worker"):
            build_engine("gdn-tiny", EngineConfig(**{flag: True}), tp_size=2)


@pytest.mark.parametrize("n, floor, want", [(1, 1, 1), (3, 1, 4), (8, 1, 8), (9, 1, 16), (1, 64, 64), (65, 64, 128)])
def test_buckets(n, floor, want):
    assert graphs.bucket(n, floor) == want


def test_padded_rows():
    t = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    rows = [[t(1, 2, 3), t(9)], [], [t(), t(7)], [t(4, 5, 6, 8, 0)]]
    assert padded_rows(rows, 5, -1).tolist() == [[1, 2, 3, 9, -1], [-1] * 5, [7, -1, -1, -1, -1], [4, 5, 6, 8, 0]]
    assert padded_rows([[], []], 2, 3).tolist() == [[3, 3], [3, 3]]
