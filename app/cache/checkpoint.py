"""Checkpoint pool: how many immutable recurrent-state checkpoints fit a byte budget, and which slots are
free; the `CheckpointCodec` interface of how one is stored (dense here, dasc in app/dasc).

The pool is bookkeeping only (the scheduler's side); each worker's codec holds the tensors for the same
slot ids. physical slots = floor(budget / bytes_per_slot), and slot 0 is reserved as in the paper's Eq. 8,
so usable slots = physical - 1. Invariant: never more checkpoints than usable slots, and the allocated
bytes (physical * bytes_per_slot) never exceed the budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from app.cache.pools import SlotAllocator
from app.models.batch import LinearStates


class CheckpointCodec(ABC):
    """How one sequence's recurrent state becomes a stored checkpoint and back."""

    @property
    @abstractmethod
    def bytes_per_slot(self) -> int:
        """Bytes one checkpoint really occupies (everything allocated per slot)."""

    @abstractmethod
    def allocate(self, num_slots: int) -> None:
        """Create storage for `num_slots` physical slots."""

    @abstractmethod
    def store(self, slot: int, state: LinearStates) -> None:
        """Write a batch-1 active state into `slot`."""

    @abstractmethod
    def load(self, slot: int) -> LinearStates:
        """A fresh batch-1 active state restored from `slot` (the stored checkpoint is not touched)."""


class DenseCodec(CheckpointCodec):
    """Exact copy: conv window in the model dtype, delta-rule state fp32."""

    def __init__(self, template: LinearStates) -> None:
        self._conv_shapes = [(c.shape[1:], c.dtype) for c in template.conv]
        self._ssm_shapes = [(s.shape[1:], s.dtype) for s in template.ssm]
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []

    @property
    def bytes_per_slot(self) -> int:
        return sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size()
                   for s, d in self._conv_shapes + self._ssm_shapes)

    def allocate(self, num_slots: int) -> None:
        self.conv = [torch.zeros(num_slots, *s, dtype=d) for s, d in self._conv_shapes]
        self.ssm = [torch.zeros(num_slots, *s, dtype=d) for s, d in self._ssm_shapes]

    def store(self, slot: int, state: LinearStates) -> None:
        for dst, src in zip(self.conv + self.ssm, state.conv + state.ssm):
            dst[slot] = src[0]

    def load(self, slot: int) -> LinearStates:
        return LinearStates([c[slot : slot + 1].clone() for c in self.conv],
                            [s[slot : slot + 1].clone() for s in self.ssm])


def physical_slots(bytes_per_slot: int, budget_bytes: int | None = None, num_slots: int | None = None) -> int:
    """Slots to allocate: floor(budget / bytes) by budget (Eq. 8), or `num_slots` usable + the reserved one."""
    if (budget_bytes is None) == (num_slots is None):
        raise ValueError("give exactly one of budget_bytes and num_slots")
    return budget_bytes // bytes_per_slot if budget_bytes is not None else num_slots + 1


class CheckpointPool:
    def __init__(self, bytes_per_slot: int, physical: int) -> None:
        self.bytes_per_slot = bytes_per_slot
        self.num_slots = max(physical - 1, 0)
        self.allocated_bytes = physical * bytes_per_slot
        self.allocator = SlotAllocator(self.num_slots, first=1)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self.allocator.num_free

    def alloc(self) -> int | None:
        ids = self.allocator.alloc(1)
        return None if ids is None else ids[0]

    def free(self, slot: int) -> None:
        self.allocator.free([slot])
