"""bench_peer's `--starts-only` mode: how long our servers take to start with a cold and with a warm compile cache.

Eager: ours-local with both compile knobs off, the start a compiled one is measured against. Cold: ours-local on
a new, empty compile cache directory (a private temporary directory), so that every decode
package and prefill core compiles (in the background, while it serves eagerly); then warm: ours-local again on that
same directory, now full. Each is timed from launch to the first /health 200 and to every compiled package in
force, and /status reports what the engine compiled and loaded. The ours-ray arm
(one replica) is timed on the default cache, which the cold start above does not touch: its start is warm when
an earlier run (any bench_peer run, `make serve`) filled it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx

from loadtest.peer import servers
from loadtest.serve_harness import free_port

COLD_TIMEOUT_S = 1800.0  # a cold start compiles every package: minutes on two cores


def time_starts(model: str, arms: list[str], logdir: Path, say=print) -> dict:
    """{"eager"|"cold"|"warm"|"ray": {...}}: start seconds and the engine's compile report of each start."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="dasc-cold-cache-") as cache:
        for label in ("eager", "cold", "warm"):
            knobs = ({"compile_decode": False, "compile_prefill": False} if label == "eager"
                     else {"compile_cache_dir": cache})
            server = servers.start("ours-local", model, free_port(), logdir, local_engine=knobs,
                                   timeout=COLD_TIMEOUT_S)
            try:
                out[label] = {"start_s": server.start_s, "compiled_s": server.compiled_s,
                              **_compile_report(server.url)}
            finally:
                server.stop()
            say(f"{model} ours-local {label} cache: up in {out[label]['start_s']:.1f} s, {out[label]}")
    if "ours-ray" in arms:
        server = servers.start("ours-ray", model, free_port(), logdir, timeout=COLD_TIMEOUT_S)
        try:
            out["ray"] = {"start_s": server.start_s, "compiled_s": server.compiled_s}
        finally:
            server.stop()
        say(f"{model} ours-ray (default cache): up in {out['ray']['start_s']:.1f} s")
    return out


def _compile_report(url: str) -> dict:
    snap = next(iter(httpx.get(f"{url}/status", timeout=30).json()["replicas"].values()))
    decode, prefill = snap.get("decode_graphs") or {}, snap.get("compiled_prefill") or {}
    keys = ("packages_loaded", "packages_compiled", "load_s", "compile_s")
    return {k: decode.get(k, 0) + prefill.get(k, 0) for k in keys}


def markdown(res: dict) -> str:
    def row(label: str, r: dict) -> str:
        compiled = "-" if r.get("compiled_s") is None else f"{r['compiled_s']:.1f}"
        if "compile_s" not in r:
            return f"| {label} | {r['start_s']:.1f} | {compiled} | - | - | - |"
        return (f"| {label} | {r['start_s']:.1f} | {compiled} | {r['packages_compiled']} | {r['packages_loaded']} | "
                f"{r['compile_s']:.1f} |")

    rows = [row(label, r) for label, r in (
        *((("ours-local, eager (compile knobs off)", res["eager"]),) if "eager" in res else ()),
        ("ours-local, cold cache", res["cold"]), ("ours-local, warm cache", res["warm"]),
        *((("ours-ray (1 replica), default cache", res["ray"]),) if "ray" in res else ()))]
    return ("Start time, launch to the first /health 200 (serving) and to every compiled package in force (a cold "
            "cache builds them in the background meanwhile), and what the engine compiled (decode packages and "
            "prefill cores together):\n\n| start | serving s | every package in force s | packages compiled | "
            "packages loaded | compile s |\n|---|---|---|---|---|---|\n" + "\n".join(rows))
