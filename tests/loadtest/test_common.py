"""Benchmark run records and result files (loadtest/common.py): metadata, one file per script and device,
variants replaced one at a time, the commit mark."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime

import pytest

from loadtest.common import Run, check_variant, git_commit, results_path, save, start_run


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_save_writes_the_runs_metadata_and_results(tmp_path):
    run = start_run("bench_sampling", {"rows": 16}, ["--rows", "16", "--repeats", "5"])
    path = save(run, "rows-16", {"rows": [{"vocab": 4096, "ours_ms": 0.5}]}, tmp_path)
    assert path == tmp_path / "bench_sampling_cpu.json" == results_path("bench_sampling", "cpu", tmp_path)
    data = json.loads(path.read_text())
    assert (data["script"], data["device"], list(data["runs"])) == ("bench_sampling", "cpu", ["rows-16"])
    rec = data["runs"]["rows-16"]
    assert rec["commit"] == git_commit() and rec["commit"]
    assert datetime.fromisoformat(rec["date"]).tzinfo is not None
    assert {"cpu", "cores", "torch", "torch_threads", "python"} <= set(rec["machine"])
    assert rec["command"] == "python -m loadtest.bench_sampling --rows 16 --repeats 5"
    assert rec["config"] == {"rows": 16}
    assert rec["results"] == {"rows": [{"vocab": 4096, "ours_ms": 0.5}]}


def test_a_new_run_replaces_its_variant_only(tmp_path):
    first = Run("bench_async", "cpu", "aaaaaaa", "2026-12-01T00:00:00+00:00", {"cpu": "x"}, "cmd 1", {"threads": 1})
    save(first, "gdn-tiny/threads-1", {"seconds": [1.0]}, tmp_path)
    save(first, "gdn-tiny/threads-2", {"seconds": [2.0]}, tmp_path)
    second = Run("bench_async", "cpu", "bbbbbbb", "2026-12-02T00:00:00+00:00", {"cpu": "y"}, "cmd 2", {"threads": 2})
    save(second, "gdn-tiny/threads-2", {"seconds": [3.0]}, tmp_path)
    runs = json.loads((tmp_path / "bench_async_cpu.json").read_text())["runs"]
    assert runs["gdn-tiny/threads-1"] == first.record({"seconds": [1.0]})
    assert runs["gdn-tiny/threads-2"] == second.record({"seconds": [3.0]})
    assert [p.name for p in tmp_path.iterdir()] == ["bench_async_cpu.json"]


def test_devices_keep_separate_files(tmp_path):
    for device in ("cpu", "cuda"):
        save(Run("bench_codec", device, "c", "2026-12-01", {"cpu": "x"}, "cmd"), "default", {"rows": []}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_codec_cpu.json", "bench_codec_cuda.json"]


@pytest.mark.parametrize("variant", ["", "a b", "a--b", "x<y", "café"])
def test_variant_names_are_marker_safe(variant):
    with pytest.raises(ValueError):
        check_variant(variant)


def test_run_rejects_unknown_devices_and_script_names():
    with pytest.raises(ValueError):
        Run("bench_engine", "tpu", "c", "d", {}, "cmd")
    with pytest.raises(ValueError):
        Run("bench engine", "cpu", "c", "d", {}, "cmd")


def test_commit_is_marked_dirty_by_changed_code_only(tmp_path):
    assert git_commit(tmp_path) == "unknown"
    for rel in ("app/x.py", "docs/benchmarks.md", "loadtest/results/bench_x_cpu.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "docs/benchmarks.md").write_text("2\n")
    (tmp_path / "loadtest/results/bench_x_cpu.json").write_text("2\n")
    (tmp_path / "untracked.py").write_text("new\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "app/x.py").write_text("2\n")
    assert git_commit(tmp_path) == head + "-dirty"
