"""A local API server for one evaluation setting: `python -m app.api.local` in a process group of its own on a
free loopback port, with the setting's engine knobs; stopped (the whole group) when the block exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtest.common import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(model: str, engine: dict, log: Path, timeout_s: float = 180.0, threads: int | None = None):
    """Yields the server's base URL (`http://127.0.0.1:<port>`) once /health answers 200. `engine`: EngineConfig
    knobs (JSON-able); `log`: where the server's output goes; `threads`: torch threads of the server."""
    port = free_port()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = [sys.executable, "-m", "app.api.local", "--model", model, "--port", str(port),
           "--engine", json.dumps(engine)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout_s, log)
        yield url
    finally:
        _signal_group(proc.pid, signal.SIGTERM)  # the group may be gone already (a server that failed to start)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; its log: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:.0f} s; log: {log}")


def engine_status(url: str) -> dict:
    """The engine's telemetry snapshot (/status of the local server has one replica, "local")."""
    return httpx.get(f"{url}/status", timeout=30).json()["replicas"]["local"]
