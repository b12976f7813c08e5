"""The kept benchmark results and docs/benchmarks.md agree with their layout: one results file per script and
device, each run with its commit, date and machine; one doc section per script and device with a block per
variant; links into the doc land on a heading."""

from __future__ import annotations

import json
import re
from datetime import date, datetime
from pathlib import Path

from loadtest.common import DEVICES, RESULTS

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "benchmarks.md"
_MARKER = re.compile(r"^<!-- (/?)(bench:[^ ]+) -->$")


def _markers() -> list[tuple[bool, str]]:
    """(is an end marker, key) for every marker line of the doc, in order."""
    found = (_MARKER.match(line.strip()) for line in DOC.read_text().splitlines())
    return [(m.group(1) == "/", m.group(2)) for m in found if m]


def _results() -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_no_result_file_is_named_after_a_commit():
    names = [p.name for p in RESULTS.iterdir()]
    assert names
    assert not [n for n in names if re.search(r"(^|[_.-])[0-9a-f]{7,40}([_.-]|$)", n)]


def test_one_results_file_per_script_and_device_with_every_runs_metadata():
    files = _results()
    assert files
    for path, data in files:
        assert (REPO / "loadtest" / f"{data['script']}.py").exists(), path
        assert data["device"] in DEVICES and path.name == f"{data['script']}_{data['device']}.json"
        assert data["runs"], path
        for variant, run in data["runs"].items():
            where = f"{path.name}: {variant}"
            assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", run["commit"]), where
            assert isinstance(datetime.fromisoformat(run["date"]).date(), date), where
            assert {"cpu", "cores", "torch", "torch_threads", "python"} <= set(run["machine"]), where
            assert ("gpu" in run["machine"]) == (data["device"] == "cuda"), where
            assert run["command"].split()[:3] == ["python", "-m", f"loadtest.{data['script']}"], where
            assert isinstance(run["config"], dict) and run["results"], where


def test_the_doc_has_one_section_per_script_and_device_and_a_block_per_variant():
    markers = _markers()
    starts = [key for end, key in markers if not end]
    assert len(starts) == len(set(starts)), "a section or block appears twice"
    assert sorted(starts) == sorted(key for end, key in markers if end), "unbalanced markers"
    sections = [key for key in starts if key.count(":") == 2]
    for path, data in _results():
        section = f"bench:{data['script'].removeprefix('bench_')}:{data['device']}"
        assert section in sections, path
        blocks = {key.removeprefix(section + ":") for key in starts if key.startswith(section + ":")}
        assert blocks == set(data["runs"]), path
    for section in sections:
        _, script, device = section.split(":")
        if (REPO / "loadtest" / f"bench_{script}.py").exists():
            assert (RESULTS / f"bench_{script}_{device}.json").exists(), section


def test_links_into_the_doc_land_on_headings():
    anchors = {_slug(line.lstrip("#")) for line in DOC.read_text().splitlines() if line.startswith("## ")}
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    links = [(p.name, a) for p in sources for a in re.findall(r"benchmarks\.md#([\w-]+)", p.read_text())]
    links += [(DOC.name, a) for a in re.findall(r"\]\(#([\w-]+)\)", DOC.read_text())]
    assert links
    assert [link for link in links if link[1] not in anchors] == []
