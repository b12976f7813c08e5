"""Shared helpers for benchmark scripts: machine description, medians, markdown tables, run records, result files.

A run's record (`Run`) names its script and device ("cpu" or "cuda") and carries the commit, date, machine,
command line and config. `save` keeps one JSON per script and device, `loadtest/results/<script>_<device>.json`:

    {"script": "bench_engine", "device": "cpu",
     "runs": {"<variant>": {"commit", "date", "machine", "command", "config", "results"}}}

A variant is what a script measures in separate runs (bench_engine: model, engine options and section;
bench_sampling: rows per draw; bench_async: torch threads; the others: the model or "default"). A new run of a
variant replaces that variant's entry and leaves the others as they are.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
DEVICES = ("cpu", "cuda")
_VARIANT = re.compile(r"[A-Za-z0-9._+/-]+")


def machine(device: str = "cpu") -> dict:
    """The host (CPU model, cores, torch threads, versions) and, for "cuda", the GPU's name."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def machine_line(m: dict) -> str:
    """One line for a doc: 'AMD EPYC, 2 cores, torch 2.13.0+cpu (2 threads), Python 3.11.7; GPU NVIDIA H200'."""
    threads = f"{m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''}"
    line = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({threads}), Python {m['python']}"
    return line + (f"; GPU {m['gpu']}" if "gpu" in m else "")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "the server",
                 poll_s: float = 0.1) -> None:
    """Return once `url`/health answers 200; raise RuntimeError if `proc` exits first, TimeoutError after
    `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before /health answered")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s ({what})")


def wait_compiled(url: str, timeout_s: float, poll_s: float = 0.5) -> float:
    """Seconds until every engine replica of the server at `url` reports its compiled packages in force, or built
    as far as the machine allows (/status `compile` no longer "building"; an engine without compiled packages
    reports none): benchmarks of the compiled speed wait for it, as a first start builds them in the background."""
    import httpx

    t0 = time.monotonic()
    while True:
        replicas = httpx.get(f"{url}/status", timeout=30).json().get("replicas", {})
        if replicas and all((r.get("compile") or {}).get("state") != "building" for r in replicas.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{url}: compiled packages not in force within {timeout_s:.0f} s")
        time.sleep(poll_s)


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def check_variant(variant: str) -> str:
    """A variant name is letters, digits and `._+/-`, without `--` (it also names a marker in an HTML comment)."""
    if not _VARIANT.fullmatch(variant) or "--" in variant:
        raise ValueError(f"bad variant name {variant!r}")
    return variant


@dataclass(frozen=True)
class Run:
    """One benchmark run: `script` is the module name (`bench_engine`), `device` "cpu" or "cuda", `commit` a short
    hash (with "-dirty" when tracked code differed from it), `date` ISO 8601, `command` the command line."""

    script: str
    device: str
    commit: str
    date: str
    machine: dict
    command: str
    config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9_]+", self.script):
            raise ValueError(f"bad script name {self.script!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, not {self.device!r}")

    def record(self, results: dict) -> dict:
        """What `save` keeps for one variant: this run's metadata and its results."""
        return {"commit": self.commit, "date": self.date, "machine": self.machine, "command": self.command,
                "config": self.config, "results": results}


def start_run(script: str, config: dict, argv: list[str] | None = None, device: str = "cpu") -> Run:
    """The record of a run starting now: `argv` are the script's arguments (default: the process's own)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return Run(script, device, git_commit(), datetime.now(timezone.utc).isoformat(timespec="seconds"),
               machine(device), shlex.join(["python", "-m", f"loadtest.{script}", *args]), config)


def git_commit(repo: Path = REPO) -> str:
    """HEAD's short hash, plus "-dirty" when tracked files other than benchmark outputs and prose (loadtest/results/,
    docs/, README.md) differ from it; "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!loadtest/results", ":!docs",
                    ":!README.md")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def results_path(script: str, device: str, directory: Path = RESULTS) -> Path:
    return directory / f"{script}_{device}.json"


def save(run: Run, variant: str, results: dict, directory: Path = RESULTS) -> Path:
    """Write `run`'s record of `variant` into its script and device's results file, replacing that variant's
    previous record and keeping every other variant's; -> the file's path."""
    path = results_path(run.script, run.device, directory)
    data = json.loads(path.read_text()) if path.exists() else {"script": run.script, "device": run.device, "runs": {}}
    data["runs"][check_variant(variant)] = run.record(results)
    data["runs"] = dict(sorted(data["runs"].items()))
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
