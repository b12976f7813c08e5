"""A tensor-parallel engine fails cleanly when a rank process dies (issue 20, item 6), on CPU (TP=2, gloo):

- a SIGKILLed rank 1 turns the next verb into `EngineUnavailable` naming the rank, the group stays broken
  (later calls refuse at once, `check_alive` says why) and `close()` returns;
- an idle engine outlives the collective timeout (ranks do not wait for work inside a collective), while a
  stuck rank (SIGSTOP) is detected through that timeout instead of hanging rank 0;
- ranks do not outlive rank 0: SIGKILL the engine's process mid-run and rank 1 exits.

Deadlines here only bound hangs; nothing asserts how fast detection is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.engine.config import EngineConfig
from app.engine.errors import EngineUnavailable
from app.engine.request import SamplingParams
from app.engine.tp import build_engine

pytestmark = pytest.mark.slow
CFG = EngineConfig(max_running=4, kv_slots=2048, checkpoint_slots=4)
LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tp2(monkeypatch):
    """Build a TP=2 kda-tiny engine with the given collective timeout; its group is closed after the test
    whatever happened (a second group in this process needs the first one's process group destroyed)."""
    built = []

    def make(timeout_s: float):
        monkeypatch.setenv("DASC_TP_TIMEOUT_S", str(timeout_s))
        built.append(build_engine("kda-tiny", CFG, 2))
        assert built[-1].tp_group.timeout_s == timeout_s
        return built[-1], built[-1].tp_group.procs[0]

    yield make
    for engine in built:
        engine.tp_group.close()


@pytest.mark.timeout(180)
def test_killed_rank_breaks_the_group_cleanly(tp2):
    engine, rank1 = tp2(30)
    group = engine.tp_group
    try:
        group.check_alive()  # healthy: no error
        engine.add_request(engine.tokenizer.encode("def f(x):\n    return x\n" * 4), LONG, "r")
        for _ in range(3):
            engine.step()
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailable, match=f"rank 1 \\(pid {rank1.pid}\\) exited with signal SIGKILL"):
            engine.step()
        with pytest.raises(EngineUnavailable, match="rank 1"):  # broken for good: any verb refuses
            group.zero(0)
        with pytest.raises(EngineUnavailable, match="SIGKILL"):
            group.check_alive()
    finally:
        group.close()
    assert not rank1.is_alive()
    with pytest.raises(EngineUnavailable):
        group.check_alive()


@pytest.mark.timeout(180)
def test_idle_outlives_the_timeout_and_a_stuck_rank_times_out(tp2):
    engine, rank1 = tp2(3)
    group = engine.tp_group
    prompt = engine.tokenizer.encode("x = 1\n" * 8)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        time.sleep(5)  # idle for longer than the collective timeout
        assert len(engine.generate([prompt], greedy)[0][0].output_ids) == 4
        group.check_alive()
        os.kill(rank1.pid, signal.SIGSTOP)  # alive but stuck: only the collective timeout can tell
        engine.add_request(prompt, LONG, "stuck")
        with pytest.raises(EngineUnavailable, match="every rank process is alive"):
            for _ in range(100):  # the first step that reaches a collective times out
                engine.step()
        with pytest.raises(EngineUnavailable):
            group.check_alive()
    finally:
        group.close()  # kills the stopped rank, in bounded time
    assert not rank1.is_alive()


_CHILD = """
import sys
from app.engine.config import EngineConfig
from app.engine.request import SamplingParams
from app.engine.tp import build_engine

if __name__ == "__main__":
    engine = build_engine("kda-tiny", EngineConfig(max_running=4, kv_slots=2048, checkpoint_slots=4), 2)
    engine.add_request(engine.tokenizer.encode("y = 2\\n" * 8), SamplingParams(max_tokens=1500, ignore_eos=True), "r")
    engine.step()
    print(engine.tp_group.procs[0].pid, flush=True)
    while engine.has_unfinished():
        engine.step()
"""


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one that nobody has reaped yet is a zombie: not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(240)
def test_ranks_exit_when_rank0_dies(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    rank1 = None
    try:
        rank1 = int(child.stdout.readline())
        assert _running(rank1)
        child.kill()  # SIGKILL mid-run: rank 0 gets no chance to close the group
        child.wait(timeout=30)
        deadline = time.monotonic() + 90
        while _running(rank1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(rank1), f"TP rank 1 (pid {rank1}) outlived its engine's process"
    finally:
        child.kill()
        child.wait(timeout=30)
        if rank1 is not None and _running(rank1):
            os.kill(rank1, signal.SIGKILL)
