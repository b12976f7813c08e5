"""Speculative decoding (prompt lookup) with exact state rollback: greedy output equals plain decoding's with the
prefix cache, dasc nr and wr, n > 1 and checkpoint hits; replay rebuilds the snapshot's bits; sampled output keeps
the target's distribution; every processing step plain decoding applies still applies.

Prompts are cut from this repository's code, which repeats itself enough for the zoo models' outputs to copy it,
so drafts are proposed and accepted (each test checks that speculation really happened)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.cache.radix import RadixTree
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams, Sequence
from app.engine.sampling import naive_token_probs
from app.engine.speculative import PROBE_AFTER, NgramDrafter, SpecState, accept, rollback_bytes_per_token
from app.models.batch import BatchLayout, ContiguousKV
from tests.helpers import load_zoo

SOURCE = Path(__file__).resolve().parents[2] / "app" / "engine" / "scheduler.py"
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
ZOO = ("kda-tiny", "gdn-tiny")


@pytest.fixture(scope="module", params=ZOO)
def zoo(request):
    return load_zoo(request.param)


@pytest.fixture(scope="module")
def kda():
    return load_zoo("kda-tiny")


def _prompts(tok, n: int, length: int, stride: int = 211) -> list[list[int]]:
    ids = tok.encode(SOURCE.read_text())
    return [ids[i * stride : i * stride + length] for i in range(n)]


def _run(model, tok, prompts, params, **knobs) -> tuple[list, Engine]:
    engine = Engine(model, tok, EngineConfig(kv_slots=8192, max_running=8, **knobs))
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    return [[o.output_ids for o in per] for per in outs], engine


SETTINGS = {
    "no-cache": {"enable_cache": False},
    "dense": {"interval": 32},
    "nr-W16": {"w_max": 16, "interval": 32},
    "wr-W16": {"w_max": 16, "policy": "wr", "interval": 32},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_speculation_equals_plain_decoding(zoo, setting):
    """Both zoo models, each cache setting: a first pass, then a second over prompts sharing the first ones'
    prefixes (they hit checkpoints), with n 2; the outputs equal plain decoding's in the same setting."""
    model, tok = zoo
    first = _prompts(tok, 4, 160)
    second = [p[:120] + q[:40] for p, q in zip(first, _prompts(tok, 4, 40, stride=97))]
    knobs = SETTINGS[setting]
    plain, spec = [], []
    for out, kn in ((plain, {}), (spec, {"spec": "ngram"})):
        engine = Engine(model, tok, EngineConfig(kv_slots=8192, max_running=8, **knobs, **kn))
        out.append(engine.generate(first, GREEDY))
        out.append(engine.generate(second, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, n=2)))
        engine.check_integrity()
        snap = engine.snapshot()
    ids = [[[[o.output_ids for o in per] for per in batch] for batch in run] for run in (plain, spec)]
    assert ids[0] == ids[1]
    assert snap["spec_accepted_tokens"] > 20, snap["spec_accepted_per_verify"]
    if setting != "no-cache":
        assert snap["cached_tokens"] > 0


def test_rollback_replay_is_bitwise_the_snapshot_and_near_plain_decoding(kda):
    """Two engines, replay and snapshot rollback, stepped in lockstep over the same requests: after every step
    every running sequence's state is bit-identical. And a verify forward's replayed states at every prefix
    are within 1e-5 of plain decoding's states after the same tokens."""
    model, tok = kda
    prompts = _prompts(tok, 3, 150)
    # costs 0: every match drafts at full depth, so most steps verify
    engines = [Engine(model, tok, EngineConfig(kv_slots=8192, spec="ngram", spec_rollback=rb, enable_cache=False,
                                               spec_verify_cost=0.0, spec_draft_cost=0.0))
               for rb in ("replay", "snapshot")]
    for e in engines:
        for p in prompts:
            e.add_request(p, GREEDY)
    verified = 0
    while engines[0].has_unfinished():
        outs = [e.step() for e in engines]
        assert [(o.request_id, o.new_token_ids) for o in outs[0]] == [(o.request_id, o.new_token_ids)
                                                                      for o in outs[1]]
        verified += bool(engines[0].worker.verifying)
        for a, b in zip(engines[0].scheduler.running, engines[1].scheduler.running):
            for sa, sb in zip(engines[0].worker.states.ssm + engines[0].worker.states.conv,
                              engines[1].worker.states.ssm + engines[1].worker.states.conv):
                assert torch.equal(sa[a.state_slot], sb[b.state_slot])
    assert verified > 5

    # a verify piece of 6 tokens against feeding them one at a time
    prompt, piece = prompts[0][:100], torch.tensor(prompts[1][:6])
    with torch.no_grad():
        kv = ContiguousKV()
        _, states = model(torch.tensor(prompt), BatchLayout((100,), (0,)), kv, None)
        before = {key: t.clone() for key, t in kv._store.items()}
        _, verified_states = model(piece, BatchLayout((6,), (100,), verify=(0,)), kv, states)
        kv._store = before
        records, plain = verified_states.verify[0], states
        for t in range(1, 7):
            _, plain = model(piece[t - 1 : t], BatchLayout((1,), (100 + t - 1,)), kv, plain)
            for j, rec in enumerate(records):
                conv, ssm = rec.state_at(t)
                assert (ssm - plain.ssm[j][0]).abs().max() < 1e-5
                assert (conv.float() - plain.conv[j][0].float()).abs().max() < 1e-5


def test_checkpoints_stored_while_speculating_match_plain_decoding(zoo):
    """Interval checkpoints every 16 tokens (some fall inside accepted verify pieces) and generation-end ones:
    the same positions are checkpointed as under plain decoding, with states within 1e-5."""
    model, tok = zoo
    prompts = _prompts(tok, 3, 90)
    stored = []
    for kn in ({}, {"spec": "ngram"}):
        engine = Engine(model, tok, EngineConfig(kv_slots=8192, interval=16, checkpoint_min_gap=0, **kn))
        engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        states = {}
        for node in engine.cache.tree.nodes():
            if node.checkpoint is not None:
                states[tuple(RadixTree.path(node)[1])] = engine.codec.load(node.checkpoint)
        stored.append((states, engine.snapshot()))
    (plain, _), (spec, snap) = stored
    assert snap["spec_accepted_tokens"] > 10
    assert sorted(map(len, plain)) == sorted(map(len, spec)) and set(plain) == set(spec)
    assert sum(len(k) > 90 and len(k) % 16 == 0 for k in spec) >= 6  # decode-interval checkpoints among them
    for key, a in plain.items():
        b = spec[key]
        for x, y in zip(a.ssm + a.conv, b.ssm + b.conv):
            assert (x.float() - y.float()).abs().max() < 1e-5, len(key)


def test_processing_logprobs_stops_and_grammar_apply_to_verified_rows(kda):
    """Each request keeps plain decoding's output token for token: penalties, logit_bias, min_p with min_tokens,
    stop strings and ids, a JSON grammar; and logprobs of accepted tokens equal plain decoding's within 1e-4."""
    model, tok = kda
    prompts = _prompts(tok, 2, 140)
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, logit_bias=((tok.encode(" self")[0], 3.0),),
                       ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop=("):",), stop_token_ids=(tok.encode("\n")[0],),
                       min_tokens=5),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0.0, guided_json='{"type": "object", "properties": {"a": '
                       '{"type": "array", "items": {"type": "integer"}}}, "required": ["a"]}'),
    ]
    for params in cases:
        outs = [Engine(model, tok, EngineConfig(kv_slots=8192, **kn)).generate(prompts, params)
                for kn in ({}, {"spec": "ngram"})]
        for a, b in zip(*outs):
            assert a[0].output_ids == b[0].output_ids and a[0].finish_reason == b[0].finish_reason, params
            assert a[0].text == b[0].text
    # logprobs through a verify piece: every token's entries, streamed in chunks of several tokens
    params = cases[3]
    got = []
    for kn in ({}, {"spec": "ngram"}):
        engine = Engine(model, tok, EngineConfig(kv_slots=8192, **kn))
        rid = engine.add_request(prompts[0], params)
        entries, multi = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    entries += out.new_logprobs
                    multi += len(out.new_token_ids) > 1
        got.append((entries, multi))
    (plain, _), (spec, multi) = got
    assert multi > 0 and len(plain) == len(spec) == 40
    for (c1, top1), (c2, top2) in zip(plain, spec):
        assert abs(c1 - c2) < 1e-4
        assert [i for i, _ in top1] == [i for i, _ in top2]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top1, top2)) < 1e-4


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution(kda):
    """Real verify-piece logits of kda-tiny (temperature 1.3, top_k 6, so the vocabulary slice is the 6 tokens
    top-k keeps): over 6000 seeded draws, the first emitted token follows the target's distribution at row 0, and
    the second, among draws that accepted the first draft, row 1's (chi-square, 5 degrees of freedom, below
    the 0.999 quantile 20.5). Drafts are the second most likely tokens, so both branches are exercised."""
    model, tok = kda
    prompt = _prompts(tok, 1, 80)[0]
    params = SamplingParams(max_tokens=8, temperature=1.3, top_k=6)
    with torch.no_grad():
        logits, _ = model(torch.tensor(prompt), BatchLayout((80,), (0,)), ContiguousKV(), None, all_logits=True)
    rows = logits[-3:].float()  # rows 0..2 of a verify piece: prompt[-3] is x0, prompt[-2:] the drafts' positions
    p = [naive_token_probs(r, 1.3, 1.0, 6) for r in rows]
    drafts = (int(p[0].topk(2).indices[1]), int(p[1].topk(2).indices[1]))
    first, second = torch.zeros(len(p[0])), torch.zeros(len(p[0]))
    for seed in range(6000):
        seq = Sequence("r", 0, prompt, params)
        seq.generator = torch.Generator().manual_seed(seed)
        out = accept(seq, drafts, rows, (), None)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        keep = probs > 0
        assert int(keep.sum()) == 6 and counts[~keep].sum() == 0
        assert _chi_square(counts[keep], probs[keep]) < 20.5
    assert 0.05 < first[drafts[0]] / 6000 < 0.95


def test_depth_adapts_to_each_sequences_own_acceptance():
    """Depth from the sequence's own acceptance: it grows with acceptance, falls to 0 when drafts are rejected,
    and one draft is tried again after PROBE_AFTER plain steps, a wait that doubles after each probe that accepted
    nothing and resets when one is accepted. A probe needs a match of the longest n-gram (4 here), where drafting
    at depth > 0 takes the longest that matched, down to 2."""
    drafter = NgramDrafter(EngineConfig(spec="ngram", spec_tokens=6))
    st = SpecState()
    assert drafter.depth(st) == 0 and st.idle >= PROBE_AFTER  # a new sequence probes at its first chance
    st.idle = 0
    st.alpha = 0.95
    assert drafter.depth(st) == 6
    st.alpha = 0.05
    assert drafter.depth(st) == 0
    weak = Sequence("r", 0, [1, 2, 3, 4, 9, 2, 3], SamplingParams())  # only the 2-gram (2, 3) occurred before
    weak.spec = SpecState()
    assert drafter.propose(weak, 4) == ()
    weak.spec.alpha = 0.95
    assert drafter.propose(weak, 4) == (4, 9, 2, 3)  # the 2-gram's 4 followers (the limit)
    seq = Sequence("r", 0, [9, 1, 2, 3, 4, 9, 1, 2, 3], SamplingParams())  # the 4-gram (9, 1, 2, 3) did occur
    seq.spec = st
    assert [drafter.propose(seq, 4) for _ in range(PROBE_AFTER - 1)] == [()] * (PROBE_AFTER - 1)
    assert drafter.propose(seq, 4) == (4,)
    for wait in (2 * PROBE_AFTER, 4 * PROBE_AFTER):
        drafter.record(seq, 1, 0)
        assert [drafter.propose(seq, 4) for _ in range(wait - 1)] == [()] * (wait - 1)
        assert drafter.propose(seq, 4) == (4,)
    drafter.record(seq, 1, 1)
    assert st.wait == PROBE_AFTER


def test_a_step_keeps_drafts_only_when_they_pay_for_the_whole_batch():
    """A verify step slows every row of the batch by the verify path's fixed cost, so a step of B rows keeps its
    drafts only when their expected extra tokens beat B (c0 + c K). A probe rides along when the step verifies
    anyway and makes it verify alone only after sqrt(B) times its sequence's wait, as does a row whose drafts were
    dropped that long."""
    drafter = NgramDrafter(EngineConfig(spec="ngram", spec_tokens=6))  # c0 0.3, c 0.05

    def rows(*alphas, idle=0):
        return [SimpleNamespace(spec=SpecState(alpha=a, idle=idle)) for a in alphas]

    one, two, six = (5,), (5, 6), (1,) * 6
    assert drafter.select(rows(0.5), [one]) == [one]  # alone: extra 0.5 > 0.3 + 0.05
    assert drafter.select(rows(0.5, 0.5, 0.5, 0.5), [one, (), (), ()]) == [(), (), (), ()]  # 0.5 < 4 x 0.35
    assert drafter.select(rows(0.95, 0.5, 0.5, 0.5), [six, one, (), ()]) == [six, one, (), ()]
    assert drafter.select(rows(0.5, 0.5), [one, two]) == [one, two]  # 0.4 + 0.55 > 2 x 0.3, each beats 2 c k
    # the second row's 6 drafts expect 0.66 extra tokens for 4 x 6 c = 1.2: dropped; the third's pay
    assert drafter.select(rows(0.95, 0.4, 0.5, 0.5), [six, six, one, ()]) == [six, (), one, ()]
    probes = rows(0.05, 0.05, 0.95, 0.5, idle=PROBE_AFTER)  # two probes whose own wait is over
    assert drafter.depth(probes[0].spec) == 0
    assert drafter.select(probes, [one, one, six, ()]) == [one, one, six, ()]  # riding along a paying step
    assert drafter.select(probes, [one, one, (), ()]) == [(), (), (), ()]  # alone they wait 2 x PROBE_AFTER
    due = rows(0.05, idle=2 * PROBE_AFTER) + rows(0.5, 0.5, 0.5)
    assert drafter.select(due, [one, six, (), ()]) == [one, (), (), ()]  # due: it pays the fixed cost itself...
    assert drafter.select(due, [one, one, (), ()]) == [one, one, (), ()]  # ...and drafts worth their own cost ride
    batch = rows(0.5, 0.5, 0.5, 0.5)  # dropped, so its estimate is tested again after 2 x its wait
    for _ in range(2 * PROBE_AFTER - 1):
        assert drafter.select(batch, [one, (), (), ()])[0] == ()
    assert drafter.select(batch, [one, (), (), ()]) == [one, (), (), ()]


def test_a_seeded_sampled_request_gives_plain_decodings_output_whatever_runs_beside_it(kda):
    """Each sampled row of a verify piece draws the token plain decoding samples there from the request's own
    generator, so a seeded request's output with speculation equals plain decoding's, alone or batched (at
    temperature 0.4 as well as 0.3: the drafts are accepted on their merits, not forced)."""
    model, tok = kda
    prompts = _prompts(tok, 5, 120)
    for temperature in (0.3, 0.4):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=7, ignore_eos=True)
        plain, _ = _run(model, tok, prompts, params)
        alone, _ = _run(model, tok, prompts[:1], params, spec="ngram")
        batched, engine = _run(model, tok, prompts, params, spec="ngram", spec_max_batch=8)
        assert alone[0] == batched[0] == plain[0]
        assert batched == plain
        assert engine.snapshot()["spec_accepted_tokens"] > 0


def test_no_drafts_in_a_step_that_decodes_more_than_spec_max_batch(kda):
    """Three sequences decoding together: spec_max_batch 2 verifies no draft, 3 does; the output is plain
    decoding's either way."""
    model, tok = kda
    prompts = _prompts(tok, 3, 120)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain, _ = _run(model, tok, prompts, params)
    for limit, drafts in ((2, False), (3, True)):
        out, engine = _run(model, tok, prompts, params, spec="ngram", spec_max_batch=limit)
        assert out == plain
        assert (engine.snapshot()["spec_verifies"] > 0) == drafts


def test_rollback_state_kept_per_draft_token_is_what_the_geometry_says(kda):
    """The worker's rollback records, per draft token: replay keeps each token's key, cumulative gate, delta and
    raw conv input; snapshot mode a whole state per drafted position (`rollback_bytes_per_token`)."""
    model, tok = kda
    geo = [model.model.layers[i].mixer.geometry for i in model.linear_layers]
    want = rollback_bytes_per_token([g.units for g in geo], geo[0].conv_channels, geo[0].conv_window,
                                    model.model.embed_tokens.weight.element_size())
    prompts = _prompts(tok, 2, 120)
    for mode in ("replay", "snapshot"):
        engine = Engine(model, tok, EngineConfig(kv_slots=8192, enable_cache=False, spec="ngram", spec_rollback=mode))
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        kept = drafted = 0
        while engine.has_unfinished():
            before = engine.telemetry.spec_drafted
            engine.step()
            kept += engine.worker.rollback_bytes()
            drafted += engine.telemetry.spec_drafted - before
        assert drafted > 0 and kept == drafted * want[mode]
