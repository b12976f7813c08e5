"""Tensor parallelism: one process per rank (torch.distributed: gloo on CPUs, NCCL with `device: cuda`, rank r
on GPU r), driven by rank 0, the engine's process.

`TPGroup` starts ranks 1..T-1, shards the model on every rank (`app.models.shard`, in the stage-1 head order
of balanced placement) and offers the verbs of a `Worker` (`VERBS`): each call is broadcast to the other
ranks and run on rank 0's own shard, so the forwards' all_reduce and the all_to_all of checkpoint stores and
loads run in lockstep. `build_engine(model, cfg, tp_size, placement)` is the entry point: TP = 1 stays
in-process. See docs/architecture.md, "Engine: who decides, who holds the bytes".

Faults. A dead rank must take its replica down cleanly, so that Serve replaces it, never hang it:
- Collectives are bounded: env `DASC_TP_TIMEOUT_S` (default `COLLECTIVE_TIMEOUT_S`, 60 s) is the process
  group's timeout, which gloo applies to every collective (a NCCL rank's watchdog ends its process instead,
  which also takes the replica down).
- An idle rank therefore must not wait for the next verb inside a collective (it would time out after
  that long without requests): it waits on its pipe from rank 0, where rank 0 writes one byte per verb
  before broadcasting it. The pipe also tells a rank that rank 0 died (end of file), and a rank checks its
  parent pid while idle, so that ranks never outlive their engine.
- Every verb first checks that the rank processes live; any exception from a verb (a collective with a dead
  or stuck peer among them) leaves the ranks out of lockstep, so the group is then broken for good and every
  call raises `EngineUnavailable` at once. `check_alive()` is the cheap probe for health checks.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.placement import plan_placement
from app.dasc.selection import make_plan
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import EngineUnavailable
from app.engine.worker import TPContext, Worker, worker_device
from app.models.loader import load_model, resolve_model_dir
from app.models.shard import check_divisible, shard_model
from app.models.tokenizer import Tokenizer

VERBS = ("run", "store", "store_snapshot", "load", "zero", "copy_state", "refresh", "configure_checkpoints",
         "set_policy", "rollback", "demote", "promote_kv", "promote_state", "host_drop")
COLLECTIVE_TIMEOUT_S = 60.0  # default of env DASC_TP_TIMEOUT_S, read when a group starts
START_TIMEOUT_S = 1800.0  # a rank loading a large checkpoint from disk may take minutes; it is watched meanwhile
JOIN_TIMEOUT_S = 10.0


def build_engine(model: str, cfg: EngineConfig, tp_size: int = 1, placement: str = "off") -> Engine:
    model_dir = resolve_model_dir(model)
    tokenizer = Tokenizer.from_dir(model_dir)
    if tp_size == 1:
        return Engine(load_model(model_dir, getattr(torch, cfg.dtype)), tokenizer, cfg)
    if cfg.decode_graphs or cfg.compile_decode:
        raise ValueError("decode_graphs and compile_decode run with one worker: set tp to 1 or turn them off")
    group = TPGroup(str(model_dir), cfg, tp_size, placement)
    engine = Engine(group.model, tokenizer, cfg, worker=group)
    engine.tp_group = group
    return engine


def build_rank(rank: int, tp: int, model_dir: str, cfg: EngineConfig, placement: str):
    """Load, decide the stage-1 head order (balanced placement), shard, and wrap in a Worker."""
    model = load_model(model_dir, getattr(torch, cfg.dtype))
    check_divisible(model, tp)
    geometry, horizons = model_geometry(model), model_horizons(model)
    head_order = None
    if placement == "balanced" and cfg.w_max is not None:
        head_order = plan_placement(make_plan(geometry, horizons, cfg.w_max, cfg.selector), tp, "balanced").head_order
    shard_model(model, rank, tp, [list(o) for o in head_order] if head_order else None)
    return model, Worker(model, cfg, tp=TPContext(rank, tp, placement, head_order, geometry, horizons))


class TPGroup:
    def __init__(self, model_dir: str, cfg: EngineConfig, tp: int, placement: str = "off") -> None:
        check_divisible(load_model(model_dir), tp)  # fail before starting processes, naming the numbers
        for rank in range(tp):
            worker_device(cfg.device, rank)  # likewise for a missing GPU
        self.size, self._broken, self._closed = tp, None, False
        self.timeout_s = float(os.environ.get("DASC_TP_TIMEOUT_S", COLLECTIVE_TIMEOUT_S))
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for r in range(1, tp):
            ours, theirs = ctx.Pipe()
            args = (r, tp, port, model_dir, cfg, placement, theirs, os.getpid(), self.timeout_s)
            self.procs.append(ctx.Process(target=_serve_rank, args=args, daemon=True))
            self.conns.append(ours)
            self.procs[-1].start()
            theirs.close()  # the rank holds the only other end: its end of file is our death
        try:
            self._expect(b"up")  # every rank imported and is about to join: the rendezvous takes no time
            _init(0, tp, port, cfg.device, self.timeout_s)
            self.model, self.local = build_rank(0, tp, model_dir, cfg, placement)
            self._expect(b"ready")
        except BaseException:
            self.close()
            raise

    def __getattr__(self, name):
        if name in VERBS:
            return lambda *args: self._call(name, *args)
        if name == "local":  # not built (yet): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    def check_alive(self) -> None:
        """Raise EngineUnavailable, naming the rank, if a rank process has exited or the group is broken."""
        if self._broken is None:
            dead = self._dead()
            if dead:
                self._broken = f"tensor-parallel {dead}"
            elif self._closed:
                self._broken = "the tensor-parallel group is closed"
        if self._broken is not None:
            raise EngineUnavailable(self._broken)

    def _call(self, verb: str, *args):
        """Wake the ranks, broadcast the call, run it here; any failure breaks the group (see the module doc)."""
        self.check_alive()
        try:
            for conn in self.conns:
                conn.send_bytes(b"v")
            dist.broadcast_object_list([(verb, args)], src=0)
            return getattr(self.local, verb)(*args)
        except Exception as exc:
            dead = self._dead(wait_s=1.0) or "every rank process is alive"
            self._broken = f"tensor-parallel {verb} failed ({dead}): {exc}"
            raise EngineUnavailable(self._broken) from exc

    def _dead(self, wait_s: float = 0.0) -> str:
        """The ranks that exited, named; waits up to `wait_s` for one (a crashed peer takes a moment to go)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.05)
        return "; ".join(f"rank {r} (pid {p.pid}) exited with {_exit_text(p.exitcode)}"
                         for r, p in enumerate(self.procs, 1) if p.exitcode is not None)

    def _expect(self, message: bytes) -> None:
        """Wait for `message` from every rank while it lives (a rank that dies starting up names itself)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for r, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            got = None
            while proc.is_alive() and time.monotonic() < deadline:
                if conn.poll(0.2):
                    try:
                        got = conn.recv_bytes()
                    except EOFError:
                        proc.join(timeout=5)
                    break
            if got != message:
                state = f"exited with {_exit_text(proc.exitcode)}" if proc.exitcode is not None else "did not answer"
                raise RuntimeError(f"TP rank {r} (pid {proc.pid}) {state} while starting")

    def close(self) -> None:
        """End the ranks (end of file on their pipes: they leave their loop), with bounded joins: a rank that
        is dead or stuck does not hold this up; stragglers are terminated, then killed."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if self._broken is None else 1.0)  # broken: none will answer
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for stop in (lambda p: p.terminate(), lambda p: p.kill()):  # a stopped process only takes the kill
            for p in self.procs:
                if p.is_alive():
                    stop(p)
                    p.join(timeout=2)
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve_rank(rank: int, tp: int, port: int, model_dir: str, cfg: EngineConfig, placement: str, conn,
                parent: int, timeout_s: float) -> None:
    torch.set_num_threads(int(os.environ.get("DASC_TP_THREADS", "1")))
    conn.send_bytes(b"up")
    _init(rank, tp, port, cfg.device, timeout_s)
    _, worker = build_rank(rank, tp, model_dir, cfg, placement)
    conn.send_bytes(b"ready")
    while _wait_for_verb(conn, parent):
        box = [None]
        dist.broadcast_object_list(box, src=0)
        verb, args = box[0]
        getattr(worker, verb)(*args)
    dist.destroy_process_group()


def _wait_for_verb(conn, parent: int) -> bool:
    """Idle outside any collective until rank 0 announces a verb; False once rank 0 closed or died."""
    try:
        while not conn.poll(1.0):
            if os.getppid() != parent:
                return False
        return conn.recv_bytes() == b"v"
    except (EOFError, OSError):
        return False


def _init(rank: int, tp: int, port: int, device: str, timeout_s: float) -> None:
    """NCCL between GPUs (each rank's own device current first), gloo between CPU ranks."""
    backend = "gloo"
    if device != "cpu":
        torch.cuda.set_device(worker_device(device, rank))
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=timeout_s))


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
