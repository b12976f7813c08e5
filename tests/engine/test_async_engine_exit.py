"""A process that ran an AsyncEngine (which freezes the heap) and loaded Triton exits cleanly: nanobind, which
Triton's bindings use, prints a "leaked" line for each of its objects still alive at exit, and a frozen heap
would keep them all alive. torch.compile and transformers load Triton, so the test process itself did this."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import triton  # noqa: F401
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from tests.helpers import load_zoo

model, tok = load_zoo("gdn-tiny")
engine = AsyncEngine(Engine(model, tok, EngineConfig()))
engine.shutdown()
print("served")
"""


def test_exit_after_a_frozen_heap_reports_no_leaks():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "served", proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
