"""Compiled packages built in the background: the server serves eagerly meanwhile and swaps each in once it lands.

`BackgroundCompiles` starts one compile child (app/engine/compile_child.py) for the packages a worker's cache lacks
and reads its reports on a thread of its own. Each package built is handed over by `take` (the worker loads it
between steps) and logged ("compiled package 4 of 13: decode bucket 8, 38.2 s"); `wake` is called after each report,
so that an idle step loop comes round to install it. A child that fails reports why, and the server goes on
with what it has. `close` ends the child. The child's scratch files live in a private work directory of the cache
(`.work-PID-*`), removed when it ends; its stderr (Inductor's and the compilers' chatter) goes to a log there,
whose tail is logged if it fails.

    server process                                      compile child (SCHED_IDLE)
    Job list, model weights -> .work-PID-*/  --spawn-->  for each job: build into the cache
    reader thread  <-- {"key", "built", "seconds"} ---  (one JSON line per package)
    worker.install() between steps: load each package reported
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from app.engine.aot import ArtifactCache
from app.engine.compile_child import encode_config

log = logging.getLogger("app.engine.compile")
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Job:
    """One package to build: its cache key, kind ("decode" or "prefill"), what the log calls it, and what the child
    needs besides the model (`batch`, or `core` and `n`)."""

    key: str
    kind: str
    label: str
    batch: int | None = None
    core: tuple | None = None
    n: int | None = None


@dataclass(frozen=True)
class Landed:
    """A package the child reported: built now (or found built by another process), and its seconds."""

    job: Job
    path: Path
    built: bool
    seconds: float


class BackgroundCompiles:
    def __init__(self, jobs: list[Job], cache: ArtifactCache, model=None, wake: Callable[[], None] | None = None
                 ) -> None:
        """Start building `jobs` (in order) into `cache`; `model`: the server's model, for decode jobs (its weights
        are written for the child). `wake` is called after each report (settable later: `set_wake`)."""
        self.jobs, self.cache = list(jobs), cache
        self._by_key = {j.key: j for j in self.jobs}
        self._lock = threading.Lock()
        self._landed: list[Landed] = []
        self._wake = wake
        self.done: list[str] = []  # keys reported built or found, in order
        self.error: str | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._closing = False
        self._work_cm = cache.scratch("work")
        self.work = self._work_cm.__enter__()
        spec = self._spec(model)
        (self.work / "spec.json").write_text(json.dumps(spec))
        self._log = open(self.work / "compile.log", "wb")
        log.info("%d compiled package(s) not in %s: building them in the background, one at a time; serving "
                 "eagerly until each is in", len(self.jobs), cache.root)
        self.proc = subprocess.Popen([sys.executable, "-m", "app.engine.compile_child", str(self.work / "spec.json")],
                                     stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
                                     env=self._env(), cwd=str(_ROOT), start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="compile-reports", daemon=True)
        self._reader.start()

    def set_wake(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wake = wake
            ready = bool(self._landed)
        if ready:
            wake()

    def ready(self) -> bool:
        """Whether a package waits to be taken."""
        with self._lock:
            return bool(self._landed)

    def take(self) -> list[Landed]:
        """The packages reported since the last call (the caller loads them)."""
        with self._lock:
            out, self._landed = self._landed, []
        return out

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the child to end (every job reported, or a failure); False if `timeout_s` passed first."""
        self._reader.join(timeout_s)
        return not self._reader.is_alive()

    @property
    def running(self) -> bool:
        return self._reader.is_alive()

    def pending(self) -> list[str]:
        """Labels of the jobs not reported yet, in order (the first is being built)."""
        with self._lock:
            done = set(self.done)
        return [j.label for j in self.jobs if j.key not in done]

    def close(self) -> None:
        """Stop the child (and the compilers it runs), if it still runs; remove its work directory."""
        self._closing = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self._reader.join(10)
        self._cleanup()

    # ------------------------------------------------------------------ the child
    def _spec(self, model) -> dict:
        jobs = [{k: v for k, v in asdict(j).items() if v is not None} for j in self.jobs]
        spec = {"cache_dir": str(self.cache.root), "cache_mb": self.cache.max_bytes / 2**20,
                "threads": torch.get_num_threads(), "parent": os.getpid(), "jobs": jobs, "model": None}
        if model is not None and any(j.kind == "decode" for j in self.jobs):
            from safetensors.torch import save_model

            weights = self.work / "model.safetensors"
            save_model(model, str(weights))
            spec["model"] = {"class": _qualname(type(model)), "config_class": _qualname(type(model.config)),
                             "config": encode_config(model.config),
                             "dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
                             "weights": str(weights)}
        return spec

    def _env(self) -> dict:
        env = dict(os.environ)
        env.update(TMPDIR=str(self.work), TORCHINDUCTOR_CACHE_DIR=str(self.work / "inductor"),
                   TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=os.pathsep.join(
                       p for p in (str(_ROOT), env.get("PYTHONPATH")) if p))
        return env

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                self._receive(message)
        finally:
            rc = self.proc.wait()
            with self._lock:
                if rc != 0 and self.error is None and not self._closing:
                    self.error = f"the compile process ended with status {rc}"
                self.ended = time.monotonic()
            if self._closing and len(self.done) < len(self.jobs):
                log.info("compiling stopped with the engine (%d of %d packages built)", len(self.done), len(self.jobs))
            elif self.error is not None:
                log.warning("compiling stopped: %s; serving on with %d of %d packages built. The compile log's "
                            "end:\n%s", self.error, len(self.done), len(self.jobs), self._log_tail())
            else:
                log.info("every compiled package is built (%d in %.0f s)", len(self.jobs), self.ended - self.started)
            self._cleanup()
            self._call_wake()

    def _receive(self, message: dict) -> None:
        job = self._by_key.get(message.get("key"))
        if job is None:
            return
        if "error" in message:
            with self._lock:
                self.error = f"{job.label}: {message['error']}"
            return
        landed = Landed(job, self.cache.path(job.key), bool(message.get("built")), float(message.get("seconds", 0)))
        with self._lock:
            self.done.append(job.key)
            self._landed.append(landed)
            count = len(self.done)
        log.info("compiled package %d of %d: %s, %.1f s", count, len(self.jobs), job.label, landed.seconds)
        self._call_wake()

    def _call_wake(self) -> None:
        with self._lock:
            wake = self._wake
        if wake is not None:
            wake()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.work / "compile.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _cleanup(self) -> None:
        with self._lock:
            cm, self._work_cm = self._work_cm, None
        if cm is not None:
            self._log.close()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            cm.__exit__(None, None, None)


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

