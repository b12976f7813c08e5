"""Engine against cold runs and per-request generation, on both zoo models.

- Exactness: 20 prompts sharing prefixes, served through prompt-end, interval and branch-point checkpoint
  hits, give the cold greedy tokens, and every logit vector agrees within 1e-4.
- 64 concurrent requests of mixed lengths finish; batched greedy equals per-request greedy.
- A pool of k checkpoint slots never holds more than k; tiny KV and checkpoint pools still finish every
  request (eviction, waiting, preemption) with unchanged outputs.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.tokenizer import Tokenizer
from app.training.generate import generate
from tests.helpers import load_zoo, record_logits

LOGIT_TOL = 1e-4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["kda-tiny", "gdn-tiny"])
def zoo(request):
    return load_zoo(request.param)


def _prompts(tok: Tokenizer, n: int = 20, seed: int = 0) -> list[list[int]]:
    """Families of prompts: a long shared header, sub-branches, and exact repeats."""
    rng = random.Random(seed)
    header = tok.encode("import os\nimport sys\n\n\nclass Loader:\n    \"\"\"Reads records.\"\"\"\n\n" * 4)
    branches = [tok.encode(f"    def load_{name}(self, path):\n        with open(path) as f:\n")
                for name in ("json", "csv", "toml")]
    out = []
    for i in range(n):
        tail = tok.encode(f"            return f.read({rng.randint(0, 99)})\n")
        p = header + branches[i % 3] + (tail if i % 4 else [])
        out.append(p if i % 5 else header[: 40 + i])
    return out


def test_cache_hits_equal_cold_runs(zoo):
    model, tok = zoo
    prompts = _prompts(tok)
    cold = Engine(model, tok, EngineConfig(enable_cache=False))
    hot = Engine(model, tok, EngineConfig(interval=32, chunk_size=48, checkpoint_slots=64))
    cold_logits, hot_logits = record_logits(cold), record_logits(hot)
    cached = []
    for i, p in enumerate(prompts):  # one at a time: each later prompt can hit what earlier ones stored
        want = cold.generate([p], GREEDY)[0][0]
        got = hot.generate([p], GREEDY)[0][0]
        assert got.output_ids == want.output_ids, f"prompt {i} diverges (cached {got.cached_tokens})"
        cached.append(got.cached_tokens)
        hot.check_integrity()
    assert len(cold_logits) == len(hot_logits)
    for (rid, idx, pos), want in cold_logits.items():
        assert (hot_logits[(rid, idx, pos)] - want).abs().max().item() < LOGIT_TOL
    kinds = hot.cache.counters.by_kind
    assert kinds.get("prompt_end") and kinds.get("interval") and kinds.get("branch"), kinds
    assert hot.cache.counters.loads >= 10 and sum(cached) > 0
    assert any(c % 32 == 0 and c > 0 for c in cached), "no hit replayed from an interval checkpoint"
    snap = hot.snapshot()
    assert 0 < snap["hit_rate"] < 1 and snap["replayed_tokens"] > 0


def test_repeated_prompt_hits_at_prompt_end_and_next_turn_hits(zoo):
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8, checkpoint_min_gap=4))  # 8-token answers count
    prompt = tok.encode("def parse(text):\n    tokens = text.split()\n    return")
    first = eng.generate([prompt], GREEDY)[0][0]
    again = eng.generate([prompt], GREEDY)[0][0]
    assert first.cached_tokens == 0 and again.cached_tokens == len(prompt) - 1
    assert again.output_ids == first.output_ids
    turn2 = prompt + first.output_ids + tok.encode("\n\n")
    nxt = eng.generate([turn2], GREEDY)[0][0]
    assert nxt.cached_tokens == len(prompt) + len(first.output_ids) - 1  # the generation-end checkpoint
    assert nxt.output_ids == generate(model, turn2, 8)
    short = Engine(model, tok, EngineConfig(checkpoint_slots=8))  # default gap 16: no generation-end store
    short.generate([prompt], GREEDY)
    assert short.snapshot()["checkpoint_stores_by_kind"] == {"prompt_end": 1}  # its generation end: 8 tokens on
    assert short.generate([turn2], GREEDY)[0][0].cached_tokens == len(prompt) - 1
    # turn 2's prompt end lies 10 tokens above the checkpoint it loaded: not stored; its generation end, 18 above,
    # is the one checkpoint it adds
    assert short.snapshot()["checkpoint_stores_by_kind"] == {"prompt_end": 1, "generation_end": 1}


def test_an_output_a_later_prompt_resumes_keeps_its_generation_end_however_short(zoo):
    """A chat answer comes back in the next turn's prompt (`output_resumed`, set by the chat route): its
    generation-end checkpoint is stored even fewer than checkpoint_min_gap tokens above the prompt end's, so the
    next turn resumes from the whole previous prompt and output (an agent's 12-token answers missed before)."""
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8))  # default gap 16
    prompt = tok.encode("def parse(text):\n    tokens = text.split()\n    return")
    first = eng.generate([prompt], dataclasses.replace(GREEDY, output_resumed=True))[0][0]
    assert len(first.output_ids) < 16
    assert eng.snapshot()["checkpoint_stores_by_kind"] == {"prompt_end": 1, "generation_end": 1}
    turn2 = prompt + first.output_ids + tok.encode("\n\n")
    assert eng.generate([turn2], GREEDY)[0][0].cached_tokens == len(prompt) + len(first.output_ids) - 1


def test_a_running_turn_lets_the_older_checkpoints_of_its_own_path_go(zoo):
    """An agent's history holds a checkpoint per turn on one path. While its next turn runs, that path is held
    (its KV must stay), but only the checkpoint the turn resumed from must: with the pool full of the older
    ones, the turn's own stores evict them instead of being skipped (they were, and the next turn missed)."""
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=2))
    params = dataclasses.replace(GREEDY, output_resumed=True)
    prompt, previous = tok.encode("def parse(text):\n    tokens = text.split()\n    return"), 0
    for turn in range(3):
        out = eng.generate([prompt], params)[0][0]
        if turn:
            assert out.cached_tokens == previous - 1  # the whole previous prompt and output
        previous = len(prompt) + len(out.output_ids)
        prompt = prompt + out.output_ids + tok.encode(f"\n# turn {turn}\n")
    snap = eng.snapshot()
    assert snap["checkpoint_skipped_stores"] == 0 and snap["checkpoint_stores_by_kind"]["generation_end"] == 3


def test_queries_on_a_shared_header_fill_no_slot_with_their_prompt_ends(zoo):
    """Few-shot traffic: one long header, many short queries. The second request cuts a branch checkpoint where
    it leaves the first one's KV; its prompt end, and those of the requests that load the branch, lie fewer than
    `checkpoint_min_gap` tokens above it and are not stored (each would serve only an exact repeat, and with
    every query storing one they evicted the header's checkpoint from a small pool)."""
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8))
    header = tok.encode("\n".join(f"field_{i} = {i * 37 % 101}" for i in range(12)))
    queries = [tok.encode(f"\n{w} = ?") for w in ("alpha", "beta", "gamma", "delta", "omega")]
    assert all(len(q) < 16 for q in queries)
    outs = [eng.generate([header + q], GREEDY)[0][0] for q in queries]
    stores = eng.snapshot()["checkpoint_stores_by_kind"]
    assert stores == {"prompt_end": 1, "branch": 1}, stores
    assert outs[0].cached_tokens == outs[1].cached_tokens == 0
    assert all(o.cached_tokens >= len(header) - 1 for o in outs[2:])
    assert [o.output_ids for o in outs[2:]] == [generate(model, header + q, 8) for q in queries[2:]]


def test_a_prompt_whose_kv_outlived_its_checkpoint_gets_one_a_repeat_can_load(zoo):
    """Under a recompute tail the branch checkpoint of a prompt the tree holds whole as KV (its checkpoint was
    evicted, or dropped by a codec change) sits where its prompt-end one would: `tail` tokens before the last
    token. Regression: it sat one token deeper, where no repeat may load it, and the prompt-end one was skipped as
    a near copy of it, so after a W_max change a working set of repeated prompts never hit again."""
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(checkpoint_slots=8, w_max=16.0))
    prompt = tok.encode(open(__file__).read())[:400]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    eng.generate([prompt], one)  # tail 64: prompt end at 335, generation end at 400 (the whole prompt as KV)
    eng.retune(w_max=64.0)  # drops the checkpoints, keeps the KV; tail 256
    assert eng.generate([prompt], one)[0][0].cached_tokens == 0
    again = eng.generate([prompt], one)[0][0]
    assert again.cached_tokens == len(prompt) - 1 - eng.cfg.tail


def test_interval_checkpoint_right_after_the_prompt_end_is_skipped(zoo):
    """A 128-token prompt with interval 128: the prompt-end checkpoint (127) makes the interval one (128)
    a near duplicate, skipped under the default gap and stored with gap 0; a later interval still stores."""
    model, tok = zoo
    prompt = tok.encode(open(__file__).read())[:128]
    params = SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True)
    stores = {}
    for gap in (16, 0):
        eng = Engine(model, tok, EngineConfig(checkpoint_slots=8, interval=128, checkpoint_min_gap=gap,
                                              store_generation_end=False))
        eng.generate([prompt], params)
        stores[gap] = eng.snapshot()["checkpoint_stores_by_kind"]
    assert stores[16] == {"prompt_end": 1, "interval": 1}  # 256 only
    assert stores[0] == {"prompt_end": 1, "interval": 2}  # 128 and 256


def test_64_concurrent_requests_match_per_request_greedy(zoo):
    model, tok = zoo
    rng = random.Random(1)
    text = tok.encode(open(__file__).read())
    prompts = [text[(s := rng.randrange(0, len(text) - 300)) : s + rng.randint(5, 300)] for _ in range(64)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    eng = Engine(model, tok, EngineConfig(max_running=24, chunk_size=64, max_tokens_per_step=512, interval=64,
                                          checkpoint_slots=16))
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_ids
        eng.check_integrity()
    assert len(done) == 64
    for rid, p, sp in zip(ids, prompts, params):
        assert done[rid] == generate(model, p, sp.max_tokens), rid


def test_small_pools_never_fail_and_keep_outputs(zoo):
    model, tok = zoo
    rng = random.Random(3)
    text = tok.encode(open(__file__).read())
    distinct = [text[(s := rng.randrange(0, len(text) - 300)) : s + rng.randint(150, 250)] for _ in range(8)]
    prompts = distinct + distinct[:4]  # repeats hit, distinct prompts compete for 2 slots and 600 KV tokens
    eng = Engine(model, tok, EngineConfig(max_running=6, kv_slots=600, chunk_size=32, checkpoint_slots=2, interval=16))
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_ids
        assert eng.cache.checkpoints.num_used <= 2
        eng.check_integrity()
    for rid, p in zip(ids, prompts):
        assert done[rid] == generate(model, p, 8)
    snap = eng.snapshot()
    assert snap["checkpoint_evictions"] > 0 and snap["kv_evicted_tokens"] > 0 and snap["preemptions"] > 0, snap


def _stream(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[str, list]:
    """Run one request step by step; the concatenated text deltas and the outputs."""
    rid = eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return "".join(o.new_text for o in outs), outs


def test_text_stop_strings_and_stop_ids(zoo):
    """Streamed deltas add up to the final text and tokens; the final text is the decoded output; a stop string
    cuts the text before its first occurrence; a stop id ends generation with its own text left out."""
    model, tok = zoo
    prompt = tok.encode("def parse(text):\n    tokens = text.split()\n")
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    streamed, outs = _stream(Engine(model, tok), prompt, free)
    final = outs[-1]
    assert streamed == final.text == tok.decode(final.output_ids)
    assert final.finish_reason == "length" and len(final.output_ids) == 40
    assert [t for o in outs for t in o.new_token_ids] == final.output_ids
    assert all(o.output_ids == [] for o in outs[:-1])  # the full list only at the end: no O(n) copy per token
    text = final.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    streamed, outs = _stream(Engine(model, tok), prompt, SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=("@@never@@", stop)))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == streamed == text[:cut]
    stop_id = final.output_ids[5]
    first = final.output_ids.index(stop_id)
    _, outs = _stream(Engine(model, tok), prompt, SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert outs[-1].finish_reason == "stop" and outs[-1].output_ids == final.output_ids[: first + 1]
    assert outs[-1].text == tok.decode(final.output_ids[:first])


@pytest.mark.parametrize("cfg", [{}, {"w_max": 16, "interval": 64}, {"w_max": 128, "quant": "int8", "policy": "wr"},
                                 {"enable_cache": False}, {"max_running": 1}],
                         ids=["dense", "dasc-nr", "dasc-int8-wr", "no-cache", "one-slot"])
def test_n_samples_fork_the_leaders_exact_state(zoo, cfg):
    """n > 1: the samples start from the leader's exact state at the fork point (not from its checkpoint, which
    dasc stores lossily), so greedy samples equal each other and the n = 1 output of the same engine setup;
    afterwards every state slot is free. With one state slot there is no room to hold the fork state and
    the samples start from the fork checkpoint (exact with the dense codec)."""
    model, tok = zoo
    prompts = _prompts(tok, 6)
    want = [o[0].output_ids for o in Engine(model, tok, EngineConfig(**cfg)).generate(prompts, GREEDY)]
    eng = Engine(model, tok, EngineConfig(**cfg))
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3))
    assert [[s.output_ids for s in o] for o in outs] == [[w] * 3 for w in want]
    eng.check_integrity()
    assert eng.scheduler.states.num_free == eng.cfg.max_running


def test_seeded_samples_differ_and_repeat(zoo):
    model, tok = zoo
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True)
    prompt = _prompts(tok, 1)[0]
    runs = [[s.output_ids for s in Engine(model, tok, EngineConfig(w_max=16)).generate([prompt], params)[0]]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(s) for s in runs[0]}) == 3


def test_greedy_picks_beside_the_logits_equal_host_picks(zoo):
    """Greedy rows get their argmax from the worker (no logits to the host) while sampled rows in the same
    steps get logits: the same tokens as an engine that brings every row to the host (`keep_logits`)."""
    model, tok = zoo
    prompts = _prompts(tok, 6)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    outs = []
    for keep in (False, True):
        eng = Engine(model, tok, EngineConfig())
        eng.keep_logits = keep
        rids = [eng.add_request(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o.output_ids for o in eng.step() if o.finished})
        outs.append([done[r] for r in rids])
    assert outs[0] == outs[1]


def test_abort_releases_a_held_fork_state(zoo):
    model, tok = zoo
    eng = Engine(model, tok, EngineConfig(w_max=16))
    rid = eng.add_request(_prompts(tok, 1)[0], SamplingParams(max_tokens=8, temperature=0.0, n=4, ignore_eos=True))
    leader = eng._seqs[rid][0]
    while leader.fork is None:
        eng.step()
    assert leader.fork.state_slot is not None
    eng.abort(rid)
    assert not eng.has_unfinished() and eng.scheduler.states.num_free == eng.cfg.max_running
    assert leader.fork.state_slot is None
    eng.check_integrity()
    assert all(n.lock == (n is eng.cache.tree.root) for n in eng.cache.tree.nodes())  # the root's own lock


def test_wire_chunks_carry_deltas_and_the_last_the_whole_output(zoo):
    model, tok = zoo
    prompt = _prompts(tok, 1)[0]
    _, outs = _stream(Engine(model, tok), prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    chunks = [o.wire() for o in outs]
    assert all(c["text"] == "" and c["output_ids"] == [] and len(c["new_token_ids"]) == 1 for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == outs[-1].output_ids and chunks[-1]["text"] == outs[-1].text
    assert [t for c in chunks for t in c["new_token_ids"]] == outs[-1].output_ids
    assert "".join(c["new_text"] for c in chunks) == outs[-1].text
