"""The allowance calibration (app/calibrate.py) on a real zoo model: teacher forcing reads the engine's own logits,
dense hits reproduce cold runs, the rule's thresholds, and the committed allowance files obey the rule."""

from __future__ import annotations

import json

import pytest
import torch

from app import calibrate
from app.dasc.allowance import ALLOWANCE_FILE, GREEDY_TOKENS, read_allowance
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.loader import ZOO_DIR
from tests.helpers import load_zoo


@pytest.fixture(scope="module")
def gdn():
    """One torch thread, as the script runs: two oversubscribe a shared 2-core CPU many times over."""
    zoo = load_zoo("gdn-tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield zoo
    torch.set_num_threads(threads)


def test_the_rule_thresholds():
    assert calibrate.judge(3.0 * 1.0049, 3.0, 0.95) and calibrate.judge(3.0 * 0.9951, 3.0, 1.0)
    assert not calibrate.judge(3.0 * 1.006, 3.0, 1.0)  # NLL more than 0.5% off dense
    assert not calibrate.judge(3.0, 3.0, 0.94)  # greedy tokens differ on more than 5% of prompts


def test_teacher_forcing_appends_the_given_tokens_and_scores_them(gdn):
    model, tok = gdn
    engine = Engine(model, tok, calibrate.engine_config(None, 1))
    forcing = calibrate.TeacherForcing(engine)
    prompt, forced = tok.encode("def add(a, b):\n"), tok.encode("    return a - b  # not what the model says\n")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=len(forced), temperature=1.0, ignore_eos=True))
    forcing.forced[rid] = forced
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o for o in engine.step() if o.finished})
    assert out[rid].output_ids == forced and len(forcing.nll[rid]) == len(forced)
    assert all(x > 0 for x in forcing.nll[rid])


def test_dense_hits_reproduce_cold_runs(gdn, monkeypatch):
    """Hits on dense prefix checkpoints give the cold greedy tokens and the cold continuation NLL."""
    model, tok = gdn
    monkeypatch.setattr(calibrate, "PREFIX_TOKENS", (40, 56, 72))
    prompts = calibrate.held_out_prompts(tok, 3)
    assert [len(p.prefix) for p in prompts] == [40, 56, 72]
    assert all(len(p.suffix) == calibrate.SUFFIX_TOKENS and len(p.continuation) == GREEDY_TOKENS for p in prompts)
    cold_nll, cold_tokens, cached = calibrate.run_hits(Engine(model, tok, calibrate.engine_config(None, 3)),
                                                       prompts, prime=False)
    assert cached == [0, 0, 0]
    dense = calibrate.Candidate(None, "nr", 0)
    hit_nll, hit_tokens, hit_cached = calibrate.run_hits(Engine(model, tok, calibrate.engine_config(dense, 3)),
                                                         prompts, prime=True)
    assert hit_cached == [len(p.prefix) - 1 for p in prompts] and hit_tokens == cold_tokens
    assert hit_nll == pytest.approx(cold_nll, rel=1e-4)


def test_calibrate_writes_a_record_with_every_candidate(gdn, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "PREFIX_TOKENS", (40, 56, 72))
    out = tmp_path / "allowance.json"
    calibrate.main(["gdn-tiny", "--prompts", "3", "--w-max", "16", "--out", str(out)])
    record = json.loads(out.read_text())
    assert list(record["settings"]) == ["dense", "nr-W16", "wr-W16"] and record["prompts"]["count"] == 3
    dense = record["settings"]["dense"]
    assert dense["nll_ratio"] == 1.0 and dense["agreement"] == 1.0 and "dense" in record["allowed"]
    assert {"model", "date", "commit", "rule", "interval", "cold_nll", "allowed"} <= set(record)


@pytest.mark.parametrize("model", ["kda-tiny", "gdn-tiny"])
def test_the_committed_allowance_follows_the_rule(model):
    record = read_allowance(ZOO_DIR / model)
    assert record is not None, f"run `python -m app.calibrate {model}` and commit {model}/{ALLOWANCE_FILE}"
    dense = record["settings"]["dense"]["nll"]
    verdicts = {label: calibrate.judge(f["nll"], dense, f["agreement"]) for label, f in record["settings"].items()}
    assert record["allowed"] == [label for label, ok in verdicts.items() if ok]
    assert record["prompts"]["count"] >= 20 and len(record["settings"]) == 11
