"""TP benchmark: `python -m loadtest.bench_tp [--out docs/benchmarks.md]`.

At TP=2 on this machine (gloo, one process per rank), for kda-tiny and each placement (off, storage,
balanced) at a few W_max: checkpoint store and load time (median over repeats, through the TP group, so
stage 2's all_to_all is included), units and bytes moved per rank on store, bytes per slot on the bottleneck
rank and slots in a budget of 128 dense slots. Beside them, the plan tool's TP=8 figures for Kimi-Linear-48B
shapes (a generated checkpoint with the real key names and shapes).
Results: loadtest/results/bench_tp_cpu.json, variant the model; --out DOC replaces that variant's block in DOC
(loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import redirect_stdout
from io import StringIO

from app.cache.checkpoint import DenseCodec
from app.dasc import plan as plan_tool
from app.dasc.layout import slots_for_budget
from app.dasc.placement import traffic_bytes
from app.engine.config import EngineConfig
from app.engine.tp import build_engine
from app.models.loader import load_model
from loadtest import fake_checkpoints
from loadtest.common import start_run, table
from loadtest.sections import publish


def time_store_load(engine, repeats: int) -> tuple[float, float]:
    w = engine.worker
    w.zero(0)
    stores, loads = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        w.store(0, 1)
        t1 = time.perf_counter()
        w.load(1, 0)
        t2 = time.perf_counter()
        stores.append(t1 - t0)
        loads.append(t2 - t1)
    return statistics.median(stores), statistics.median(loads)


def tiny_rows(model: str, w_maxes, repeats: int) -> list[dict]:
    full = load_model(model)
    dense_bytes = DenseCodec(full.empty_states(1)).bytes_per_slot  # whole model, one rank
    budget = 128 * dense_bytes // 2  # per rank: 128 dense slots at TP=2
    rows = []
    for w in w_maxes:
        for placement in ("off", "storage", "balanced"):
            engine = build_engine(model, EngineConfig(w_max=w, checkpoint_slots=4, max_running=2, kv_slots=1024), 2,
                                  placement)
            try:
                store_s, load_s = time_store_load(engine, repeats)
                codec = engine.codec
                p = codec.placement
                unit_bytes = codec.unit_elems * 4
                traffic = traffic_bytes(p, unit_bytes)
                rows.append({"model": model, "w_max": w, "placement": placement, "store_ms": store_s * 1e3,
                             "load_ms": load_s * 1e3, "units_per_rank": list(p.local_units), "width": p.width,
                             "moved_units": p.units_moved(), "sent_bytes": list(traffic.sent),
                             "bytes_per_slot": codec.bytes_per_slot,
                             "slots": slots_for_budget(budget, codec.bytes_per_slot)})
            finally:
                engine.tp_group.close()
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kimi_tp8(w_maxes) -> tuple[dict, str]:
    """The plan tool on a generated Kimi-Linear-48B checkpoint at TP=8: (JSON figures, printed table)."""
    with tempfile.TemporaryDirectory() as d:
        fake_checkpoints.main(["kimi-linear-48b-a3b", d, "--no-ballast"])
        args = [d, "--w-max", *map(str, w_maxes), "--tp", "8", "--budget-bytes", "694681600"]
        outs = []
        for extra in (["--json"], []):
            buf = StringIO()
            with redirect_stdout(buf):
                plan_tool.main(args + extra)
            outs.append(buf.getvalue())
        return json.loads(outs[0]), outs[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--w-max", type=float, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_tp", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    rows = tiny_rows(args.model, args.w_max, args.repeats)
    kimi, kimi_text = kimi_tp8([16, 64, 128, 512])
    md = f"TP=2 over gloo, {args.model}, median of {args.repeats} stores and loads:\n\n"
    md += table(["W_max", "placement", "units per rank", "slot width", "moved units", "sent bytes/rank",
                 "store ms", "load ms", "bytes/slot (bottleneck)", "slots"],
                [[r["w_max"], r["placement"], r["units_per_rank"], r["width"], r["moved_units"],
                  r["sent_bytes"], r["store_ms"], r["load_ms"], r["bytes_per_slot"], r["slots"]] for r in rows])
    md += "\n\nKimi-Linear-48B shapes (generated checkpoint), TP=8, plan tool:\n\n"
    md += "```\n" + kimi_text.strip() + "\n```\n"
    publish(record, args.model, {"rows": rows, "kimi_tp8": kimi}, md, args.out, "TP checkpoint placement")


if __name__ == "__main__":
    main()
