"""Doc sections between markers (loadtest/sections.py): a run replaces its own block and touches nothing else."""

from __future__ import annotations

import json

import pytest

from loadtest.common import Run
from loadtest.sections import block_key, publish, replace_block, run_block, section_key, write_block

RUN = Run("bench_engine", "cpu", "abc1234", "2026-12-02T10:00:00+00:00",
          {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "torch_threads": 2, "python": "3.11.7"},
          "python -m loadtest.bench_engine --model kda-tiny --sections ttft")
SEC = "bench:engine:cpu"

DOC = """# Benchmarks

Intro.

<!-- bench:engine:cpu -->
## Engine (bench_engine, CPU)

What it measures.

<!-- bench:engine:cpu:kda-tiny/ttft -->
old kda ttft
<!-- /bench:engine:cpu:kda-tiny/ttft -->

<!-- bench:engine:cpu:gdn-tiny/ttft -->
old gdn ttft
<!-- /bench:engine:cpu:gdn-tiny/ttft -->

Reading.
<!-- /bench:engine:cpu -->

<!-- bench:engine:cuda -->
## Engine (bench_engine, GPU)

<!-- bench:engine:cuda:m/ttft -->
gpu block
<!-- /bench:engine:cuda:m/ttft -->
<!-- /bench:engine:cuda -->

Closing words.
"""


def _block(key: str, text: str) -> str:
    return f"<!-- {key} -->\n{text}\n<!-- /{key} -->\n"


def test_keys():
    assert section_key("bench_engine", "cpu") == SEC
    assert block_key("bench_engine", "cuda", "kda-tiny-compiled/decode") == "bench:engine:cuda:kda-tiny-compiled/decode"


def test_replacing_a_block_changes_only_that_block():
    key = f"{SEC}:kda-tiny/ttft"
    out = replace_block(DOC, SEC, key, _block(key, "new kda ttft\n\n| a |"), "unused")
    assert out == DOC.replace("old kda ttft", "new kda ttft\n\n| a |")


def test_a_new_variant_goes_after_the_sections_last_block():
    key = f"{SEC}:kda-tiny/decode"
    out = replace_block(DOC, SEC, key, _block(key, "decode"), "unused")
    before, after = out.split("<!-- /bench:engine:cpu:gdn-tiny/ttft -->\n", 1)
    assert after.startswith(f"\n<!-- {key} -->\ndecode\n<!-- /{key} -->\n\nReading.\n<!-- /bench:engine:cpu -->")
    assert out.replace(f"\n<!-- {key} -->\ndecode\n<!-- /{key} -->\n", "", 1) == DOC


def test_a_section_without_blocks_gets_its_first_before_its_end():
    doc = "<!-- bench:tp:cpu -->\n## TP\n\nProse.\n<!-- /bench:tp:cpu -->\n"
    key = "bench:tp:cpu:kda-tiny"
    out = replace_block(doc, "bench:tp:cpu", key, _block(key, "table"), "unused")
    assert out == (f"<!-- bench:tp:cpu -->\n## TP\n\nProse.\n<!-- {key} -->\ntable\n<!-- /{key} -->\n\n"
                   "<!-- /bench:tp:cpu -->\n")


def test_a_missing_section_is_appended_with_its_title():
    key = "bench:router:cpu:kda-tiny"
    out = replace_block(DOC, "bench:router:cpu", key, _block(key, "rows"), "Router (bench_router, CPU)")
    assert out.startswith(DOC)
    assert out[len(DOC):] == (f"\n<!-- bench:router:cpu -->\n## Router (bench_router, CPU)\n\n<!-- {key} -->\nrows\n"
                              f"<!-- /{key} -->\n<!-- /bench:router:cpu -->\n")
    assert replace_block("", "bench:router:cpu", key, _block(key, "rows"), "R").startswith("<!-- bench:router:cpu -->")


@pytest.mark.parametrize("broken", [
    DOC.replace("<!-- /bench:engine:cpu:kda-tiny/ttft -->\n", ""),
    DOC.replace("old gdn ttft", "<!-- bench:engine:cpu:kda-tiny/ttft -->"),
    DOC.replace("<!-- bench:engine:cpu:kda-tiny/ttft -->\nold kda ttft\n<!-- /bench:engine:cpu:kda-tiny/ttft -->",
                "<!-- /bench:engine:cpu:kda-tiny/ttft -->\nold kda ttft\n<!-- bench:engine:cpu:kda-tiny/ttft -->"),
])
def test_unbalanced_markers_are_refused(broken):
    key = f"{SEC}:kda-tiny/ttft"
    with pytest.raises(ValueError):
        replace_block(broken, SEC, key, _block(key, "new"), "unused")


def test_run_block_carries_commit_date_machine_and_command():
    block = run_block(RUN, "kda-tiny/ttft", "| table |", "kda-tiny: TTFT")
    lines = block.splitlines()
    key = "bench:engine:cpu:kda-tiny/ttft"
    assert (lines[0], lines[-1]) == (f"<!-- {key} -->", f"<!-- /{key} -->")
    assert "### kda-tiny: TTFT" in lines
    assert "Commit abc1234, 2026-12-02; AMD EPYC, 2 cores, torch 2.13.0+cpu (2 threads), Python 3.11.7." in lines
    assert f"Command: `{RUN.command}`" in lines and "| table |" in lines


def test_writing_the_same_run_twice_leaves_one_block(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    for body in ("first", "second"):
        write_block(doc, RUN, "kda-tiny/ttft", run_block(RUN, "kda-tiny/ttft", body), "Engine")
    text = doc.read_text()
    assert text.count("<!-- bench:engine:cpu:kda-tiny/ttft -->") == 1 and "second" in text and "first" not in text
    assert "old gdn ttft" in text and "gpu block" in text and text.endswith("Closing words.\n")


def test_publish_saves_the_results_and_writes_the_block(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    publish(RUN, "kda-tiny/ttft", {"rows": [1]}, "| t |", str(doc), "Engine: TTFT", "kda-tiny: TTFT", tmp_path)
    saved = json.loads((tmp_path / "bench_engine_cpu.json").read_text())
    assert saved["runs"]["kda-tiny/ttft"]["results"] == {"rows": [1]}
    assert doc.read_text().startswith("<!-- bench:engine:cpu -->\n## Engine: TTFT (bench_engine, CPU)\n")
    assert "| t |" in capsys.readouterr().out
    publish(RUN, "kda-tiny/ttft", {"rows": [2]}, "| t |", None, "Engine: TTFT", None, tmp_path)
    assert json.loads((tmp_path / "bench_engine_cpu.json").read_text())["runs"]["kda-tiny/ttft"]["results"] == {
        "rows": [2]}
