"""Checkpoint codec benchmark at production shapes: `python -m loadtest.bench_codec [--device cuda] [--out F]`.

For one sequence's whole recurrent state of Kimi-Linear-48B-A3B (20 KDA layers, 32 heads x 128 x 128) and
Qwen3-Next-80B-A3B (36 GDN layers, 32 value heads x 128 x 128), TP=1, fp32 states and BF16 conv windows:
the time to store a checkpoint from an active-state slot and to load it back into one, as the engine's
worker does (app/engine/worker.py: `codec.store(slot, states.view(a))`, `states.write(a, codec.load(slot))`),
for the dense
codec (the baseline, measured in the same run) and the dasc codec at a few W_max, fp32 and INT8. On CUDA the
dasc codec packs with the Triton kernels; the `torch` rows run the same codec through the torch reference
ops (`kernels/pack_ref.py`) on the same device, so the kernels are compared against what they replace.
The plans come from generated checkpoints with the real key names, shapes and decay ranges
(`loadtest/fake_checkpoints.py`); no projection weights are needed for a codec.

Each figure is the median over --repeats runs of the median of --samples synchronised calls (after warm-up).
Results: loadtest/results/bench_codec_<cpu|cuda>.json, variant "default"; --out DOC replaces that variant's
block in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager

import torch

from app.cache.checkpoint import DenseCodec
from app.cache.pools import StateStorage
from app.dasc import plan as plan_tool
from app.dasc.codec import DascCodec
from app.dasc.selection import decay_plan
from app.models.batch import LinearStates
from kernels import pack, pack_ref
from loadtest import fake_checkpoints
from loadtest.common import start_run, table
from loadtest.sections import publish

MODELS = {"kimi-linear-48b-a3b": fake_checkpoints.write_kimi_linear_48b,
          "qwen3-next-80b-a3b": fake_checkpoints.write_qwen3_next_80b}


def state_template(ckpt) -> LinearStates:
    """A batch-1 state of the checkpoint's shapes, random values (INT8 scales see real magnitudes)."""
    g = torch.Generator().manual_seed(0)
    conv = [torch.randn(1, ckpt.conv_channels, ckpt.conv_window, generator=g).to(torch.bfloat16)
            for _ in ckpt.geometry]
    ssm = [torch.randn(1, geo.heads, geo.d_k, geo.d_v, generator=g) for geo in ckpt.geometry]
    return LinearStates(conv, ssm)


@contextmanager
def torch_pack_ops():
    """Run the codec through the torch reference ops whatever the device."""
    saved = pack.pack_rows, pack.unpack_rows
    pack.pack_rows, pack.unpack_rows = pack_ref.pack_rows, pack_ref.unpack_rows
    try:
        yield
    finally:
        pack.pack_rows, pack.unpack_rows = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_codec(codec, states: StateStorage, device: torch.device, samples: int, warmup: int = 3):
    """-> (store seconds, load seconds), medians of `samples` synchronised calls each: active slot 0 -> checkpoint
    slot 1 -> active slot 1."""
    stores, loads = [], []
    for i in range(warmup + samples):
        _sync(device)
        t0 = time.perf_counter()
        codec.store(1, states.view(0))
        _sync(device)
        t1 = time.perf_counter()
        states.write(1, codec.load(1))
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            stores.append(t1 - t0)
            loads.append(t2 - t1)
    return statistics.median(stores), statistics.median(loads)


def codecs(ckpt, state: LinearStates, w_maxes, device: torch.device):
    """(name, w_max, quant, ops, codec) for the dense baseline and every dasc variant, allocated on device."""
    yield "dense", 0, "none", "torch", DenseCodec(state)
    ops = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    for w in w_maxes:
        plan = decay_plan(list(ckpt.geometry), list(ckpt.horizons), w)
        for quant in ("none", "int8"):
            for op in ops:
                yield "dasc", w, quant, op, DascCodec(state, plan, "ragged", quant)


def bench_model(name: str, w_maxes, device: torch.device, repeats: int, samples: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = plan_tool.read_checkpoint(MODELS[name](tmp, ballast=False))
    rows = []
    template = state_template(ckpt)
    with torch.device(device):  # as the engine worker builds its codecs: storage and row ids on the device
        states = StateStorage(template, 2)
        states.write(0, LinearStates([c.to(device) for c in template.conv], [s.to(device) for s in template.ssm]))
        for kind, w, quant, op, codec in codecs(ckpt, template, w_maxes, device):
            codec.allocate(2)
            runs = []
            for _ in range(repeats):
                if op == "torch" and kind == "dasc":
                    with torch_pack_ops():
                        runs.append(time_codec(codec, states, device, samples))
                else:
                    runs.append(time_codec(codec, states, device, samples))
            rows.append({"model": name, "codec": kind, "w_max": w, "quant": quant, "ops": op,
                         "bytes_per_slot": codec.bytes_per_slot,
                         "store_ms": statistics.median(r[0] for r in runs) * 1e3,
                         "load_ms": statistics.median(r[1] for r in runs) * 1e3})
            del codec
    dense = rows[0]
    for r in rows:
        r["compression"] = dense["bytes_per_slot"] / r["bytes_per_slot"]
        r["store_vs_dense"] = r["store_ms"] / dense["store_ms"]
        r["load_vs_dense"] = r["load_ms"] / dense["load_ms"]
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--w-max", type=float, nargs="+", default=[16, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--out", default=None, help="replace this run's block in this markdown file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    config = {"device": device_name(device), "models": args.models, "w_max": args.w_max,
              "repeats": args.repeats, "samples": args.samples, "tp": 1, "layout": "ragged"}
    record = start_run("bench_codec", config, argv, "cuda" if device.type == "cuda" else "cpu")
    rows = [r for m in args.models for r in bench_model(m, args.w_max, device, args.repeats, args.samples)]
    md = (f"On {device_name(device)}; each figure the median over {args.repeats} repeats of the median of "
          f"{args.samples} synchronised calls:\n\n")
    md += table(
        ["model", "codec", "W_max", "quant", "ops", "MiB/slot", "compression", "store ms", "load ms",
         "store / dense", "load / dense"],
        [[r["model"], r["codec"], int(r["w_max"]), r["quant"], r["ops"], r["bytes_per_slot"] / 2**20,
          r["compression"], r["store_ms"], r["load_ms"], r["store_vs_dense"], r["load_vs_dense"]] for r in rows])
    publish(record, "default", {"rows": rows}, md, args.out, "Checkpoint store and load at production shapes")


if __name__ == "__main__":
    main()
