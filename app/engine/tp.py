"""Tensor parallelism: one process per rank (torch.distributed: gloo on CPUs, NCCL with `device: cuda`, rank r
on GPU r), driven by rank 0, the engine's process.

`TPGroup` starts ranks 1..T-1, shards the model on every rank (`app.models.shard`, in the stage-1 head order
of balanced placement) and offers the verbs of a `Worker` (`VERBS`): each call is broadcast to the other
ranks and run on rank 0's own shard, so the forwards' all_reduce and the all_to_all of checkpoint stores and
loads run in lockstep. `build_engine(model, cfg, tp_size, placement)` is the entry point: TP = 1 stays
in-process. See docs/architecture.md, "Engine: who decides, who holds the bytes".
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.placement import plan_placement
from app.dasc.selection import make_plan
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.worker import TPContext, Worker, worker_device
from app.models.loader import load_model, resolve_model_dir
from app.models.shard import check_divisible, shard_model
from app.models.tokenizer import Tokenizer

VERBS = ("run", "store", "store_snapshot", "load", "zero", "copy_state", "refresh", "configure_checkpoints",
         "set_policy")


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
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_serve_rank, args=(r, tp, port, model_dir, cfg, placement), daemon=True)
                      for r in range(1, tp)]
        for p in self.procs:
            p.start()
        _init(0, tp, port, cfg.device)
        self.size = tp
        self.model, self.local = build_rank(0, tp, model_dir, cfg, placement)

    def __getattr__(self, name):
        if name in VERBS:
            return lambda *args: self._call(name, *args)
        return getattr(self.local, name)

    def _call(self, verb: str, *args):
        dist.broadcast_object_list([(verb, args)], src=0)
        return getattr(self.local, verb)(*args)

    def close(self) -> None:
        dist.broadcast_object_list([("shutdown", ())], src=0)
        for p in self.procs:
            p.join(timeout=30)
        dist.destroy_process_group()


def _serve_rank(rank: int, tp: int, port: int, model_dir: str, cfg: EngineConfig, placement: str) -> None:
    torch.set_num_threads(int(os.environ.get("DASC_TP_THREADS", "1")))
    _init(rank, tp, port, cfg.device)
    _, worker = build_rank(rank, tp, model_dir, cfg, placement)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        verb, args = box[0]
        if verb == "shutdown":
            break
        getattr(worker, verb)(*args)
    dist.destroy_process_group()


def _init(rank: int, tp: int, port: int, device: str) -> None:
    """NCCL between GPUs (each rank's own device current first), gloo between CPU ranks."""
    backend = "gloo"
    if device != "cpu":
        torch.cuda.set_device(worker_device(device, rank))
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(minutes=10))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
