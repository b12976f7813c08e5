"""Compiled packages built in the background (app/engine/compiled.py, compile_jobs.py, compile_child.py): a cold
start serves at once on the eager steps while a child process at idle priority builds each package, and the idle
step loop swaps each in as it lands; a warm start loads them all at once; loading leaves nothing in the temporary
directory; a machine that cannot compile serves on eagerly and says why.

The cold start observed is the session's `compiled_kda` (tests/conftest.py: kda-tiny, batch bucket 1 and pieces
of one 16-token chunk, two packages)."""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import replace

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.engine import Engine
from tests.conftest import GREEDY, answer, compiled_config

pytestmark = pytest.mark.slow
BUILD_S = 600


def test_a_cold_start_serves_at_once_and_swaps_each_package_in_as_it_lands(compiled_kda):
    root, _, _, _, want, seen = compiled_kda
    start = seen["at_start"]
    assert start["state"] == "building" and start["packages"] == 2 and start["in_force"] == 0
    assert start["left"] == ["decode bucket 1", "prefill kda core of 1 chunk(s)"]
    assert seen["policy"] == os.SCHED_IDLE  # the child runs on idle CPU only
    assert seen["eager"] == want and seen["while_held"]["in_force"] == 0  # served eagerly before any package: the same
    assert seen["decode"]["steps"] > 0
    done = seen["done"]
    assert done["state"] == "ready" and done["in_force"] == 2 and done["left"] == [] and done["error"] is None
    assert done["landed"] == 2  # installed by the idle loop: no request was in flight
    assert (seen["decode"]["packages_compiled"], seen["prefill"]["packages_compiled"]) == (1, 1)
    assert seen["compiled"] == want
    assert seen["work_left"] == [] and seen["child_rc"] == 0 and seen["reports_read"]
    assert sorted(p.name.split("-")[0] for p in root.glob("*.pt2")) == ["chunk", "decode"]


def test_a_warm_start_loads_every_package_at_once_and_leaves_no_temporary_files(compiled_kda, tmp_path, monkeypatch):
    """Loading extracts each package into a scratch directory of the cache and removes it (torch alone would leave an
    `aotinductor_*` directory in TMPDIR per package, removed only if the package is freed)."""
    root, model, tok, prompt, want, _ = compiled_kda
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    system_tmp = set(glob.glob(os.path.join(tempfile.gettempdir(), "aotinductor_*")))
    engine = Engine(model, tok, compiled_config(root))
    stats = engine.snapshot()["compile"]
    assert stats == {"state": "ready", "packages": 2, "in_force": 2, "left": []} and engine.compiled.compiles is None
    assert engine.snapshot()["decode_graphs"]["packages_loaded"] == 1
    assert engine.generate([prompt], GREEDY)[0][0].output_ids == want
    assert engine.snapshot()["decode_graphs"]["steps"] > 0
    engine.close()
    assert list(tmp.iterdir()) == []
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "aotinductor_*"))) == system_tmp
    assert not [p for p in root.glob(".load-*")]


def test_a_machine_that_cannot_compile_serves_eagerly_and_says_why(compiled_kda, tmp_path, monkeypatch):
    """No C++ compiler (the child finds none): the start serves at once; the build stops at its first package, and
    /status's `compile` block names what failed."""
    _, model, tok, prompt, want, _ = compiled_kda
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    engine = AsyncEngine(lambda: Engine(model, tok, replace(compiled_config(tmp_path / "c"), max_running=2)))
    try:
        assert answer(engine, prompt) == want
        assert engine.engine.compiled.compiles.wait(BUILD_S)
        stats = engine.snapshot()["compile"]
        assert stats["state"] == "failed" and stats["in_force"] == 0 and "decode bucket 1" in stats["error"]
        assert "C++ compiler" in stats["error"] and answer(engine, prompt) == want
    finally:
        engine.shutdown()
    assert not list((tmp_path / "c").glob("*.pt2")) and not list((tmp_path / "c").glob(".work-*"))
