"""`python -m app.api.local` in a process of its own on loopback, as a user runs it: what the stop benchmark
(loadtest/tiers_stops.py) and the server's tests (tests/api/test_local_server.py) start and stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from app.engine.engine import DISK_SECRET_ENV
from loadtest.common import REPO
from loadtest.serve_harness import free_port

START_S = 120.0  # a bound on a start (a warm or eager one takes seconds)


@contextmanager
def local_server(engine: dict, tmp: Path, stop: int = signal.SIGINT, model: str = "kda-tiny"):
    """The server of `model` with `--engine engine`, TMPDIR `tmp`, a disk secret and this process's torch thread
    count, yielding its URL once /health answers; when the block ends, `stop` is sent and the exit awaited (after a
    SIGINT it must be a clean one: RuntimeError otherwise, with the server's log)."""
    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp), DISK_SECRET_ENV: os.environ.get(DISK_SECRET_ENV, "local-server-secret"),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-m", "app.api.local", "--model", model, "--port", str(port),
                             "--engine", json.dumps(engine)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"the server did not answer /health within {START_S:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        rc = proc.wait(timeout=120)
        log = proc.stderr.read()
    if stop == signal.SIGINT and rc != 0:
        raise RuntimeError(f"the server's stop was not clean (exit {rc}): {log[-3000:]}")
