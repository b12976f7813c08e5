"""The evaluation harness's own parts, without lm-eval (it is the `[eval]` extra, not a test dependency): the
task files are what build_tasks makes from held-out code only, the YAMLs render every document, the
comparison functions, and the direct-API client against a real local server with a compressed setting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jinja2
import pytest
import yaml

from app.models.tokenizer import Tokenizer
from app.training.corpus import split_files, stdlib_files, stdlib_root
from loadtest.common import REPO
from loadtest.eval import build_tasks, drift
from loadtest.eval.compare import compare_steps, generation_agreement, loglik_agreement, top_kl
from loadtest.eval.server import engine_status, local_server

TASKS = REPO / "loadtest" / "eval" / "tasks"


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines()]


def _yamls() -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(TASKS.glob("*.yaml"))}


def test_the_committed_task_files_are_what_build_tasks_makes():
    built = build_tasks.build()
    for name, docs in built.items():
        assert (TASKS / f"{name}.jsonl").read_text() == build_tasks.jsonl(docs), name
    assert {n: len(d) for n, d in built.items()} == {"dasc_code_mc": 60, "dasc_code_loglik": 40,
                                                      "dasc_code_copy": 80, "dasc_code_next": 40,
                                                      "dasc_code_next_fewshot": 3}


def test_every_document_comes_from_a_held_out_file():
    train, held_out = split_files(stdlib_files())
    held = {p.relative_to(stdlib_root()).as_posix() for p in held_out}
    trained = {p.relative_to(stdlib_root()).as_posix() for p in train}
    for path in TASKS.glob("*.jsonl"):
        for doc in _docs(path.stem):
            source = doc["source"].rsplit(":", 1)[0]
            assert source in held and source not in trained, (path.name, source)


def test_the_answers_are_where_the_tasks_say():
    for doc in _docs("dasc_code_mc"):
        assert doc["choices"][doc["gold"]] == doc["target"] and len(set(doc["choices"])) == 4
    for doc in _docs("dasc_code_copy"):
        assert doc["prefix"] + doc["target"] in doc["header"].split("\n")
        assert doc["target"].startswith(" ")
    headers = {d["header"] for d in _docs("dasc_code_copy")}
    assert len(headers) == build_tasks.COPY_HEADERS  # ten documents share each header


@pytest.mark.parametrize("task", ["dasc_code_mc", "dasc_code_loglik", "dasc_code_copy", "dasc_code_next"])
def test_each_yaml_names_its_files_and_renders_every_document(task):
    spec = _yamls()[task]
    assert spec["task"] == task and spec["dataset_path"] == "json"
    for split, rel in spec["dataset_kwargs"]["data_files"].items():
        assert (REPO / rel).is_file(), (split, rel)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    text, target = env.from_string(spec["doc_to_text"]), env.from_string(spec["doc_to_target"])
    for doc in _docs(task):
        assert text.render(**doc) and target.render(**doc) != ""
        if task == "dasc_code_copy":  # the direct-API client sends exactly what lm-eval sends
            assert text.render(**doc) == drift.copy_prompt(doc)


def test_loglik_agreement_finds_the_largest_difference_and_the_picks():
    ref = {0: [[-1.0, True], [-2.0, False]], 1: [[-3.0, False], [-0.5, True]]}
    other = {0: [[-1.0004, True], [-2.0, False]], 1: [[-0.4, False], [-0.5, True]]}
    got = loglik_agreement(ref, other)
    assert got["compared"] == 4 and math.isclose(got["max_abs_diff"], 2.6)
    assert got["greedy_flags_differ"] == 0 and got["same_pick"] == 0.5
    with pytest.raises(ValueError, match="different documents"):
        loglik_agreement(ref, {0: ref[0]})
    assert generation_agreement({0: ["a"], 1: ["b"]}, {0: ["a"], 1: ["c"]}) == 0.5


def test_top_kl_is_zero_for_equal_maps_and_matches_the_exact_kl_on_a_full_support():
    p = {"a": math.log(0.7), "b": math.log(0.2), "c": math.log(0.1)}
    q = {"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)}
    assert top_kl(p, p) == 0.0
    exact = sum(math.exp(v) * (v - q[t]) for t, v in p.items())
    assert math.isclose(top_kl(p, q), exact, rel_tol=1e-9)


def test_compare_steps_stops_after_the_first_different_token():
    same = {"x": math.log(0.6), "y": math.log(0.4)}
    flipped = {"x": math.log(0.4), "y": math.log(0.6)}
    dense = [("x", same), ("x", same), ("x", same)]
    other = [("x", same), ("y", flipped), ("y", flipped)]
    kls, agree = compare_steps(dense, other)
    assert len(kls) == 2 and kls[0] == 0.0 and kls[1] > 0 and agree == [True, False]


def test_the_direct_api_client_sees_compressed_resumes_on_a_local_server(tmp_path: Path):
    """Three prompts sharing a header, one after another, at W_max 16: the first stores its prompt-end checkpoint
    a recompute tail (4 W_max) before its end, inside the shared header, so the others resume from compressed
    checkpoints; the responses say so and the engine counts them. Also exercises `python -m app.api.local
    --engine`."""
    docs = _docs("dasc_code_copy")[:3]
    ids = Tokenizer.from_dir(REPO / "app" / "models" / "zoo" / "kda-tiny").encode_batch(
        [drift.copy_prompt(d) for d in docs])
    with local_server("kda-tiny", {"w_max": 16, "checkpoint_min_gap": 0}, tmp_path / "server.log") as url:
        got = drift.run(url, "kda-tiny", ids, max_tokens=4, top=5)
        snap = engine_status(url)
    assert [r["compressed"] for r in got] == [False, True, True]
    assert got[1]["cached"] > 0 and got[2]["cached"] > 0 and all(len(r["steps"]) >= 1 for r in got)
    assert all(len(top) == 5 for r in got for _, top in r["steps"])
    assert snap["sequences_admitted"] == 3 and snap["sequences_compressed_hit"] == 2
    summary = drift.summarize(got, got)
    assert summary["compressed"] == 2 and summary["kl_mean"] == 0.0 and summary["greedy_agreement"] == 1.0
