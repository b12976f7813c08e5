"""The host tier in a real engine (kda-tiny): checkpoints the pools evict, for room or with their KV, are demoted
with their prefix's KV and promoted on a hit; the round trip is bit-exact for dense, dasc and INT8 checkpoints; a
dense hit from the tier answers as the cold run did; salts and codec layouts are never crossed; and
`check_integrity` covers the tier."""

from __future__ import annotations

import random

import pytest
import torch

from app.cache.digest import block_hashes
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BASE = dict(compile_decode=False, compile_prefill=False, host_mb=64.0)


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def _prompts(tok, n: int, length: int = 420) -> list[list[int]]:
    out = []
    for i in range(n):
        rng = random.Random(i)
        out.append(tok.encode("\n".join(f"v_{i}_{j} = {rng.randint(0, 999)}" for j in range(90)))[:length])
    return out


def _ask(engine: Engine, prompt: list[int], salt: str | None = None):
    params = GREEDY if salt is None else SamplingParams(**{**GREEDY.__dict__, "cache_salt": salt})
    return engine.generate([prompt], params)[0][0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("codec", [dict(), dict(w_max=16.0), dict(w_max=16.0, quant="int8")],
                         ids=["dense", "dasc", "int8"])
def test_a_round_trip_through_the_tier_is_bit_exact(zoo, codec):
    model, tok = zoo
    assert_round_trip(Engine(model, tok, EngineConfig(checkpoint_slots=4, **BASE, **codec)), _prompts(tok, 1)[0])


def assert_round_trip(engine: Engine, prompt: list[int]) -> None:
    """Serve `prompt`, demote its checkpoint with its KV to the host tier and promote both into new slots: the
    promoted checkpoint and KV are the demoted ones bit for bit."""
    _ask(engine, prompt)
    node = next(n for n in engine.cache.tree.nodes() if n.checkpoint is not None)
    kv = engine.cache.tree.path_kv(node)
    worker, block = engine.worker, engine.cache.host.block
    chain = block_hashes(engine.cache.tree.path(node)[1], block)  # every block new to the tier
    worker.demote(99, node.checkpoint, kv, chain, [(h, i * block) for i, h in enumerate(chain)], block)
    slot, new_kv = engine.cache.checkpoints.alloc(), engine.cache.alloc_kv(len(kv))
    worker.promote_kv(99, 0, new_kv)
    worker.promote_state(99, slot)
    for a, b in zip(worker.codec.export(node.checkpoint), worker.codec.export(slot), strict=True):
        assert torch.equal(_bits(a), _bits(b))
    for t in worker.kv.storage.values():
        assert torch.equal(_bits(t[kv]), _bits(t[new_kv]))
    worker.host_drop([99], chain)
    engine.cache.checkpoints.free(slot)
    engine.cache.free_kv(new_kv)
    engine.check_integrity()


@pytest.mark.parametrize("room", [dict(checkpoint_budget_mb=0.4), dict(kv_slots=1300)],
                         ids=["checkpoint-pool", "kv-pool"])
def test_repeats_the_pools_let_go_of_resume_from_the_tier_as_cold(zoo, room):
    """24 distinct 420-token prompts asked twice in order: the pools (0.4 MB of checkpoints, or KV for three
    prompts) keep none of them until their repeat; without the tier none resumes, with it at least 90% do, and
    every answer equals the cold one."""
    model, tok = zoo
    prompts = _prompts(tok, 24)
    resumed = {}
    for host_mb in (0.0, 64.0):
        engine = Engine(model, tok, EngineConfig(**{**BASE, "host_mb": host_mb, **room}))
        cold = [_ask(engine, p) for p in prompts]
        warm = [_ask(engine, p) for p in prompts]
        assert [w.output_ids for w in warm] == [c.output_ids for c in cold]
        resumed[host_mb] = sum(w.cached_tokens >= len(p) - 1 for w, p in zip(warm, prompts))
        engine.check_integrity()
    assert resumed[0.0] == 0 and resumed[64.0] >= 0.9 * len(prompts)
    snap = engine.snapshot()
    assert snap["host_tier_promotions"] == resumed[64.0] and snap["host_tier_demotions"] >= len(prompts)
    assert snap["host_tier_state_bytes"] > 0 and snap["host_tier_kv_bytes"] > 0
    assert engine.snapshot()["sequences_lost"] == 0  # resumed from the tier: served, not lost


def test_salted_entries_never_serve_another_salt(zoo):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=1, **BASE))
    prompt, other = _prompts(tok, 2)
    cold = _ask(engine, prompt, "tenant-a")
    _ask(engine, other, "tenant-a")  # takes the one slot: the first prompt's checkpoint is demoted
    assert engine.cache.host.entries
    assert _ask(engine, prompt, "tenant-b").cached_tokens == 0 and _ask(engine, prompt).cached_tokens == 0
    assert engine.snapshot()["host_tier_promotions"] == 0
    again = _ask(engine, prompt, "tenant-a")
    assert again.cached_tokens == len(prompt) - 1 and again.output_ids == cold.output_ids
    engine.check_integrity()


def test_a_codec_change_never_loads_an_entry_of_the_old_layout(zoo):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=1, **BASE))
    prompt, other = _prompts(tok, 2)
    _ask(engine, prompt)
    _ask(engine, other)
    assert len(engine.cache.host.entries) >= 1
    engine.retune(w_max=16.0)
    assert not engine.cache.host.entries and not engine.worker.host.entries
    assert engine.snapshot()["host_tier_layout_drops"] >= 1
    assert _ask(engine, prompt).cached_tokens == 0
    engine.check_integrity()


def test_integrity_covers_the_tier(zoo):
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=1, **BASE))
    for p in _prompts(tok, 2):
        _ask(engine, p)
    engine.check_integrity()
    engine.worker.host.drop(list(engine.worker.host.entries))  # bytes gone behind the bookkeeping's back
    with pytest.raises(AssertionError, match="host bytes held"):
        engine.check_integrity()


def test_a_promotion_locks_only_the_kv_it_shares(zoo):
    """Regression: a prompt sharing its first tokens with the one prompt whose KV the pool holds locked that whole
    prompt while making room for its own entry's KV, found none in a pool with room for one prompt, and missed."""
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(kv_slots=440, **BASE))
    first, second = _prompts(tok, 2)
    assert first[:1] == second[:1]  # they share a first token
    cold = _ask(engine, first)
    _ask(engine, second)  # its KV takes the pool: the first one's checkpoint goes to the tier
    again = _ask(engine, first)
    assert again.cached_tokens == len(first) - 1 and again.output_ids == cold.output_ids
    engine.check_integrity()


def test_blocks_a_promotion_files_again_while_it_loads_stay(zoo):
    """Regression: a promotion that made room by demoting a checkpoint on its own path (dasc-nr stores a prompt's
    end and its generation end on one path) filed the blocks it had freed again, then dropped their bytes: the
    bookkeeping held blocks the worker no longer had."""
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(checkpoint_slots=1, w_max=16.0, **BASE))
    base = _prompts(tok, 1)[0][:300]
    first, second = base + tok.encode("x = 1\n"), base + tok.encode("y = 2\n")
    for prompt in (first, second, first, second):
        _ask(engine, prompt)
        engine.check_integrity()
    assert engine.snapshot()["host_tier_promotions"] >= 1


def test_a_salt_whose_root_was_pruned_still_promotes(zoo):
    """Regression: once KV eviction emptied a salt's part of the tree its root was pruned, and promoting that salt's
    entry looked the missing root up (KeyError) instead of starting from no shared KV."""
    model, tok = zoo
    engine = Engine(model, tok, EngineConfig(kv_slots=440, **BASE))
    first, second = _prompts(tok, 2)
    cold = _ask(engine, first, "tenant-a")
    _ask(engine, second)  # takes the whole KV pool: tenant-a's root goes with its last node
    assert "tenant-a" not in engine.cache.tree.roots
    again = _ask(engine, first, "tenant-a")
    assert again.cached_tokens == len(first) - 1 and again.output_ids == cold.output_ids
    engine.check_integrity()
