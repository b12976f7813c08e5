"""Shared helpers for benchmark scripts: machine description, medians, markdown tables, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


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


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def header(title: str, config: dict) -> str:
    m = machine()
    return (f"## {title}\n\nMachine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} "
            f"({m['torch_threads']} threads), Python {m['python']}.\nConfig: `{json.dumps(config)}`\n")


def append_section(path: str | None, md: str) -> None:
    """Append a benchmark's markdown section to `path` (the --out file, usually docs/benchmarks.md), if given."""
    if path:
        with open(path, "a") as f:
            f.write("\n" + md + "\n")
