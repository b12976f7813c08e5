"""Checkpoint pool: how many immutable recurrent-state checkpoints fit a byte budget, and which slots are
free; the `CheckpointCodec` interface of how one is stored (dense here, dasc in app/dasc).

The pool is bookkeeping only (the scheduler's side); each worker's codec holds the tensors for the same
slot ids. physical slots = floor(budget / bytes_per_slot), and slot 0 is reserved as in the paper's Eq. 8,
so usable slots = physical - 1. Invariant: never more checkpoints than usable slots, and the allocated
bytes (physical * bytes_per_slot) never exceed the budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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

    def slot_tensors(self) -> list[torch.Tensor]:
        """The storage tensors, slot first: what `export` and `import_rows` copy (the host tier's bytes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot export its slots")

    def export(self, slot: int) -> list[torch.Tensor]:
        """`slot`'s storage rows, as stored (views: copy them before the slot is reused)."""
        return [t[slot] for t in self.slot_tensors()]

    def import_rows(self, slot: int, rows: list[torch.Tensor]) -> None:
        """Write rows `export` gave back into `slot`: the checkpoint as it was, bit for bit."""
        for t, row in zip(self.slot_tensors(), rows, strict=True):
            t[slot].copy_(row, non_blocking=True)


@dataclass(frozen=True)
class FlatLayout:
    """Batch-1 tensors of one dtype laid end to end, so a slot holds them as one flat row and a store or a load
    is one copy whatever the number of layers (on a GPU, kernel launches rather than bytes bound a checkpoint
    copy). shapes[j]: tensor j without its batch dimension; slots live on `device`, where the tensors are."""

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "FlatLayout":
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"one flat layout holds one dtype, got {sorted(map(str, dtypes))}")
        return cls(tuple(t.shape[1:] for t in tensors), dtypes.pop() if dtypes else torch.float32,
                   tensors[0].device if tensors else torch.device("cpu"))

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def zeros(self, num_slots: int) -> torch.Tensor:
        return torch.zeros(num_slots, self.numel, dtype=self.dtype, device=self.device)

    def write(self, row: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """row [numel] <- the batch-1 tensors, end to end."""
        if tensors:
            with torch.no_grad():  # stored data, whatever produced it
                torch.cat([t.reshape(-1) for t in tensors], out=row)

    def read(self, row: torch.Tensor) -> list[torch.Tensor]:
        """A fresh copy of the row, as batch-1 tensors (views of that one copy)."""
        flat = row.clone()
        return [v.view(1, *s) for v, s in zip(flat.split([s.numel() for s in self.shapes]), self.shapes)]


class DenseCodec(CheckpointCodec):
    """Exact copy: conv windows in the model dtype and delta-rule states in fp32, each kind in one flat row
    per slot (`FlatLayout`)."""

    def __init__(self, template: LinearStates) -> None:
        self.conv_layout, self.ssm_layout = FlatLayout.of(template.conv), FlatLayout.of(template.ssm)
        self.conv = self.ssm = None

    @property
    def bytes_per_slot(self) -> int:
        return self.conv_layout.nbytes + self.ssm_layout.nbytes

    def allocate(self, num_slots: int) -> None:
        self.conv, self.ssm = self.conv_layout.zeros(num_slots), self.ssm_layout.zeros(num_slots)

    def store(self, slot: int, state: LinearStates) -> None:
        self.conv_layout.write(self.conv[slot], state.conv)
        self.ssm_layout.write(self.ssm[slot], state.ssm)

    def load(self, slot: int) -> LinearStates:
        return LinearStates(self.conv_layout.read(self.conv[slot]), self.ssm_layout.read(self.ssm[slot]))

    def slot_tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.ssm]


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
