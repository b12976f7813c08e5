"""Decode steps replayed from captured CUDA graphs (`EngineConfig.decode_graphs`).

On a GPU, a decode step of a model this engine serves is bound by kernel launches: each of its few hundred
ops costs the host more time than the GPU. A CUDA graph records the launches of one step once and replays
them with one call. A graph replays fixed shapes and fixed buffers, so the step here is built from device
tensors only (`decode_step`): token ids, positions, state slots and KV tables go into the graph's input
buffer with one host-to-device copy, and nothing in the forward reads host lengths (`BatchLayout.decode`).
Steps are padded up to a bucket: the batch to a power of two, the KV history to a power of two of at least
64 tokens. Padding rows read and write a scratch state slot and a scratch KV slot that the allocators never
hand out. One graph per (batch, history) bucket, captured on first use, all in one memory pool (a step's
logits are copied out before the next replay).

On the CPU the same padded step runs eagerly, without capture: the twin the tests compare with the plain step.

    int64 input buffer of a (b, s) bucket:
    | ids [b] | positions [b] | state slots [b] | KV write slots [b] | KV read table [b, s], row-major |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from app.cache.pools import KVStorage, PagedKV, StateStorage, padded_rows
from app.models.batch import BatchLayout
from app.models.hybrid import HybridForCausalLM
from app.models.layers import Experts

if TYPE_CHECKING:
    from app.engine.worker import StepBatch

MIN_HISTORY = 64


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << (n - 1).bit_length())


class DecodeInputs:
    """The input buffer of one (b, s) bucket and its views."""

    def __init__(self, flat: torch.Tensor, b: int, s: int) -> None:
        self.flat = flat
        self.ids, self.positions, self.state_slots, self.kv_write = flat[: 4 * b].view(4, b).unbind(0)
        self.kv_read = flat[4 * b :].view(b, s)


@torch.no_grad()
def decode_step(model: HybridForCausalLM, kv: KVStorage, states: StateStorage, inputs: DecodeInputs) -> torch.Tensor:
    """One decode step from device tensors only (what a graph captures): logits [b, V]; the new states are
    written back to their slots, the new KV entries to theirs."""
    layout = BatchLayout.decode(inputs.positions)
    logits, new = model(inputs.ids, layout, PagedKV.decode(kv, inputs.kv_read, inputs.kv_write),
                        states.gather(inputs.state_slots))
    states.scatter(inputs.state_slots, new)
    return logits


class DecodeGraphs:
    def __init__(self, model: HybridForCausalLM, kv: KVStorage, states: StateStorage, scratch_state: int,
                 scratch_kv: int, device: torch.device) -> None:
        if any(isinstance(m, Experts) for m in model.modules()):
            raise ValueError("decode_graphs needs a model without routed experts: their token routing runs on "
                             "the host (a device-to-host sync), which a CUDA graph cannot capture")
        self.model, self.kv, self.states, self.device = model, kv, states, device
        self.scratch_state, self.scratch_kv = scratch_state, scratch_kv
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._buckets: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, DecodeInputs, torch.Tensor | None]] = {}
        self.replays = 0

    @staticmethod
    def handles(batch: StepBatch) -> bool:
        """A pure decode step: one token and a logits row for every sequence, no states inside the step."""
        n = len(batch.extend_lens)
        return not batch.snapshots and all(e == 1 for e in batch.extend_lens) and len(batch.want_logits) == n

    def stats(self) -> dict:
        return {"buckets": sorted(self._buckets), "steps": self.replays, "captured": self.capture}

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [n, V] on the device for a step `handles` accepts (a graph's output: read them before the
        next step)."""
        n = len(batch.extend_lens)
        b, s = bucket(n), bucket(max(batch.cached_lens) + 1, MIN_HISTORY)
        if (b, s) not in self._buckets:
            self._buckets[(b, s)] = self._prepare(b, s)
        graph, inputs, out = self._buckets[(b, s)]
        host = self._host_inputs(batch, b, s)
        if graph is None:
            inputs.flat.copy_(host)
            out = decode_step(self.model, self.kv, self.states, inputs)
        else:
            inputs.flat.copy_(host.pin_memory(), non_blocking=True)
            with torch.cuda.device(self.device):
                graph.replay()
        self.replays += 1
        return out[:n]

    def _host_inputs(self, batch: StepBatch, b: int, s: int) -> torch.Tensor:
        n, pad = len(batch.extend_lens), b - len(batch.extend_lens)
        head = torch.tensor(list(batch.token_ids) + [0] * pad + list(batch.cached_lens) + [0] * pad
                            + list(batch.state_slots) + [self.scratch_state] * pad, device="cpu")
        write = torch.cat(batch.new_slots + [torch.full((pad,), self.scratch_kv, dtype=torch.long, device="cpu")])
        rows = [[h, w] for h, w in zip(batch.history, batch.new_slots)] + [[]] * pad
        return torch.cat([head, write, padded_rows(rows, s, self.scratch_kv).view(-1)])

    def _prepare(self, b: int, s: int):
        """A bucket's input buffer (every slot the scratch ones, so warm-up steps touch nothing else) and, on a
        GPU, its graph and output."""
        flat = torch.full((4 * b + b * s,), self.scratch_kv, dtype=torch.long, device=self.device)
        inputs = DecodeInputs(flat, b, s)
        inputs.ids.zero_()
        inputs.positions.zero_()
        inputs.state_slots.fill_(self.scratch_state)
        if not self.capture:
            return None, inputs, None
        with torch.cuda.device(self.device):  # captures go to the current device: make it the worker's
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: allocator, library handles, stacked weights
                for _ in range(2):
                    decode_step(self.model, self.kv, self.states, inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = decode_step(self.model, self.kv, self.states, inputs)
        return graph, inputs, out
