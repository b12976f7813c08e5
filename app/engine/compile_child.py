"""The compile child: builds the compiled packages a worker's cache lacks, one at a time, below every serving process.

    python -m app.engine.compile_child SPEC

app/engine/compile_jobs.py starts it with SPEC, a JSON file in a private work directory of the package cache:

    {"cache_dir", "cache_mb", "threads", "parent": pid,
     "model": {"class", "config", "dtype", "weights"} or null,       (decode jobs need it)
     "jobs": [{"key", "kind": "decode", "batch"} | {"key", "kind": "prefill", "core", "n"}, ...]}

Each job is built into the cache under its key (`ArtifactCache.get_or_build`: a package another process built
meanwhile is taken as it is) and reported on stdout as one JSON line, `{"key", "built", "seconds"}` or
`{"key", "error"}` (then the child stops: a machine that cannot build one package builds none). Before building
anything it computes every key again from what it loaded and refuses a job whose key differs: a package is only
ever filed under the key of what it was built from.

It runs under SCHED_IDLE (a core's idle time only; nice 19 where that is refused), as do the C++ compilers it
starts, and exits when its parent does. It has a process of its own, not a thread of the server's, because
Inductor holds the interpreter lock for most of a compile and exporting swaps a module's parameters while it
traces.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

CONVENTIONS = {"state_rows": 7, "kv_rows": 97}  # example storage sizes for the export: distinct, not powers of two


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    report = _report_channel()
    _yield_cpu()
    _exit_with_parent(spec["parent"])
    import torch

    from app.engine.aot import ArtifactCache, artifact_key, package_key, weights_digest

    torch.set_num_threads(spec["threads"])
    cache = ArtifactCache(spec["cache_dir"], spec["cache_mb"])
    model = digest = None
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        try:
            if job["kind"] == "decode":
                if model is None:
                    model = _load_model(spec["model"])
                    digest = weights_digest(model)
                from app.engine.graphs import CPU_OPTIONS

                key, build = artifact_key(model, job["batch"], CPU_OPTIONS, digest), _decode_build(model, job["batch"])
            else:
                from app.engine.prefill import OPTIONS, core_name

                core = tuple(job["core"])
                key, build = package_key(core_name(core, job["n"]), core, OPTIONS), _core_build(core, job["n"])
            if key != job["key"]:
                raise RuntimeError(f"the package built here would be {key}, not {job['key']}: the compile process "
                                   "sees another model, machine or source than its server")
            with cache.compiling():
                _, built = cache.get_or_build(key, build)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which names the setting
            traceback.print_exc()  # to the compile log; the parent logs its end
            first = (str(e).strip().splitlines() or [""])[0]
            report({"key": job["key"], "error": f"{type(e).__name__}: {first[:500]}"})
            return 1
        report({"key": key, "built": built, "seconds": round(time.perf_counter() - t0, 3)})
    return 0


def _decode_build(model, batch: int):
    """`build(out)` for the decode step of `batch` rows: exported on small storages of the model's shapes (their
    row counts are symbolic in the package), after one eager step (it makes the stacked weights the trace bakes in)."""
    import torch

    from app.cache.pools import KVStorage, StateStorage
    from app.engine.aot import build_package
    from app.engine.decode_inputs import DecodeInputs
    from app.engine.graphs import CPU_OPTIONS, MIN_HISTORY, cpu_gemm_settings, decode_step
    from app.engine.worker import kv_widths

    cpu = torch.device("cpu")
    rows, slots = CONVENTIONS["state_rows"], CONVENTIONS["kv_rows"]
    kv = KVStorage(kv_widths(model), slots, model.model.embed_tokens.weight.dtype, cpu)
    states = StateStorage(model.empty_states(1), rows)
    with torch.no_grad():
        decode_step(model, kv, states, DecodeInputs(1, MIN_HISTORY, slots - 1, rows - 1, cpu))
    inputs = DecodeInputs(batch, MIN_HISTORY, slots - 1, rows - 1, cpu)

    def build(out):
        with cpu_gemm_settings(True):
            build_package(model, kv, states, inputs, decode_step, CPU_OPTIONS, out)

    return build


def _core_build(core: tuple, n: int):
    from app.engine.prefill import build_core

    return lambda out: build_core(core, n, out)


def _load_model(spec: dict):
    """The server's model, rebuilt: its class on its config, cast as the server cast it, the weights it wrote."""
    import torch
    from safetensors.torch import load_model

    from app.models.loader import cast_model

    module, _, name = spec["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    config_cls = getattr(importlib.import_module(spec["config_class"].rpartition(".")[0]),
                         spec["config_class"].rpartition(".")[2])
    model = cast_model(cls(config_cls(**decode_config(spec["config"]))), getattr(torch, spec["dtype"]))
    load_model(model, spec["weights"])
    return model.eval()


def encode_config(config) -> dict:
    """A frozen config dataclass as JSON that `decode_config` turns back into equal fields (tuples kept)."""
    def enc(v):
        if isinstance(v, tuple):
            return {"__tuple__": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {"__dict__": [[enc(k), enc(x)] for k, x in v.items()]}
        return v

    return {f.name: enc(getattr(config, f.name)) for f in dataclasses.fields(config)}


def decode_config(d: dict) -> dict:
    def dec(v):
        if isinstance(v, dict) and "__tuple__" in v:
            return tuple(dec(x) for x in v["__tuple__"])
        if isinstance(v, dict) and "__dict__" in v:
            return {dec(k): dec(x) for k, x in v["__dict__"]}
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    return {k: dec(v) for k, v in d.items()}


def _report_channel():
    """Reports go to the real stdout; everything else written to it (Inductor, compilers) goes to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def report(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    return report


def _yield_cpu() -> None:
    """SCHED_IDLE for this process and all it starts, else the highest nice value."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19)
    except OSError:
        pass


def _exit_with_parent(parent: int) -> None:
    """End this process (and its compilers: they share its process group) once the server that started it is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, 9) if os.getpgid(0) == os.getpid() else os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
