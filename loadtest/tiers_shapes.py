"""bench_tiers' shapes section (`python -m loadtest.bench_tiers --section shapes`, issue 40): what a peer fetch moves
and when it beats recomputing, at the shapes of Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B. Nothing is timed: every
figure is computed, from the plan tool's reading of config.json and the decay tensors of the generated stand-in
checkpoints (loadtest/fake_checkpoints.py: the real config, names and shapes; decays drawn to the paper's profile)
and from the model built on the meta device (no weights).

Bytes per entry at a prefix of n tokens = the recurrent state as the cache stores it at TP 1 (ragged fp32 units,
or INT8 units + fp32 scales, plus BF16 conv windows; dense is W_max 0) + n x the KV bytes per token of every
attention layer in BF16 (MLA: the 512-wide latent + 64-wide rope key; GQA: keys and values of the KV heads).

Recompute seconds = prefill FLOPs / (MFU x peak), with prefill FLOPs for n tokens
    n x (2 x active parameters + recurrent chunk math) + (4 x score width per attention layer) x n^2 / 2
where active parameters leave out the embedding and lm_head and count routed experts at top-k / experts; the
recurrent chunk math (chunked delta rule, chunk C) is per layer and token H x (6 K V + 2 C (K + V) + 2 C K).
Fetch seconds = a fixed cost (control round trip, the holder's wait for its step in flight) + bytes / bandwidth.
The break-even prefix is the shortest n at which a fetch is faster (fetch - recompute is concave in n and positive
at 0, so there is one crossing). With TP ranks each moving its own shard over its own link, bytes per link and
FLOPs per GPU both divide by TP: the break-even is the same to first order.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch

from app.dasc import plan as plan_tool
from app.engine.worker import kv_widths
from app.models.loader import build_model, read_config
from loadtest import fake_checkpoints
from loadtest.common import table

MODELS = {"Kimi-Linear-48B-A3B": fake_checkpoints.write_kimi_linear_48b,
          "Qwen3-Next-80B-A3B": fake_checkpoints.write_qwen3_next_80b}
H200_BF16_FLOPS = 989e12  # dense BF16 tensor-core peak (H100 SXM and H200 alike)
LINKS = {"PCIe Gen5 x16": 55e9, "100 Gb/s": 12.5e9, "400 Gb/s": 50e9}  # bytes/s; PCIe at ~55 of its 64 GB/s
KV_ELEM_BYTES = 2  # BF16
CHUNK = 64
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class Shape:
    """One model's figures: state bytes per codec, KV bytes per token, prefill FLOPs per token and per pair."""

    name: str
    state_bytes: dict[str, int]  # codec -> bytes of one checkpoint's recurrent state (TP 1)
    retained: float  # dasc's retained fraction of state units at the W_max used
    kv_bytes_per_token: int
    flops_per_token: float  # 2 x active parameters + recurrent chunk math
    flops_per_pair: float  # all attention layers, per (query, key) pair

    def entry_bytes(self, codec: str, n: int) -> int:
        return self.state_bytes[codec] + n * self.kv_bytes_per_token

    def recompute_s(self, n: int, mfu: float, peak: float = H200_BF16_FLOPS) -> float:
        return (n * self.flops_per_token + self.flops_per_pair * n * n / 2) / (mfu * peak)

    def fetch_s(self, codec: str, n: int, bandwidth: float, fixed_s: float) -> float:
        return fixed_s + self.entry_bytes(codec, n) / bandwidth

    def break_even(self, codec: str, bandwidth: float, fixed_s: float, mfu: float, peak: float = H200_BF16_FLOPS,
                   limit: int = 1 << 20) -> int | None:
        """The shortest prefix (tokens) whose fetch is faster than its recompute; None beyond `limit`."""
        def wins(n: int) -> bool:
            return self.fetch_s(codec, n, bandwidth, fixed_s) < self.recompute_s(n, mfu, peak)

        if not wins(limit):
            return None
        lo, hi = 0, limit  # wins(lo) is false (n = 0 recomputes nothing), wins(hi) true
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if wins(mid) else (mid, hi)
        return hi


def read_shape(name: str, write, w_max: float) -> Shape:
    with tempfile.TemporaryDirectory() as d:
        write(d, ballast=False)
        ckpt = plan_tool.read_checkpoint(d)
        rep = plan_tool.plan_report(ckpt, [w_max], tp=1)
        config = read_config(d)
    dense, dasc = rep["dense"]["placements"]["off"], rep["rows"][0]["placements"]["off"]
    states = {"dense": dense["bottleneck_bytes"], f"dasc W{w_max:g}": dasc["bottleneck_bytes"],
              f"dasc W{w_max:g} INT8": dasc["int8_bottleneck_bytes"]}
    with torch.device("meta"):
        model = build_model(config)
    dense_params = routed = 0
    for pname, p in model.named_parameters():
        if "embed_tokens" in pname or "lm_head" in pname:
            continue
        if ".experts." in pname and "shared" not in pname:
            routed += p.numel()
        else:
            dense_params += p.numel()
    c = model.config
    top_k, experts = c.num_experts_per_tok, max(c.num_experts, 1)
    active = dense_params + routed * top_k / experts
    geo = ckpt.geometry[0]
    heads, dk, dv = geo.heads, geo.d_k, geo.d_v
    recurrent = len(ckpt.geometry) * heads * (6 * dk * dv + 2 * CHUNK * (dk + dv) + 2 * CHUNK * dk)
    pair = sum(4 * model.model.layers[i].mixer.score_dim for i in model.attention_layers)
    kv = sum(kv_widths(model).values()) * KV_ELEM_BYTES
    return Shape(name, states, rep["rows"][0]["retained_fraction"], kv, 2.0 * active + recurrent, float(pair))


def run(args) -> dict:
    shapes = [read_shape(name, write, args.shapes_w_max) for name, write in MODELS.items()]
    out = {"w_max": args.shapes_w_max, "mfu": args.mfu, "fixed_s": args.fixed_s, "links": LINKS,
           "peak_flops": H200_BF16_FLOPS, "lengths": list(LENGTHS), "models": {}}
    for s in shapes:
        m = {"state_bytes": s.state_bytes, "retained_fraction": s.retained, "kv_bytes_per_token": s.kv_bytes_per_token,
             "flops_per_token": s.flops_per_token, "flops_per_pair": s.flops_per_pair,
             "entry_bytes": {c: {n: s.entry_bytes(c, n) for n in LENGTHS} for c in s.state_bytes},
             "recompute_s": {mfu: {n: s.recompute_s(n, mfu) for n in LENGTHS} for mfu in args.mfu},
             "break_even": {f"{fixed}/{mfu}/{link}/{c}": s.break_even(c, bw, fixed, mfu)
                            for fixed in args.fixed_s for mfu in args.mfu for link, bw in LINKS.items()
                            for c in s.state_bytes}}
        out["models"][s.name] = m
    return out


def report(res: dict) -> str:
    mb = 1e6
    rows = []
    for name, m in res["models"].items():
        for codec, by_n in m["entry_bytes"].items():
            rows.append([name, codec, m["state_bytes"][codec] / mb]
                        + [by_n[n] / mb for n in res["lengths"]])
    lengths = [f"{n // 1024}k" for n in res["lengths"]]
    md = (f"Bytes per entry (MB = 10^6 B), state + BF16 KV, TP 1; dasc at W_max {res['w_max']:g} "
          + ", ".join(f"{name} keeps {m['retained_fraction']:.1%} of the state units"
                      for name, m in res["models"].items()) + ".\n\n")
    md += table(["model", "codec", "state MB"] + [f"{n} MB" for n in lengths], rows)
    md += "\n\nPrefill per token: " + "; ".join(
        f"{name}: {m['flops_per_token'] / 1e9:.2f} GFLOP + {m['flops_per_pair'] / 1e3:.1f} kFLOP per (query, key) "
        f"pair, KV {m['kv_bytes_per_token']:,} B" for name, m in res["models"].items()) + "."
    for fixed in res["fixed_s"]:
        for mfu in res["mfu"]:
            rows = []
            for name, m in res["models"].items():
                for codec in m["state_bytes"]:
                    rows.append([name, codec] + [_tokens(m["break_even"][f"{fixed}/{mfu}/{link}/{codec}"])
                                                 for link in res["links"]])
            md += (f"\n\nBreak-even prefix (tokens): the shortest prefix a fetch moves faster than one H200 recomputes "
                   f"it at {mfu:.0%} MFU ({mfu * res['peak_flops'] / 1e12:.0f} TFLOPS), fixed cost "
                   f"{fixed * 1e3:g} ms per fetch.\n\n")
            md += table(["model", "codec"] + [f"{link} ({bw / 1e9:g} GB/s)" for link, bw in res["links"].items()], rows)
    mfu, fixed = res["mfu"][0], res["fixed_s"][-1]
    rows = []
    for name, m in res["models"].items():
        for codec in m["state_bytes"]:
            rows.append([name, codec] + [
                (fixed + m["entry_bytes"][codec][n] / res["links"]["100 Gb/s"]) / m["recompute_s"][mfu][n]
                for n in res["lengths"]])
    md += (f"\n\nFetch time / recompute time over 100 Gb/s at {mfu:.0%} MFU, fixed cost {fixed * 1e3:g} ms "
           f"(below 1: the fetch wins).\n\n")
    md += table(["model", "codec"] + lengths, rows)
    return md + "\n"


def _tokens(n: int | None) -> str:
    return "never" if n is None else f"{n:,}"
