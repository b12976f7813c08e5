"""The servers loadtest/bench_peer.py compares, one at a time, each a fresh process on 127.0.0.1:

- ours-local: `python -m app.api.local --model M --port P` (our OpenAI-compatible API on one in-process engine,
  no Ray), its shipped defaults unless `--local-engine JSON` passes `--engine`. app.api.local leaves torch's
  thread count at its default (the physical cores); OMP_NUM_THREADS=2 pins it to 2, as llama-server's -t 2.
- ours-ray: `serve run` of configs/config.yaml with `ray_config`'s overrides (the model, one engine replica with 2
  torch threads, the port), on a new local Ray cluster (`--address local`) whose processes all carry a private
  RAY_TMPDIR; stopping it sends SIGINT (serve run shuts Serve and its cluster down), then kills what is left of
  its process group and every process that carries that RAY_TMPDIR: the cluster started here, no other. (Serve's
  HTTP proxy listens on 127.0.0.1; Ray 2.60's own gRPC servers, GCS, raylet and workers, bind every interface,
  as in every Ray run of this project: Ray has no setting for it.)
- llama: llama-server (loadtest/peer/llama.py) on the GGUF conversion (loadtest/peer/gguf.py).

Each starts in its own session (process group), is timed from launch to its first /health 200, and is stopped
through its process group. `Server.rss_mb` sums VmRSS over the server's processes (shared pages count once per
process: for ours-ray, a sum over Ray's raylet, GCS, dashboard, proxy and replica workers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtest.common import REPO, wait_compiled, wait_healthy
from loadtest.peer import llama

ARMS = ("ours-local", "ours-ray", "llama")
THREADS = 2
BASE_CONFIG = REPO / "configs" / "config.yaml"


def ray_config(model: str, port: int, threads: int = THREADS, base: Path = BASE_CONFIG,
               engine: dict | None = None) -> dict:
    """The shipped serve config with one app serving `model` from one engine replica with `threads` torch threads,
    its HTTP proxy on 127.0.0.1:`port`, and the engine knobs `engine` over the shipped ones; everything else as
    shipped."""
    cfg = yaml.safe_load(Path(base).read_text())
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": port}
    (app,) = cfg["applications"]
    app["args"] = {**app["args"], "model": model, "replicas": 1, "threads": threads}
    if engine:
        app["args"]["engine"] = {**app["args"].get("engine", {}), **engine}
    return cfg


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _carrying(marker: str) -> set[int]:
    """Processes whose command line or environment mentions `marker` (read where permitted)."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            for part in ("cmdline", "environ"):
                try:
                    if marker.encode() in (d / part).read_bytes():
                        found.add(int(d.name))
                        break
                except OSError:
                    pass
    return found


def _started(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): with the pid, names one process, never a reused pid.
    None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def cpu_seconds(pids: set[int] | None = None) -> float:
    """CPU seconds so far: the machine's busy time over all cores (pids None), or that of the processes `pids`."""
    tick = os.sysconf("SC_CLK_TCK")
    if pids is None:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
        return (user + nice + system + irq + softirq + steal) / tick
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Server:
    arm: str
    url: str
    proc: subprocess.Popen
    start_s: float  # launch to the first /health 200
    log: Path
    ray_tmp: Path | None = None  # ours-ray: its cluster's private RAY_TMPDIR
    compiled_s: float | None = None  # ours: launch to every compiled package in force (built in the background)

    def pids(self) -> set[int]:
        """The server's process tree, and for ours-ray every process of its cluster."""
        kids, out, todo = _children(), set(), [self.proc.pid]
        while todo:
            p = todo.pop()
            if p not in out:
                out.add(p)
                todo += kids.get(p, [])
        if self.ray_tmp is not None:
            out |= _carrying(str(self.ray_tmp))
        return out

    def rss_mb(self) -> float:
        return sum(_rss_kb(p) for p in self.pids()) / 1024

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and wait until every process it had is gone (SIGKILL to stragglers, by pid)."""
        mine = {p: _started(p) for p in self.pids()}
        if self.ray_tmp is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # serve run: Serve shutdown, then its Ray cluster's
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the session started for this server: its own processes only
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.time() + 15
        while time.time() < deadline:
            left = {p for p, t in mine.items() if t is not None and _started(p) == t}
            if self.ray_tmp is not None:
                left |= _carrying(str(self.ray_tmp))
            if not left:
                break
            time.sleep(0.5)
            for pid in left if time.time() > deadline - 10 else ():  # 5 s of grace, then SIGKILL
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


def launch(arm: str, cmd: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 300.0,
           ray_tmp: Path | None = None) -> Server:
    """Start `cmd` in a new session, wait for http://127.0.0.1:`port`/health to answer 200 (and, for our servers, for
    every compiled package to be in force: `wait_compiled`)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(arm, url, proc, 0.0, log, ray_tmp)
    try:
        wait_healthy(url, timeout, proc, f"{arm} (log: {log})", poll_s=0.05)
    except RuntimeError as e:
        server.stop()
        raise RuntimeError(f"{e}: {log.read_text()[-2000:]}") from e
    except BaseException:
        server.stop()
        raise
    server.start_s = time.perf_counter() - t0
    if arm.startswith("ours"):  # measured at compiled speed: a first start builds its packages in the background
        try:
            wait_compiled(url, timeout)
        except BaseException:
            server.stop()
            raise
        server.compiled_s = time.perf_counter() - t0
    return server


def start(arm: str, model: str, port: int, logdir: Path, gguf: Path | None = None,
          local_engine: dict | None = None, ray_engine: dict | None = None, timeout: float = 900.0) -> Server:
    """A fresh server of `arm` for `model`, a zoo name or checkpoint directory (llama: its GGUF file `gguf`);
    `local_engine`, `ray_engine`: engine knobs over the shipped ones of ours-local and ours-ray."""
    log = logdir / f"{arm}-{Path(model).name}-{port}.log"  # a zoo name or a checkpoint directory
    if arm == "ours-local":
        cmd = [sys.executable, "-m", "app.api.local", "--model", model, "--port", str(port)]
        if local_engine:
            cmd += ["--engine", json.dumps(local_engine)]
        return launch(arm, cmd, port, log, env={"OMP_NUM_THREADS": str(THREADS)}, timeout=timeout)
    if arm == "ours-ray":
        tmp = Path(tempfile.mkdtemp(prefix="dpeer-", dir="/tmp"))  # short: Ray's socket paths must stay < 108
        config = tmp / "serve.yaml"
        config.write_text(yaml.safe_dump(ray_config(model, port, engine=ray_engine), sort_keys=False))
        serve = Path(sys.executable).with_name("serve")
        env = {"RAY_TMPDIR": str(tmp), "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_USAGE_STATS_ENABLED": "0"}
        return launch(arm, [str(serve), "run", "--address", "local", str(config)], port, log, env=env, ray_tmp=tmp,
                      timeout=timeout)
    if arm == "llama":
        if gguf is None:
            raise ValueError("the llama arm needs the model's GGUF file")
        return launch(arm, llama.server_command(gguf, port), port, log)
    raise ValueError(f"unknown arm {arm!r}; arms: {ARMS}")
