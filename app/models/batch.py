"""What a model forward pass reads and writes besides weights: the batch layout, attention KV, recurrent state.

A forward pass takes a flat batch of N tokens from several sequences. Sequence i owns the flat tokens
[offsets[i], offsets[i+1]) at positions cached_len[i] .. cached_len[i] + extend_len[i] - 1:

    flat tokens:  | seq 0: extend 5 (prefill chunk) | seq 1: 1 (decode) | seq 2: 1 (decode) |
    positions:      c0 .. c0+4                        c1                  c2

Attention layers append their new per-token KV entries and read the whole history through `AttentionKV`
(the engine backs it with pages). Linear-attention layers read and return per-sequence states explicitly
(`LinearStates`): the model never keeps state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


def host_to_device(host: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """A host tensor, or a list of ints (as int64), on `device`: token ids, an index (a tensor already there
    comes back as is). To a GPU it goes from pinned memory without blocking: a copy from pageable memory
    synchronises the stream, so the host would first wait for every kernel queued so far, and mid-forward the
    GPU would then idle while the host queues the next ones."""
    if not isinstance(host, torch.Tensor):
        host = torch.tensor(host, dtype=torch.long, device="cpu")
    if host.device == device or device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _computed_once:
    """functools.cached_property without its lock (Python 3.11 takes an RLock, which torch.compile cannot trace):
    the value is computed on first access and stored in the instance dict, which then answers every later one."""

    def __init__(self, fn) -> None:
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True)
class BatchLayout:
    """Split of a flat token batch into sequences.

    Invariant: len(extend_lens) == len(cached_lens), every extend_len >= 1, every cached_len >= 0.
    The tensors derived from it (positions, indices, masks) live on `device`, the device of the forward's
    inputs (the model sets it: `on`).
    """

    extend_lens: tuple[int, ...]
    cached_lens: tuple[int, ...]
    snapshots: tuple[tuple[int, ...], ...] = ()  # per sequence: offsets k (0 < k < extend_len) to capture
    device: torch.device = field(default=torch.device("cpu"), compare=False)
    # sequences whose piece is a speculative verify piece (1 + k tokens, k >= 1): attention reads it like decode
    # rows, and recurrent layers return what rolls its state back to any accepted prefix (`LinearStates.verify`)
    verify: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.extend_lens) != len(self.cached_lens):
            raise ValueError("extend_lens and cached_lens differ in length")
        if any(n < 1 for n in self.extend_lens) or any(c < 0 for c in self.cached_lens):
            raise ValueError(f"bad layout: extend {self.extend_lens}, cached {self.cached_lens}")
        if self.snapshots and (len(self.snapshots) != len(self.extend_lens) or any(
                list(ks) != sorted(set(ks)) or any(not 0 < k < n for k in ks)
                for ks, n in zip(self.snapshots, self.extend_lens))):
            raise ValueError(f"bad snapshots {self.snapshots} for extend lengths {self.extend_lens}")
        if self.verify and (list(self.verify) != sorted(set(self.verify)) or any(
                not 0 <= i < len(self.extend_lens) or self.extend_lens[i] < 2
                or (self.snapshots and self.snapshots[i]) for i in self.verify)):
            raise ValueError(f"bad verify pieces {self.verify} for extend lengths {self.extend_lens}")

    @classmethod
    def uniform(cls, batch_size: int, seq_len: int, cached_len: int = 0) -> "BatchLayout":
        return cls((seq_len,) * batch_size, (cached_len,) * batch_size)

    @classmethod
    def decode(cls, positions: torch.Tensor) -> "BatchLayout":
        """One token per sequence at `positions`, a tensor already on the device (a captured decode graph's
        input buffer). Nothing in a decode forward reads host lengths (attention masks come from positions),
        so a graph captured with one set of positions replays right with any other; cached_lens are
        placeholders here."""
        n = positions.shape[0]
        layout = cls((1,) * n, (0,) * n, device=positions.device)
        layout.__dict__["positions"] = positions  # what the cached property would compute from host lengths
        return layout

    def on(self, device: torch.device) -> "BatchLayout":
        """This layout with its derived tensors on `device`."""
        device = torch.device(device)
        return self if device == self.device else replace(self, device=device)

    def tensor(self, values: list[int]) -> torch.Tensor:
        """int64 values built on the host, on this layout's device (`host_to_device`)."""
        return host_to_device(values, self.device)

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @_computed_once
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for n in self.extend_lens:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def all_decode(self) -> bool:
        """One token per sequence: every flat row is its sequence's last token."""
        return self.num_tokens == self.num_seqs

    @_computed_once
    def positions(self) -> torch.Tensor:
        """[N] int64 position of every flat token."""
        if len(set(self.extend_lens)) == 1 and len(set(self.cached_lens)) == 1:  # decode steps, uniform batches
            row = torch.arange(self.cached_lens[0], self.cached_lens[0] + self.extend_lens[0], device=self.device)
            return row.repeat(self.num_seqs)
        return self.tensor([p for n, c in zip(self.extend_lens, self.cached_lens) for p in range(c, c + n)])

    @_computed_once
    def last_token_index(self) -> torch.Tensor:
        """[num_seqs] flat index of each sequence's last token (where its next-token logits come from)."""
        return self.tensor([o - 1 for o in self.offsets[1:]])

    def memo(self, key: tuple, make):
        """A value derived from this layout alone (rotary tables, decode masks), computed once per forward
        however many layers ask for it."""
        store = self.__dict__.setdefault("_memo", {})
        if key not in store:
            store[key] = make()
        return store[key]

    def groups_by_extend_len(self) -> list[tuple[int, list[int]]]:
        """Sequences with equal extend length, which recurrent layers run as one [G, T] batch."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(self.extend_lens):
            groups.setdefault(n, []).append(i)
        return sorted(groups.items())


class AttentionKV(Protocol):
    """Attention KV of the sequences in a batch, one entry vector per token and attention layer.

    The entry width is the layer's choice (MLA: compressed latent + rope key; GQA: keys and values).
    """

    def extend(self, layer: int, seq: int, entries: torch.Tensor) -> torch.Tensor:
        """Store `entries` [extend_len, W] after the sequence's cached tokens; return all of them,
        [cached_len + extend_len, W]."""
        ...

    def extend_padded(self, layer: int, seqs: list[int], entries: torch.Tensor,
                      counts: list[int] | None = None) -> torch.Tensor:
        """Decode form: one new entry per sequence (entries [B, W]), or `counts[b]` consecutive ones for sequence
        b (a speculative verify piece); returns every history padded to the longest, [B, S_max, W] (rows past a
        sequence's length are arbitrary; the caller masks them)."""
        ...


class ContiguousKV:
    """`AttentionKV` over one growing tensor per (layer, sequence): for the CLI, tests and training probes."""

    def __init__(self) -> None:
        self._store: dict[tuple[int, int], torch.Tensor] = {}

    def extend(self, layer: int, seq: int, entries: torch.Tensor) -> torch.Tensor:
        old = self._store.get((layer, seq))
        full = entries if old is None else torch.cat([old, entries], dim=0)
        self._store[(layer, seq)] = full
        return full

    def extend_padded(self, layer: int, seqs: list[int], entries: torch.Tensor,
                      counts: list[int] | None = None) -> torch.Tensor:
        parts = entries.split(counts or [1] * len(seqs))
        return torch.nn.utils.rnn.pad_sequence([self.extend(layer, s, e) for s, e in zip(seqs, parts)],
                                               batch_first=True)

    def length(self, layer: int, seq: int) -> int:
        t = self._store.get((layer, seq))
        return 0 if t is None else t.shape[0]


@dataclass
class LinearStates:
    """Recurrent state of every linear-attention layer for the sequences of a batch (in batch order).

    conv[j]: [B, C_j, W-1] the last W-1 inputs of layer j's short convolution.
    ssm[j]:  [B, H_j, K_j, V_j] fp32 delta-rule state; row ssm[b, h, k, :] is the paper's column S[h, :, k].
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    # states inside the step, for BatchLayout.snapshots: (sequence, offset k) -> batch-1 states after k tokens
    snapshots: dict[tuple[int, int], "LinearStates"] | None = None
    # BatchLayout.verify: sequence -> per linear layer, what rebuilds its state after any prefix of its piece
    verify: dict[int, list] | None = None

    @property
    def batch_size(self) -> int:
        return self.ssm[0].shape[0] if self.ssm else 0

    def select(self, index: list[int] | torch.Tensor) -> "LinearStates":
        idx = torch.as_tensor(index, dtype=torch.long, device=self.ssm[0].device if self.ssm else None)
        return LinearStates([c.index_select(0, idx) for c in self.conv], [s.index_select(0, idx) for s in self.ssm])

    @staticmethod
    def cat(parts: list["LinearStates"]) -> "LinearStates":
        n = len(parts[0].ssm)
        return LinearStates(
            [torch.cat([p.conv[j] for p in parts]) for j in range(n)],
            [torch.cat([p.ssm[j] for p in parts]) for j in range(n)],
        )

    def clone(self) -> "LinearStates":
        return LinearStates([c.clone() for c in self.conv], [s.clone() for s in self.ssm])
