"""Transfer workers: move KV blocks between an engine's paged tensors and host slots.

The engine registers, per KV group, its per-layer paged tensors (dim 0 is the
block id; everything after it is treated as the opaque bytes of one block).
A host slot holds one chunk of one group laid out as
``(num_layers, blocks_per_chunk, block_bytes)``, so a chunk's bytes are one
contiguous region of the slab.

Lifecycle, per engine step: ``submit`` jobs (returns at once), ``wait`` for the
ids the scheduler asked to flush, ``poll`` finished ones. A failed job is
reported with ``ok=False``; the adapter turns failed loads into recomputes.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class Direction(str, enum.Enum):
    LOAD = "load"
    """host slot → engine block"""
    STORE = "store"
    """engine block → host slot"""


BlockIds = Sequence[int] | np.ndarray
"""Integer ids: plain lists from the scheduler (cheapest to build there and to
send to worker processes), or int64 arrays; workers index with ``as_index``."""


def as_index(ids: BlockIds) -> torch.Tensor:
    """``ids`` as an int64 tensor for indexing (no copy for an int64 array)."""
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


class BlockCopies(NamedTuple):
    """Copies for one KV group, one entry per engine block (the three sequences
    have one length; workers check ids before copying). Tuples: the scheduler
    builds one per group per job on every step."""

    group: int
    engine_blocks: BlockIds
    slots: BlockIds
    offsets: BlockIds
    """Block position inside its chunk (0 .. blocks_per_chunk - 1)."""

    @property
    def num_blocks(self) -> int:
        return len(self.engine_blocks)


class TransferJob(NamedTuple):
    job_id: int
    direction: Direction
    copies: tuple[BlockCopies, ...]


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    direction: Direction
    ok: bool
    num_bytes: int
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class GroupLayers:
    """One KV group's paged tensors as registered by the engine."""

    group: int
    layers: tuple[torch.Tensor, ...]
    blocks_per_chunk: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        t = self.layers[0]
        return int(t[0].numel() * t.element_size())

    @property
    def chunk_bytes(self) -> int:
        return len(self.layers) * self.blocks_per_chunk * self.block_bytes


def block_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """View a paged tensor as ``(num_blocks, block_bytes)`` uint8 (no copy)."""
    if not t[0].is_contiguous():
        raise ValueError("each KV block must be contiguous in memory (dim 0 = block id)")
    if t.stride(0) * t.element_size() != t[0].numel() * t.element_size():
        # padded blocks: keep the stride, view each block's bytes
        return t.view(torch.uint8).reshape(t.shape[0], -1)[:, : t[0].numel() * t.element_size()]
    return t.view(t.shape[0], -1).view(torch.uint8)


class TransferWorker(ABC):
    """Executes jobs asynchronously; never blocks the caller except in ``wait``."""

    name: str = ""

    @abstractmethod
    def register(self, groups: Sequence[GroupLayers], slab: torch.Tensor) -> None: ...

    @abstractmethod
    def submit(self, job: TransferJob) -> None: ...

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs (if known and unfinished) are done."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Jobs finished since the last poll (each reported once)."""

    @abstractmethod
    def shutdown(self) -> None: ...


def slab_span(slab: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``(num_slots, width)`` uint8 slab whose rows may be strided (one rank's
    region of a shared slab) as ``(flat, slot_stride)``: slot ``s`` starts at
    byte ``s * slot_stride`` of the 1-D ``flat`` view, which spans from the
    first slot's start to the last slot's end (other ranks' bytes in between)."""
    if slab.dim() != 2 or slab.dtype != torch.uint8 or slab.stride(1) != 1:
        raise ValueError(
            "the host slab must be a uint8 (num_slots, slot_bytes) tensor with contiguous rows"
        )
    n, width = int(slab.shape[0]), int(slab.shape[1])
    stride = int(slab.stride(0)) if n > 1 else width
    if stride < width:
        raise ValueError("the host slab's rows overlap")
    return slab.as_strided(((n - 1) * stride + width,), (1,)), stride


def slot_views(slab: torch.Tensor, g: GroupLayers) -> torch.Tensor:
    """The slab as ``(num_slots, num_layers, blocks_per_chunk, block_bytes)`` for group ``g``."""
    need = g.chunk_bytes
    if need > slab.shape[1]:
        raise ValueError(
            f"group {g.group}: chunk of {need} B does not fit a {slab.shape[1]} B slot"
        )
    return slab[:, :need].view(slab.shape[0], len(g.layers), g.blocks_per_chunk, g.block_bytes)
