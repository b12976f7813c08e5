"""The CPU's compiled packages of one worker (`compile_decode`, `compile_prefill`): which are in force, and how the
rest get there.

At start every package the worker can use is named by its cache key (app/engine/aot.py): one decode step per batch
bucket, one chunked-pass core per geometry and chunk count (app/engine/prefill.py). Those the cache holds are
loaded at once (milliseconds each). The rest are built by a compile child in the background
(app/engine/compile_jobs.py), decode bucket 1 first (a first user sends one request), then the prefill cores, then
the larger decode buckets; until a package is in, its steps run eagerly, the same computation. `install` loads
what has landed and puts it in force; the worker calls it between steps, and an idle step loop is woken for it
(`set_wake`). With `compile_background` off, the start waits for every package instead, and a failure to build
one fails it, naming the setting.

`stats` is what /status shows under `compile`: the state (building, ready, failed), packages in force of all,
what is left, what failed.
"""

from __future__ import annotations

import logging
import time

from app.engine.aot import AotStep, ArtifactCache, CompileReport, Package, artifact_key, package_key, weights_digest
from app.engine.compile_jobs import BackgroundCompiles, Job, Landed
from app.engine.config import EngineConfig
from app.engine.graphs import CPU_OPTIONS, DecodeGraphs
from app.engine.prefill import OPTIONS, PackagedCore, chunk_counts, core_name, geometries
from app.models.hybrid import HybridForCausalLM

log = logging.getLogger("app.engine.compile")
SETTING = {"decode": ("compile_decode", "the decode step"), "prefill": ("compile_prefill", "the chunked pass")}


class CompiledPackages:
    def __init__(self, model: HybridForCausalLM, cfg: EngineConfig, graphs: DecodeGraphs | None) -> None:
        """`graphs`: the worker's decode steps, where compiled decode packages go (None: no compiled decode);
        prefill cores when `cfg.compile_prefill`. Raises PermissionError for a cache directory that is not
        private, and (`compile_background` off) RuntimeError when a package cannot be built."""
        self.cache = ArtifactCache(cfg.compile_cache_dir, cfg.compile_cache_mb)
        self.graphs = graphs
        self.cores: dict[tuple, dict[int, PackagedCore]] = {}  # what `app.ops.chunk.compiled_cores` takes
        self.prefill_report = CompileReport() if cfg.compile_prefill else None
        self.jobs = _jobs(model, cfg, graphs, self.cores)
        self._in_force: set[str] = set()
        self.compiles: BackgroundCompiles | None = None
        missing = []
        for job in self.jobs:
            path = self.cache.find(job.key)
            if path is None or not self._try_install(Landed(job, path, False, 0.0)):
                missing.append(job)
        if missing:
            self.compiles = BackgroundCompiles(missing, self.cache, model)
            if not cfg.compile_background:
                self.compiles.wait()
                self.install()
                if self.compiles.error is not None:
                    raise _compile_error(self.compiles)

    def set_wake(self, wake) -> None:
        """Call `wake()` whenever a package lands (a step loop idle in its wait comes round to `install` it)."""
        if self.compiles is not None:
            self.compiles.set_wake(wake)

    def ready(self) -> bool:
        """Whether a landed package waits for `install`."""
        return self.compiles is not None and self.compiles.ready()

    def install(self) -> int:
        """Load the packages that landed since the last call and put them in force (between steps); returns how
        many."""
        if self.compiles is None:
            return 0
        landed = self.compiles.take()
        return sum(self._try_install(item) for item in landed)

    def close(self) -> None:
        if self.compiles is not None:
            self.compiles.close()

    def stats(self) -> dict:
        c = self.compiles
        state = "ready" if len(self._in_force) == len(self.jobs) else \
            "failed" if c is not None and c.error is not None else "building"
        out = {"state": state, "packages": len(self.jobs), "in_force": len(self._in_force),
               "left": [j.label for j in self.jobs if j.key not in self._in_force]}
        if c is not None:
            end = c.ended if c.ended is not None else time.monotonic()
            out |= {"landed": len(c.done), "background_s": round(end - c.started, 1), "error": c.error}
        return out

    def _try_install(self, item: Landed) -> bool:
        """Install one package; one that does not load (a file cut short, say) is removed from the cache, so that
        it is built again, and its steps stay eager."""
        try:
            self._install(item)
            return True
        except Exception as e:  # noqa: BLE001 - the eager steps serve on
            log.warning("compiled package %s did not load (%s: %s); removed from the cache", item.job.label,
                        type(e).__name__, e)
            item.path.unlink(missing_ok=True)
            return False

    def _install(self, item: Landed) -> None:
        job, t0 = item.job, time.perf_counter()
        runner = self.cache.load(item.path)
        seconds = item.seconds if item.built else time.perf_counter() - t0
        if job.kind == "decode":
            self.graphs.install(job.batch, AotStep(runner, self.graphs.kv, self.graphs.states), item.built, seconds)
        else:
            self.cores[job.core][job.n] = PackagedCore(Package(runner))
            self.prefill_report.add(item.built, seconds)
        self._in_force.add(job.key)
        if self.compiles is not None and len(self._in_force) == len(self.jobs):
            log.info("every compiled package is in force (%d)", len(self.jobs))


def _jobs(model: HybridForCausalLM, cfg: EngineConfig, graphs: DecodeGraphs | None,
          cores: dict[tuple, dict]) -> list[Job]:
    """Every package the worker can use, in the order a background build takes them: decode bucket 1, the prefill
    cores, the larger decode buckets."""
    decode = []
    if graphs is not None:
        digest = weights_digest(model)
        decode = [Job(artifact_key(model, b, CPU_OPTIONS, digest), "decode", f"decode bucket {b}", batch=b)
                  for b in graphs.buckets()]
    prefill = []
    if cfg.compile_prefill:
        for core in sorted(geometries(model)):
            cores[core] = {}
            prefill += [Job(package_key(core_name(core, n), core, OPTIONS), "prefill",
                            f"prefill {'kda' if core[0] else 'gdn'} core of {n} chunk(s)", core=core, n=n)
                        for n in chunk_counts(cfg.chunk_size, core[1])]
    return decode[:1] + prefill + decode[1:]


def _compile_error(compiles: BackgroundCompiles) -> RuntimeError:
    """The start's error when a package could not be built: it names the setting to turn off."""
    failed = next((j for j in compiles.jobs if j.key not in compiles.done), compiles.jobs[0])
    setting, what = SETTING[failed.kind]
    return RuntimeError(f"{setting}: compiling {what} failed ({compiles.error}). On the CPU it needs a C++ compiler "
                        f"(g++); or set {setting} to false")
