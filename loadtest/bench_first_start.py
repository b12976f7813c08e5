"""First start on a fresh machine: `python -m loadtest.bench_first_start [--out docs/benchmarks.md]` (about 25
minutes on 2 cores: most of it the compile the cold starts build in the background).

Each start runs as a new user's would, with HOME pointed at a new, empty directory (no compile cache), and TMPDIR
at a new directory of its own (to count what a start leaves there):
- ours-local: `python -m app.api.local --model kda-tiny` as shipped (compiled decode and prefill on). A completion
  is sent again and again from the launch on until one is answered 200 (time to the first answer, and every status
  seen before); then /status is polled until every compiled package is in force (time to full compiled speed).
  A 64-token greedy decode is timed at the first answer (eager) and again then (compiled). Then the server stops
  (SIGINT) and starts again on the same HOME (a warm cache): the same times.
- make serve: `serve run configs/config.yaml` as shipped (2 replicas, port moved to a free one), on another new
  HOME. /v1/models is polled from the launch on; as soon as it answers, a chat completion is sent (its status and
  time); then /status is polled until both replicas report every package in force.
Reported: seconds from launch for each of these, the packages built and loaded, the decode speeds, and the entries
left in TMPDIR after the starts and stops. Results: loadtest/results/bench_first_start_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from loadtest.common import REPO, start_run, table
from loadtest.peer.servers import BASE_CONFIG, Server
from loadtest.sections import publish
from loadtest.serve_harness import free_port

COMPLETION = {"model": "kda-tiny", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
DECODE = {"model": "kda-tiny", "prompt": "import os\n", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "kda-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def _launch(cmd: list[str], home: Path, tmp: Path, log: Path, extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), **(extra or {})}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _until(fn, timeout_s: float, poll_s: float = 0.1):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            out = fn()
        except httpx.HTTPError:
            out = None
        if out:
            return out
        time.sleep(poll_s)
    raise TimeoutError(f"not within {timeout_s:.0f} s")


def _compiled(url: str, replicas: int) -> dict | None:
    """Every replica's /status `compile` block once all `replicas` report it with nothing left to build."""
    snaps = httpx.get(f"{url}/status", timeout=30).json().get("replicas", {})
    blocks = [s.get("compile") for s in snaps.values()]
    if len(blocks) >= replicas and all(b and b["state"] != "building" for b in blocks):
        return {"state": [b["state"] for b in blocks], "packages": [b["packages"] for b in blocks],
                "in_force": [b["in_force"] for b in blocks],
                "built": [b.get("landed", 0) for b in blocks]}
    return None


def _decode_tok_s(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=DECODE, timeout=300)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t0)


def local_start(home: Path, tmp: Path, logdir: Path, label: str, timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = _launch([sys.executable, "-m", "app.api.local", "--model", "kda-tiny", "--port", str(port)], home, tmp,
                   logdir / f"local-{label}.log")
    seen: dict[str, int] = {}

    def answered():
        try:
            r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60)
        except httpx.ConnectError:
            seen["refused"] = seen.get("refused", 0) + 1  # not listening yet
            return None
        seen[str(r.status_code)] = seen.get(str(r.status_code), 0) + 1
        return r.status_code == 200

    try:
        _until(answered, timeout_s)
        first = time.monotonic() - t0
        eager = _decode_tok_s(url)
        done = _until(lambda: _compiled(url, 1), timeout_s, 1.0)
        compiled_s = time.monotonic() - t0
        fast = _decode_tok_s(url)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    return {"first_answer_s": first, "compiled_s": compiled_s, "statuses_before": seen, "compile": done,
            "decode_tok_s_at_first_answer": eager, "decode_tok_s_compiled": fast, "exit": rc}


def serve_start(home: Path, tmp: Path, logdir: Path, timeout_s: float) -> dict:
    port = free_port(outside_ephemeral=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="dfs-", dir="/tmp"))  # short: Ray's socket paths must stay < 108
    cfg = yaml.safe_load(Path(BASE_CONFIG).read_text())
    cfg["http_options"] = {**cfg["http_options"], "port": port}
    config = ray_tmp / "serve.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = _launch([str(Path(sys.executable).with_name("serve")), "run", "--address", "local", str(config)], home, tmp,
                   logdir / "serve.log", {"RAY_TMPDIR": str(ray_tmp), "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                                          "RAY_USAGE_STATS_ENABLED": "0"})
    server = Server("ours-ray", url, proc, 0.0, logdir / "serve.log", ray_tmp)
    try:
        _until(lambda: httpx.get(f"{url}/v1/models", timeout=10).status_code == 200, timeout_s, 0.05)
        models = time.monotonic() - t0
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=300)
        chat = time.monotonic() - t0
        done = _until(lambda: _compiled(url, 2), timeout_s, 1.0)
        compiled_s = time.monotonic() - t0
    finally:
        server.stop()
    return {"models_s": models, "chat_status": r.status_code, "chat_answered_s": chat, "compiled_s": compiled_s,
            "compile": done, "chat_error": None if r.status_code == 200 else r.text[:300]}


def report(res: dict) -> str:
    cold, warm, ray = res["local cold"], res["local warm"], res["serve"]
    rows = [[f"app.api.local, {k}", r["first_answer_s"], r["compiled_s"], sum(r["compile"]["built"]),  # (1 replica)
             r["compile"]["packages"][0], r["decode_tok_s_at_first_answer"], r["decode_tok_s_compiled"]]
            for k, r in (("empty cache", cold), ("warm cache", warm))]
    md = table(["start", "first answer s", "every package in force s", "built", "packages", "decode tok/s at first "
                "answer", "decode tok/s compiled"], rows)
    md += (f"\n\nBefore its first 200 the cold local server answered: {cold['statuses_before']} (refused: not "
           f"listening yet).\n\n`make serve` (`serve run configs/config.yaml`, 2 replicas) on an empty cache: "
           f"/v1/models answered {ray['models_s']:.1f} s after the launch; a chat completion sent then was answered "
           f"{ray['chat_status']} at {ray['chat_answered_s']:.1f} s; both replicas had every package in force at "
           f"{ray['compiled_s']:.0f} s ({ray['compile']['packages'][0]} packages each; landed from the background "
           f"build, by it or by the other replica's: {ray['compile']['built']}).\n\nEntries left in TMPDIR by the two "
           f"local starts and stops: {res['tmp_left_local']}; by the serve run: {res['tmp_left_serve']} (a `pymp-*` "
           "directory is Ray's: `serve run` leaves one with compiled packages off too).\n")
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_first_start", {"timeout": args.timeout}, argv)
    res = {}
    with tempfile.TemporaryDirectory(prefix="dasc-first-") as d:
        d = Path(d)
        for name in ("home-local", "home-serve", "tmp-local", "tmp-serve", "logs"):
            (d / name).mkdir()
        res["local cold"] = local_start(d / "home-local", d / "tmp-local", d / "logs", "cold", args.timeout)
        print("local cold", res["local cold"], flush=True)
        res["local warm"] = local_start(d / "home-local", d / "tmp-local", d / "logs", "warm", args.timeout)
        print("local warm", res["local warm"], flush=True)
        res["tmp_left_local"] = sorted(os.listdir(d / "tmp-local"))
        res["serve"] = serve_start(d / "home-serve", d / "tmp-serve", d / "logs", args.timeout)
        print("serve", res["serve"], flush=True)
        res["tmp_left_serve"] = sorted(os.listdir(d / "tmp-serve"))
    publish(record, "kda-tiny", res, report(res), args.out, "First start on a fresh machine")


if __name__ == "__main__":
    main()
