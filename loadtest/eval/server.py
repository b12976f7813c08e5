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
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtest.common import REPO, wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(model: str, engine: dict, log: Path, timeout_s: float = 180.0, threads: int | None = None):
    """Yields the server's base URL (`http://127.0.0.1:<port>`) once /health answers 200. `engine`: EngineConfig
    knobs (JSON-able), over eager decode steps (an evaluation measures outputs, not speed: no start compiles);
    `log`: where the server's output goes; `threads`: torch threads of the server."""
    port = free_port()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    cmd = [sys.executable, "-m", "app.api.local", "--model", model, "--port", str(port),
           "--engine", json.dumps({"compile_decode": False, "compile_prefill": False, **engine})]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout_s, proc, f"the server (log: {log})", poll_s=0.3)
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



def engine_status(url: str) -> dict:
    """The engine's telemetry snapshot (/status of the local server has one replica, "local")."""
    return httpx.get(f"{url}/status", timeout=30).json()["replicas"]["local"]
