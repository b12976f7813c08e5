"""Pure decode steps from device tensors only, replayed from captured CUDA graphs (`EngineConfig.decode_graphs`)
or run through `torch.compile` (`EngineConfig.compile_decode`).

A step is padded to a (batch, history) bucket: batch a power of two, history a power of two >= MIN_HISTORY.
Padding rows read and write a scratch state slot and a scratch KV slot that the allocators never hand out.
Nothing in `decode_step` reads host lengths or copies from the host, so one capture or compiled step serves
every step of its bucket; on the CPU the same padded step runs eagerly, the twin the tests compare with the
plain step. One graph per bucket, captured on first use, all in one memory pool; a step's logits are the
graph's output buffer, to be read before the next replay. Why and how (capture, compilation, guards, the CPU
GEMM kernels): docs/architecture.md, "Decode graphs" and "Compiled decode".

    int64 input buffers of a (b, s) bucket:
    head [4, b]:    ids | positions | state slots | KV write slots
    kv_read [b, s]: each row's KV slots, padded with the scratch slot
"""

from __future__ import annotations

import contextlib
import inspect
import time
import types

import torch

from app.cache.pools import KVStorage, PagedKV, StateStorage
from app.engine.aot import AotStep, CompileReport
from app.engine.decode_inputs import DecodeInputs
from app.engine.step_batch import StepBatch
from app.models.batch import BatchLayout
from app.models.hybrid import HybridForCausalLM
from app.models.layers import Experts

MIN_HISTORY = 64
# Inductor options of the CPU's packages (with `cpu_gemm_settings`: frozen weights, C++ GEMM micro-kernels)
CPU_OPTIONS = {"freezing": True, "max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << (n - 1).bit_length())


@torch.no_grad()
def decode_step(model: HybridForCausalLM, kv: KVStorage, states: StateStorage,
                inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step from device tensors only (what a graph captures): logits [b, V] and their argmax [b] (the
    greedy picks, made inside the step); the new states are written back to their slots, the new KV entries to
    theirs."""
    ids, positions, state_slots, kv_write = inputs.head.unbind(0)
    logits, new = model(ids, BatchLayout.decode(positions), PagedKV.decode(kv, inputs.kv_read, kv_write),
                        states.gather(state_slots))
    states.scatter(state_slots, new)
    return logits, logits.argmax(-1)


def _compile_error(e: Exception) -> RuntimeError:
    return RuntimeError(f"compile_decode: compiling the decode step failed ({type(e).__name__}: {e}). On the CPU "
                        "it needs a C++ compiler (g++); or set compile_decode to false")


def _own_copy(fn):
    """The undecorated fn with a code object of its own: compiled code that skips the guards on one engine's
    model must be found only by that engine's calls."""
    fn = inspect.unwrap(fn)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


_PREFER_CPP_GEMM = False  # set while a CPU decode step compiles (`cpu_gemm_settings`)


def _prefer_cpp_gemm(choices: list) -> list:
    """Inductor's choices for one matmul, minus ATen's where a C++ GEMM kernel is among them (so nothing is
    timed: one choice left). Registered once per process; a no-op outside `cpu_gemm_settings`."""
    if not _PREFER_CPP_GEMM:
        return choices
    from torch._inductor.select_algorithm import ExternKernelCaller

    cpp = [c for c in choices if not isinstance(c, ExternKernelCaller)]  # ATen's are extern, C++ templates not
    return cpp or choices


@contextlib.contextmanager
def cpu_gemm_settings(on: bool):
    """While decode steps compile on the CPU: weights frozen into the graph (Dynamo reads the flag when it
    traces, so it is set here, not in the compile options) and C++ GEMM kernels preferred."""
    global _PREFER_CPP_GEMM
    if not on:
        yield
        return
    from torch._inductor import select_algorithm

    if _prefer_cpp_gemm not in select_algorithm.get_algorithm_selector_cache().preprocessing_fns:
        select_algorithm.add_preprocessing_fn(_prefer_cpp_gemm)
    _PREFER_CPP_GEMM = True
    try:
        with torch._inductor.config.patch(freezing=True):
            yield
    finally:
        _PREFER_CPP_GEMM = False


class DecodeGraphs:
    def __init__(self, model: HybridForCausalLM, kv: KVStorage, states: StateStorage, scratch_state: int,
                 scratch_kv: int, device: torch.device, capture: bool = True, compiled: bool = False) -> None:
        """scratch_state is also the largest batch (max_running). capture: CUDA graphs where the device is a GPU;
        compiled: one compiled step per batch bucket: on the CPU an ahead-of-time package, installed by the worker's
        `CompiledPackages` as each is loaded or built (`install`; until then a bucket's step runs eagerly), on a GPU
        made here through torch.compile."""
        if any(isinstance(m, Experts) for m in model.modules()):  # (padded_decode alone skips such models)
            raise ValueError("decode_graphs and compile_decode need a model without routed experts: their token "
                             "routing runs on the host (a device-to-host sync) and has data-dependent shapes")
        self.model, self.kv, self.states, self.device = model, kv, states, device
        self.scratch_state, self.scratch_kv = scratch_state, scratch_kv
        self.capture = capture and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._buckets: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, DecodeInputs, torch.Tensor | None]] = {}
        self.replays = 0
        self.last: tuple[int, int] | None = None  # the bucket of the last step
        self.step = decode_step
        self.compiled = compiled
        self._packages: dict[int, AotStep] = {}  # CPU compiled steps by batch bucket
        self.report = CompileReport() if compiled else None
        if compiled and device.type != "cpu":
            # one cache entry per batch bucket: more than the default 8 from max_running 256 up
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            if not self.capture:  # uncaptured steps call the generated code each time: a C++ wrapper, not Python
                options["cpp_wrapper"] = True
            # fullgraph: a graph break would leave part of the step to run eagerly, the gains gone silently
            self.step = torch.compile(_own_copy(decode_step), dynamic=False, fullgraph=True, options=options)
            t0 = time.perf_counter()
            try:
                self._compile_buckets(bucket(scratch_state))
            except Exception as e:  # Inductor's errors name its internals, not the setting that asked for them
                raise _compile_error(e) from e
            self.report.add(True, time.perf_counter() - t0)

    @staticmethod
    def handles(batch: StepBatch) -> bool:
        """A pure decode step: one token and a logits row for every sequence, no states inside the step."""
        n = len(batch.extend_lens)
        return not batch.snapshots and all(e == 1 for e in batch.extend_lens) and len(batch.want_logits) == n

    def stats(self) -> dict:
        out = {"buckets": sorted(self._buckets), "steps": self.replays, "captured": self.capture,
               "compiled": self.compiled}
        return out | (self.report.stats() if self.report else {})

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, V], their argmax [n]) on the device for a step `handles` accepts (a graph's outputs: read
        them before the next step). The KV history is padded to a power of two for a captured graph (one graph
        per size), to a multiple of MIN_HISTORY otherwise (compiled and eager steps take any length)."""
        n = len(batch.extend_lens)
        longest = max(batch.cached_lens) + 1
        b, s = bucket(n), (bucket(longest, MIN_HISTORY) if self.capture else -(-longest // MIN_HISTORY) * MIN_HISTORY)
        if (b, s) not in self._buckets:
            self._buckets[(b, s)] = self._prepare(b, s)
        graph, inputs, out = self._buckets[(b, s)]
        self.last = (b, s)
        inputs.write(batch)
        if graph is None:
            out = self._packages.get(b, self.step)(self.model, self.kv, self.states, inputs)
        else:
            with torch.cuda.device(self.device):
                graph.replay()
        self.replays += 1
        return out[0][:n], out[1][:n]

    def rerun_last(self) -> None:
        """The last step's device work once more, on its inputs as they are (what bench_engine times as the
        model-only step: no host work; it advances the states of the step's sequences again)."""
        graph, inputs, _ = self._buckets[self.last]
        if graph is None:
            self._packages.get(self.last[0], self.step)(self.model, self.kv, self.states, inputs)
        else:
            with torch.cuda.device(self.device):
                graph.replay()

    @torch.no_grad()  # as in worker.run: grad mode is part of what a compiled step was compiled for
    def _compile_buckets(self, largest: int) -> None:
        """Compile the step of every batch bucket up to `largest` (on a GPU, through its first capture), at the
        shortest history. An eager step first makes the stacked weights that the trace bakes in."""
        decode_step(self.model, self.kv, self.states,
                    DecodeInputs(1, MIN_HISTORY, self.scratch_kv, self.scratch_state, self.device))
        for i in range(largest.bit_length()):
            entry = self._buckets[(1 << i, MIN_HISTORY)] = self._prepare(1 << i, MIN_HISTORY)
            if entry[0] is None:  # not captured, so not compiled yet
                self.step(self.model, self.kv, self.states, entry[1])

    def install(self, batch: int, package: AotStep, built: bool, seconds: float) -> None:
        """From the next step on, steps of `batch` rows (a bucket) run `package` (CPU compiled decode)."""
        self._packages[batch] = package
        self.report.add(built, seconds)

    def buckets(self) -> list[int]:
        """The batch buckets a compiled step serves: 1, 2, 4, .. up to the largest batch."""
        return [1 << i for i in range(bucket(self.scratch_state).bit_length())]

    def _prepare(self, b: int, s: int):
        """A bucket's input buffers (every slot the scratch ones, so warm-up steps touch nothing else) and, on a
        GPU, its graph and output."""
        inputs = DecodeInputs(b, s, self.scratch_kv, self.scratch_state, self.device)
        if self.compiled:
            torch._dynamo.mark_dynamic(inputs.kv_read, 1)  # every history bucket shares the batch's compiled step
        if not self.capture:
            return None, inputs, None
        with torch.cuda.device(self.device):  # captures go to the current device: make it the worker's
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: allocator, library handles, stacked weights
                for _ in range(2):
                    self.step(self.model, self.kv, self.states, inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.step(self.model, self.kv, self.states, inputs)
        return graph, inputs, out
