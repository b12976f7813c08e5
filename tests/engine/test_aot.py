"""The CPU's compiled-package cache (app/engine/aot.py) without compiling: keys, privacy, the lock, the size cap.
Compiling and loading real packages: tests/engine/test_graphs.py."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from app.engine import aot
from app.engine.aot import ArtifactCache, artifact_key
from tests.helpers import load_zoo

OPTIONS = {"freezing": True}


def test_the_key_names_weights_batch_threads_options_and_machine(monkeypatch):
    model, _ = load_zoo("kda-tiny")
    key = artifact_key(model, 4, OPTIONS)
    assert key == artifact_key(model, 4, OPTIONS) and key.startswith("decode-b4-")
    assert artifact_key(model, 8, OPTIONS) != key
    assert artifact_key(model, 4, {"freezing": False}) != key
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3  # one weight of one layer
    try:
        assert artifact_key(model, 4, OPTIONS) != key
    finally:
        with torch.no_grad():
            model.model.norm.weight[0] -= 1e-3
    assert artifact_key(model, 4, OPTIONS) == key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # the kernels' thread count is built in
    try:
        assert artifact_key(model, 4, OPTIONS) != key
    finally:
        torch.set_num_threads(threads)
    # a package built on an Intel CPU must not load on an AMD one (or on a CPU with other vector units)
    monkeypatch.setattr(aot, "machine_digest", lambda: "x86_64|{'vendor_id': 'AuthenticAMD'}|avx2")
    assert artifact_key(model, 4, OPTIONS) != key


def test_the_cache_directory_is_made_private_and_a_shared_one_is_refused(tmp_path):
    cache = ArtifactCache(tmp_path / "new" / "cache", 10)
    assert cache.root.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match="compile_cache_dir.*mode 0700"):
        ArtifactCache(open_dir, 10)


def test_a_package_file_others_may_write_is_refused(tmp_path):
    cache = ArtifactCache(tmp_path, 10)
    path, built = cache.get_or_build("k", lambda out: out.write_bytes(b"package"))
    assert built and path.read_bytes() == b"package" and path.stat().st_mode & 0o777 == 0o600
    assert cache.get_or_build("k", _never) == (path, False)
    os.chmod(path, 0o666)
    with pytest.raises(PermissionError, match="writable by no one else"):
        cache.get_or_build("k", _never)


def test_a_failed_build_leaves_nothing(tmp_path):
    cache = ArtifactCache(tmp_path, 10)

    def fails(out):
        out.write_bytes(b"half")
        raise OSError("compiler died")

    with pytest.raises(OSError, match="compiler died"):
        cache.get_or_build("k", fails)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_the_cap_drops_the_least_recently_used_packages(tmp_path):
    cache = ArtifactCache(tmp_path, 2.5 / 1024)  # 2.5 KiB: two packages of 1 KiB
    for i, key in enumerate("abc"):
        cache.get_or_build(key, lambda out: out.write_bytes(b"x" * 1024))
        os.utime(cache.path(key), (1000 + i, 1000 + i))
    assert not cache.path("a").exists()  # dropped when c came
    cache.get_or_build("b", _never)  # b is used again: now c is the oldest
    cache.get_or_build("d", lambda out: out.write_bytes(b"x" * 1024))
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == ["b.pt2", "d.pt2"]


def _build_slowly(root: str, started) -> None:
    def build(out):
        with open(os.path.join(root, "builds"), "a") as f:
            f.write("1")
        time.sleep(0.5)
        out.write_bytes(b"package")

    started.wait()
    ArtifactCache(root, 10).get_or_build("k", build)


def test_replicas_starting_together_build_a_package_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    procs = [ctx.Process(target=_build_slowly, args=(str(tmp_path), started)) for _ in range(3)]
    for p in procs:
        p.start()
    started.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert (tmp_path / "builds").read_text() == "1"
    assert (tmp_path / "k.pt2").read_bytes() == b"package"


def _never(out):
    raise AssertionError("built again")
