"""Ahead-of-time compiled decode steps on the CPU (`EngineConfig.compile_decode`): one AOTInductor package per
batch bucket, kept in an on-disk cache so that a server compiles a bucket once per machine, not once per start.

A package is the padded decode step of app/engine/graphs.py (`decode_step`), exported with `torch.export` and
compiled by Inductor into a shared object with the model's weights frozen in (packed for the machine's GEMM
micro-kernels). The KV history length and the sizes of the KV and state storages are symbolic, so one package
of a batch bucket serves every history bucket and any `kv_slots` or `max_running`. The step mutates its inputs
in place (KV entries, states), as the eager step does.

The cache key names everything a package depends on: the weights (a hash of every tensor), the model config,
dtype, batch bucket, torch and Python versions, the CPU (model, vendor, flags: these VMs alternate between AMD
and Intel CPUs, and code built for one may not run on the other), the thread count the
kernels were built for, the compile options, and the source of the code the step traces. A package built from
anything else is never found.

Loading a package runs the code in its shared object, so the cache directory must belong to the server's user
and be closed to everyone else (mode 0700; packages 0600): `ArtifactCache` refuses any other directory and any
package file not owned by the user or open to others. Writes are atomic (a temporary file renamed), a lock file
per key makes replicas that start together compile each package once, a lock of the whole cache makes them
compile one package at a time, and the cache is held under a size cap by dropping the least recently used
packages. Packages are built by a child process (app/engine/compile_jobs.py), never by a serving process.

Nothing is left in the temporary directory: torch extracts a package into a new `aotinductor_*` directory of
`TMPDIR` when it loads it and removes it only when the loaded package is freed, which a server never does before
it exits. `ArtifactCache.load` has it extract into a scratch directory of the cache and removes that as soon as the
package is loaded (the shared object stays mapped). Inductor's own cache (its CPU probe, `torchinductor_<user>`)
goes to the cache's `.inductor` directory, unless `TORCHINDUCTOR_CACHE_DIR` names another.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from app.cache.pools import KVStorage, StateStorage
from app.models.hybrid import HybridForCausalLM

DEFAULT_DIR = Path.home() / ".cache" / "dasc-serve" / "compiled"
SUFFIX = ".pt2"
# the code a decode step traces: a change to any of it makes new keys
_TRACED = ("app/models", "app/ops", "app/engine/graphs.py", "app/engine/aot.py", "app/cache/pools.py")
_UNTRACED = frozenset({"app/models/tokenizer.py"})  # inside a traced folder, but no step runs it
_ROOT = Path(__file__).resolve().parents[2]


class ArtifactCache:
    """Packages by key in a private directory, under a byte cap (least recently used dropped first)."""

    def __init__(self, root: str | Path | None, max_mb: float) -> None:
        self.root = Path(root).expanduser() if root else DEFAULT_DIR
        self.max_bytes = int(max_mb * 2**20)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(self.root, directory=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.root / ".inductor"))
        _remove_stale(self.root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def find(self, key: str) -> Path | None:
        """The package of `key` if the cache holds it (marked recently used), without waiting for a build under
        way: a start loads what is there and leaves the rest to the background (app/engine/compile_jobs.py)."""
        path = self.path(key)
        if not path.exists():
            return None
        _check_private(path)
        os.utime(path)
        return path

    def load(self, path: Path):
        """Load a package (`torch._inductor.aoti_load_package`), leaving no file behind: torch extracts it into
        `TMPDIR`, here a scratch directory of the cache removed once it is loaded. Loads run one at a time in a
        process; while one runs, this process's `TMPDIR` names the scratch directory."""
        with _LOADING, self.scratch("load") as scratch:
            tempfile.gettempdir()  # Python's own choice of directory is made (and kept) outside the scratch one
            old = os.environ.get("TMPDIR")
            os.environ["TMPDIR"] = str(scratch)
            try:
                return torch._inductor.aoti_load_package(str(path))
            finally:
                if old is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = old

    @contextlib.contextmanager
    def scratch(self, kind: str):
        """A private directory `.<kind>-<pid>-*` of the cache, removed on leaving (a process killed meanwhile leaves
        it to the next cache opened on this directory: `_remove_stale`)."""
        path = Path(tempfile.mkdtemp(prefix=f".{kind}-{os.getpid()}-", dir=self.root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    @contextlib.contextmanager
    def compiling(self):
        """Held while a package compiles: one compile at a time on this cache, whichever process runs it."""
        with open(self.root / ".compile.lock", "a+") as lock:
            os.chmod(lock.name, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def get_or_build(self, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        """(the package of `key`, whether it was built now). `build(tmp)` writes a new package to `tmp`; it
        runs holding the key's lock, so a second process asking for the same key waits and then finds it."""
        path = self.path(key)
        with open(self._lock_path(key), "a+") as lock:
            os.chmod(lock.name, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                _check_private(path)
                os.utime(path)  # recently used
                return path, False
            tmp = path.with_name(f".{key}.{os.getpid()}.tmp{SUFFIX}")
            try:
                build(tmp)
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        self.trim(keep=path)
        return path, True

    def trim(self, keep: Path | None = None) -> list[Path]:
        """Drop the least recently used packages (never `keep`) until the cache fits its cap; returns them."""
        entries = sorted((p for p in self.root.glob(f"*{SUFFIX}") if p != keep and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries) + (keep.stat().st_size if keep else 0)
        dropped = []
        for p in entries:
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            self._lock_path(p.name[: -len(SUFFIX)]).unlink(missing_ok=True)
            dropped.append(p)
        return dropped

    def _lock_path(self, key: str) -> Path:
        return self.root / f".{key}.lock"


_LOADING = threading.Lock()


def _remove_stale(root: Path) -> None:
    """Scratch directories (`.load-PID-*`, `.work-PID-*`) of processes no longer alive: killed mid-load or
    mid-compile."""
    for path in root.glob(".*-*-*"):
        kind, _, rest = path.name[1:].partition("-")
        pid = rest.partition("-")[0]
        if kind in ("load", "work") and pid.isdigit() and path.is_dir() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_private(path: Path, directory: bool = False) -> None:
    """Raise PermissionError unless `path` belongs to this user and no one else may write (or, for the
    directory, enter) it: a package is code the server runs."""
    st = path.lstat()
    mask = 0o077 if directory else 0o022
    if st.st_uid != os.getuid() or st.st_mode & mask or (directory and not path.is_dir()):
        raise PermissionError(
            f"compile_cache_dir: {path} must be a {'directory' if directory else 'file'} owned by this user "
            f"(uid {os.getuid()}) {'with mode 0700' if directory else 'and writable by no one else'}; it is "
            f"owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}. Compiled packages are code the server "
            "loads: fix the owner and mode, or set compile_cache_dir to a private directory")


def artifact_key(model: HybridForCausalLM, batch: int, options: dict, digest: str | None = None) -> str:
    """The cache key of `model`'s decode step for `batch` rows, compiled with `options` on this machine (`digest`:
    `weights_digest(model)`, if already computed)."""
    parts = (digest or weights_digest(model), repr(model.config), str(model.model.embed_tokens.weight.dtype))
    return package_key(f"decode-b{batch}", parts, options)


def package_key(name: str, parts: tuple, options: dict) -> str:
    """`name` and a hash of `parts` (what the package was built from) and of this machine and software: torch and
    Python versions, the CPU, the thread count its kernels were built for, `options` and the traced source."""
    h = hashlib.sha256()
    for part in (name, *parts, torch.__version__, platform.python_version(), machine_digest(), torch.get_num_threads(),
                 sorted(options.items()), source_digest()):
        h.update(repr(part).encode())
        h.update(b"\0")
    return f"{name}-{h.hexdigest()[:32]}"


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def machine_digest() -> str:
    """The CPU: its architecture, model name, vendor and flags (from /proc/cpuinfo; computed once per process). The
    flags decide which vector code runs here: Inductor picks its ISA from them (and from what the compiler takes), so
    a package built for them runs on any CPU that has them. Inductor's own probe of the ISA is not asked: on a fresh
    machine it compiles test programs for seconds, and a start only loads."""
    global _MACHINE
    if _MACHINE is None:
        info = {}
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "vendor_id") and key not in info:
                    info[key] = value.strip()
        except OSError:
            pass
        _MACHINE = f"{platform.machine()}|{info}"
    return _MACHINE


_MACHINE: str | None = None
_SOURCE: str | None = None


def source_digest() -> str:
    """sha256 of the source files a decode step traces (computed once per process)."""
    global _SOURCE
    if _SOURCE is None:
        h = hashlib.sha256()
        for rel in _TRACED:
            p = _ROOT / rel
            for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
                if str(f.relative_to(_ROOT)) in _UNTRACED:
                    continue
                h.update(str(f.relative_to(_ROOT)).encode())
                h.update(f.read_bytes())
        _SOURCE = h.hexdigest()
    return _SOURCE


class _StepModule(nn.Module):
    """The decode step as a module whose inputs are all tensors: what `torch.export` takes. The storages are
    inputs (mutated in place), not buffers, so a package holds only the weights."""

    def __init__(self, model: HybridForCausalLM, kv_layers: list[int], step) -> None:
        super().__init__()
        self.model, self.kv_layers, self.step = model, kv_layers, step

    def forward(self, head, kv_read, kv: list[torch.Tensor], conv: list[torch.Tensor], ssm: list[torch.Tensor]):
        return self.step(self.model, _kv_view(self.kv_layers, kv, head.device), _state_view(conv, ssm, head.device),
                         SimpleNamespace(head=head, kv_read=kv_read))


def _kv_view(layers: list[int], tensors: list[torch.Tensor], device) -> KVStorage:
    kv = KVStorage.__new__(KVStorage)
    kv.device, kv.storage = device, dict(zip(layers, tensors))
    return kv


def _state_view(conv: list[torch.Tensor], ssm: list[torch.Tensor], device) -> StateStorage:
    states = StateStorage.__new__(StateStorage)
    states.conv, states.ssm, states.device = list(conv), list(ssm), device
    return states


class Package:
    """A loaded package (`ArtifactCache.load`), called with its flat inputs (what its pytree wrapper would build on
    every call: the tensors of the exported arguments, in order); returns its outputs as a tuple."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self._run = runner.loader.boxed_run

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        return tuple(self._run(list(tensors)))


class AotStep:
    """One batch bucket's loaded package, called like `decode_step(model, kv, states, inputs)`."""

    def __init__(self, runner, kv: KVStorage, states: StateStorage) -> None:
        self.runner = runner
        self._run = runner.loader.boxed_run
        self._storages = [*kv.storage.values(), *states.conv, *states.ssm]

    def __call__(self, model, kv, states, inputs) -> torch.Tensor:
        # the package's flat calling convention (what its pytree wrapper would build on every call): head,
        # kv_read, then the storages in order; two outputs, the logits and their argmax
        logits, ids = self._run([inputs.head, inputs.kv_read, *self._storages])
        return logits, ids


def export_step(model: HybridForCausalLM, kv: KVStorage, states: StateStorage, inputs,
                step) -> torch.export.ExportedProgram:
    """`step` on a bucket's `inputs`, exported with the history length and the storages' slot counts symbolic."""
    history = torch.export.Dim("history", min=2, max=1 << 20)
    kv_rows = torch.export.Dim("kv_rows", min=2, max=1 << 30)
    state_rows = torch.export.Dim("state_rows", min=2, max=1 << 20)
    layers = list(kv.storage)
    args = (inputs.head, inputs.kv_read, [kv.storage[i] for i in layers], states.conv, states.ssm)
    dynamic = ({}, {1: history}, [{0: kv_rows}] * len(layers), [{0: state_rows}] * len(states.conv),
               [{0: state_rows}] * len(states.ssm))
    with torch.no_grad():
        return torch.export.export(_StepModule(model, layers, step), args, dynamic_shapes=dynamic, strict=False)


def build_package(model, kv, states, inputs, step, options: dict, out: Path) -> None:
    """Export and compile one bucket's step into the package file `out`."""
    program = export_step(model, kv, states, inputs, step)
    # a copy: the call adds its own keys to the dict it gets (and `options` is part of the cache key)
    torch._inductor.aoti_compile_and_package(program, package_path=str(out), inductor_configs=dict(options))


class CompileReport:
    """What a start spent on compiled packages of one kind: loaded from the cache and built anew, and seconds."""

    def __init__(self) -> None:
        self.loaded, self.compiled, self.load_s, self.compile_s = 0, 0, 0.0, 0.0

    def add(self, built: bool, seconds: float) -> None:
        if built:
            self.compiled += 1
            self.compile_s += seconds
        else:
            self.loaded += 1
            self.load_s += seconds

    def stats(self) -> dict:
        return {"packages_loaded": self.loaded, "packages_compiled": self.compiled,
                "load_s": round(self.load_s, 3), "compile_s": round(self.compile_s, 3)}
