"""Where a paged KV cache keeps each block, and how to move many blocks in few copies.

Pure index math over tensor geometry (shape, strides, storage offsets): no
device is touched, so every rule here runs on CPU tensors shaped like GPU
layouts, or on :class:`TensorGeometry` values alone.

Vocabulary, in the order a transfer worker uses it:

- **block regions** (:func:`block_regions`): the contiguous byte ranges that
  hold one block of one layer. vLLM's per-layer tensors give one region per
  block when K/V are split on dim 1, ``(num_blocks, 2, ...)`` (FlashInfer,
  Triton; vLLM >= 0.32's ``(B, H, N, C)`` in block-contiguous layouts), and two
  when K/V are split on dim 0, ``(2, num_blocks, ...)`` (FlashAttention,
  FlexAttention): the K half and the V half of a block lie ``num_blocks``
  halves apart. Head-outer layouts give one region per head. Each region is
  a "layer part": a block is ``regions_per_block`` rows of ``region_bytes``.
- **row views** (:func:`kv_layout`): every (layer, region) that lives in one
  storage with compatible alignment is fused into one view of that storage as
  rows of ``region_bytes``; block ``b`` of member ``m`` is row
  ``start[m] + b * rows_per_block[m]``. vLLM's layouts with all layers in one
  allocation (vLLM-CPU, cross-layer layouts) fuse into a single view: a job
  is then one gather for all layers.
- **copy plans** (:func:`direct_plan`, :func:`staged_plan`): a job's (engine
  row, slab byte) pairs, sorted and coalesced into runs that are contiguous on
  both sides (one ``cudaMemcpyAsync`` each), or grouped for a gather into a
  device staging buffer followed by few large copies.

A host slot holds one chunk as ``(num_layers, blocks_per_chunk, block_bytes)``
with a block's regions in order (K before V), so region ``r`` of block offset
``o`` of layer ``l`` in slot ``s`` starts at slab byte
``s * slot_bytes + ((l * blocks_per_chunk + o) * regions_per_block + r) * region_bytes``.
For a one-region layout this is exactly the CPU worker's slot layout, and a
block's bytes in a slot are the same whether the engine splits K/V on dim 0
or on dim 1 (``[K | V]`` either way, for the same order inside K and V), so
FlashAttention and FlashInfer caches of one model share chunks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_REGIONS_PER_BLOCK = 1024
"""A block split into more pieces than this is not a paged KV layout we know."""

VIEW, ENGINE, SLAB, NBYTES = 0, 1, 2, 3
"""Columns of :attr:`DirectPlan.runs`."""
STAGED_SLAB, STAGED_OFFSET, STAGED_NBYTES = 0, 1, 2
"""Columns of :attr:`StagedPiece.runs`."""


@dataclass(frozen=True)
class TensorGeometry:
    """What layout detection needs from a tensor (strides and offsets in elements)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    itemsize: int
    storage: int
    """Identity of the underlying storage (its data pointer)."""
    storage_nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorGeometry:
        s = t.untyped_storage()
        return cls(
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
            int(t.element_size()),
            int(s.data_ptr()),
            int(s.nbytes()),
        )


@dataclass(frozen=True)
class BlockRegions:
    """One layer's blocks: block ``b``'s region ``r`` starts at storage byte
    ``first + b * block_stride + region_offsets[r]`` and is ``region_bytes`` long."""

    storage: int
    num_blocks: int
    block_dim: int
    first: int
    block_stride: int
    region_offsets: tuple[int, ...]
    region_bytes: int

    @property
    def regions_per_block(self) -> int:
        return len(self.region_offsets)

    @property
    def block_bytes(self) -> int:
        return self.region_bytes * len(self.region_offsets)


def _block_dim(shape: tuple[int, ...], num_blocks: int | None) -> int:
    if num_blocks is not None:
        if shape[0] == num_blocks:
            return 0
        if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
            return 1
        raise ValueError(
            f"KV tensor of shape {shape}: expected num_blocks={num_blocks} on dim 0 "
            "(num_blocks, ...) or on dim 1 after a K/V dim of 2 (2, num_blocks, ...)"
        )
    # (2, num_blocks, ...) is K/V split on dim 0; a real cache has more than 2 blocks.
    if len(shape) >= 3 and shape[0] == 2 and shape[1] != 2:
        return 1
    return 0


def block_regions(t: torch.Tensor | TensorGeometry, num_blocks: int | None = None) -> BlockRegions:
    """Where each block of this layer tensor lives (see the module docstring).

    The block id is dim 0, or dim 1 for ``(2, num_blocks, ...)``; pass
    ``num_blocks`` to settle the one ambiguous case (a 2-block cache). Within a
    block, the innermost dims that are dense in memory (in any stride order:
    HND and NHD both work) form a region; the remaining dims, in logical
    order, enumerate the regions."""
    g = t if isinstance(t, TensorGeometry) else TensorGeometry.of(t)
    if not g.shape or any(s < 0 for s in g.stride):
        raise ValueError(f"KV tensor of shape {g.shape} strides {g.stride}: not a paged layout")
    bdim = _block_dim(g.shape, num_blocks)
    nb = g.shape[bdim]
    dims = [(g.shape[d], g.stride[d]) for d in range(len(g.shape)) if d != bdim]
    dims = [(n, s) for n, s in dims if n != 1]
    if any(s == 0 for _, s in dims) or (nb > 1 and g.stride[bdim] == 0):
        raise ValueError(f"KV tensor of shape {g.shape} strides {g.stride}: broadcast dims")
    by_stride = sorted(range(len(dims)), key=lambda i: dims[i][1])
    dense = 1
    inner: set[int] = set()
    for i in by_stride:
        n, s = dims[i]
        if s != dense:
            break
        dense *= n
        inner.add(i)
    outer = [dims[i] for i in range(len(dims)) if i not in inner]
    count = int(np.prod([n for n, _ in outer])) if outer else 1
    if count > MAX_REGIONS_PER_BLOCK:
        raise ValueError(
            f"KV tensor of shape {g.shape} strides {g.stride}: a block is {count} separate "
            f"pieces of {dense * g.itemsize} B; expected contiguous blocks or K/V halves"
        )
    offsets = tuple(
        sum(i * s for i, (_, s) in zip(idx, outer, strict=True)) * g.itemsize
        for idx in itertools.product(*(range(n) for n, _ in outer))
    )
    regions = BlockRegions(
        storage=g.storage,
        num_blocks=nb,
        block_dim=bdim,
        first=g.storage_offset * g.itemsize,
        block_stride=g.stride[bdim] * g.itemsize,
        region_offsets=offsets,
        region_bytes=dense * g.itemsize,
    )
    _check_disjoint(regions, g)
    return regions


def _check_disjoint(r: BlockRegions, g: TensorGeometry) -> None:
    starts = (
        np.arange(r.num_blocks, dtype=np.int64)[:, None] * r.block_stride
        + np.asarray(r.region_offsets, dtype=np.int64)[None, :]
    ).ravel()
    starts.sort()
    if len(starts) > 1 and int(np.diff(starts).min()) < r.region_bytes:
        raise ValueError(
            f"KV tensor of shape {g.shape} strides {g.stride}: blocks overlap in memory"
        )
    if r.first + int(starts[-1]) + r.region_bytes > g.storage_nbytes:
        raise ValueError(f"KV tensor of shape {g.shape}: extends past its storage")


@dataclass(frozen=True)
class RowView:
    """One storage seen as ``num_rows`` rows of ``row_bytes``, ``pitch`` bytes
    apart from storage byte ``origin``; its members are (layer, region) pairs."""

    storage: int
    origin: int
    pitch: int
    num_rows: int
    row_bytes: int
    layers: np.ndarray
    regions: np.ndarray
    starts: np.ndarray
    """Row of block 0, per member."""
    rows_per_block: np.ndarray
    """Rows between consecutive blocks, per member."""

    @property
    def contiguous(self) -> bool:
        """Consecutive rows are adjacent bytes (runs of rows coalesce)."""
        return self.pitch == self.row_bytes

    @property
    def span_bytes(self) -> int:
        return (self.num_rows - 1) * self.pitch + self.row_bytes


@dataclass(frozen=True)
class KVLayout:
    """One KV group's layers, their block regions and the row views covering them."""

    layers: tuple[BlockRegions, ...]
    views: tuple[RowView, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks

    @property
    def region_bytes(self) -> int:
        return self.layers[0].region_bytes

    @property
    def regions_per_block(self) -> int:
        return self.layers[0].regions_per_block

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer (all its regions)."""
        return self.layers[0].block_bytes

    @property
    def fused(self) -> bool:
        """All layers' blocks are rows of one view: one gather/scatter per job."""
        return len(self.views) == 1

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        return self.num_layers * blocks_per_chunk * self.block_bytes


def kv_layout(
    layers: Sequence[torch.Tensor | TensorGeometry], num_blocks: int | None = None
) -> KVLayout:
    """Detect each layer's block regions and fuse them into as few row views as
    the storages and alignments allow."""
    if not layers:
        raise ValueError("a KV group needs at least one layer tensor")
    geoms = [t if isinstance(t, TensorGeometry) else TensorGeometry.of(t) for t in layers]
    regions = [block_regions(g, num_blocks) for g in geoms]
    r0 = regions[0]
    for i, r in enumerate(regions):
        if (r.num_blocks, r.regions_per_block, r.region_bytes) != (
            r0.num_blocks,
            r0.regions_per_block,
            r0.region_bytes,
        ):
            raise ValueError(
                f"layer {i}: {r.num_blocks} blocks of {r.regions_per_block} x "
                f"{r.region_bytes} B; layer 0 has {r0.num_blocks} of "
                f"{r0.regions_per_block} x {r0.region_bytes} B (a KV group's layers must match)"
            )
    size = r0.region_bytes
    # members: (storage, residue of the first row mod region size) → fusable together
    classes: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    strided: list[RowView] = []
    for li, r in enumerate(regions):
        for ri, off in enumerate(r.region_offsets):
            start = r.first + off
            if r.block_stride % size:
                # padded blocks: a view per (layer, region), rows one block apart
                strided.append(_view(r.storage, [(li, ri, start)], size, r.block_stride, regions))
            else:
                classes.setdefault((r.storage, start % size), []).append((li, ri, start))
    fused = [
        _view(storage, members, size, size, regions) for (storage, _), members in classes.items()
    ]
    return KVLayout(tuple(regions), tuple(fused + strided))


def _view(
    storage: int,
    members: list[tuple[int, int, int]],
    row_bytes: int,
    pitch: int,
    regions: list[BlockRegions],
) -> RowView:
    origin = min(start for _, _, start in members)
    layer_idx = np.array([m[0] for m in members], dtype=np.int64)
    region_idx = np.array([m[1] for m in members], dtype=np.int64)
    starts = np.array([(m[2] - origin) // pitch for m in members], dtype=np.int64)
    per_block = np.array([regions[m[0]].block_stride // pitch for m in members], dtype=np.int64)
    nb = regions[members[0][0]].num_blocks
    num_rows = int((starts + (nb - 1) * per_block).max()) + 1
    return RowView(
        storage, origin, pitch, num_rows, row_bytes, layer_idx, region_idx, starts, per_block
    )


# -- copy plans ------------------------------------------------------------------------


@dataclass(frozen=True)
class JobPairs:
    """Every (engine row, slab byte) pair a job moves, one per (member, block)."""

    view: np.ndarray
    row: np.ndarray
    slab: np.ndarray
    row_bytes: int

    @property
    def num_bytes(self) -> int:
        return len(self.row) * self.row_bytes


def job_pairs(
    layout: KVLayout,
    engine_blocks: Sequence[int] | np.ndarray,
    slots: Sequence[int] | np.ndarray,
    offsets: Sequence[int] | np.ndarray,
    *,
    blocks_per_chunk: int,
    slot_bytes: int,
    num_slots: int,
) -> JobPairs:
    """All pairs of one group's block copies; raises ValueError on any id out of
    range (checked here, on the host, so a bad job never reaches a device)."""
    blocks = np.asarray(engine_blocks, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    if not len(blocks) == len(slots) == len(offsets):
        raise ValueError(
            f"{len(blocks)} engine blocks, {len(slots)} slots, {len(offsets)} offsets: one each"
        )
    if layout.chunk_bytes(blocks_per_chunk) > slot_bytes:
        raise ValueError(
            f"a chunk of {layout.chunk_bytes(blocks_per_chunk)} B does not fit a {slot_bytes} B slot"
        )
    for name, arr, bound in (
        ("engine block", blocks, layout.num_blocks),
        ("slot", slots, num_slots),
        ("block offset", offsets, blocks_per_chunk),
    ):
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= bound):
            bad = arr[(arr < 0) | (arr >= bound)][0]
            raise ValueError(f"{name} {int(bad)} out of range [0, {bound})")
    size = layout.region_bytes
    rpb = layout.regions_per_block
    views, rows, slab = [], [], []
    for vi, v in enumerate(layout.views):
        rows.append((v.starts[:, None] + blocks[None, :] * v.rows_per_block[:, None]).ravel())
        slab.append(
            (
                slots[None, :] * slot_bytes
                + (
                    (v.layers[:, None] * blocks_per_chunk + offsets[None, :]) * rpb
                    + v.regions[:, None]
                )
                * size
            ).ravel()
        )
        views.append(np.full(len(rows[-1]), vi, dtype=np.int64))
    return JobPairs(np.concatenate(views), np.concatenate(rows), np.concatenate(slab), size)


@dataclass(frozen=True)
class DirectPlan:
    """Runs contiguous in the engine view and in the slab, sorted by view then
    engine row: columns ``VIEW, ENGINE`` (bytes from the view's origin),
    ``SLAB`` (bytes), ``NBYTES``."""

    runs: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.runs[:, NBYTES].sum())

    @property
    def mean_run_bytes(self) -> float:
        return self.num_bytes / len(self.runs) if len(self.runs) else 0.0


def direct_plan(layout: KVLayout, pairs: JobPairs) -> DirectPlan:
    if not len(pairs.row):
        return DirectPlan(np.zeros((0, 4), dtype=np.int64))
    order = np.lexsort((pairs.row, pairs.view))
    view, row, slab = pairs.view[order], pairs.row[order], pairs.slab[order]
    contiguous = np.array([v.contiguous for v in layout.views], dtype=bool)[view]
    joins = (
        (view[1:] == view[:-1])
        & contiguous[1:]
        & (row[1:] == row[:-1] + 1)
        & (slab[1:] == slab[:-1] + pairs.row_bytes)
    )
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.diff(np.append(first, len(row)))
    pitch = np.array([v.pitch for v in layout.views], dtype=np.int64)[view[first]]
    runs = np.stack(
        [view[first], row[first] * pitch, slab[first], lengths * pairs.row_bytes], axis=1
    )
    return DirectPlan(runs)


@dataclass(frozen=True)
class Gather:
    """Rows ``rows`` of view ``view`` ↔ staging rows ``staging_row ..``."""

    view: int
    rows: np.ndarray
    staging_row: int


@dataclass(frozen=True)
class StagedPiece:
    """What fits the staging buffer once: the gathers filling it (or scatters
    emptying it) and the copies between it and the slab, columns
    ``STAGED_SLAB``, ``STAGED_OFFSET`` (byte offset in the staging buffer),
    ``STAGED_NBYTES``."""

    rows: int
    gathers: tuple[Gather, ...]
    runs: np.ndarray


@dataclass(frozen=True)
class StagedPlan:
    pieces: tuple[StagedPiece, ...]
    row_bytes: int

    @property
    def num_bytes(self) -> int:
        return sum(p.rows for p in self.pieces) * self.row_bytes

    @property
    def num_copies(self) -> int:
        return sum(len(p.runs) for p in self.pieces)


def staged_plan(pairs: JobPairs, staging_bytes: int) -> StagedPlan:
    """Staging rows ordered by (view, slab byte): each view's rows are one gather
    into a contiguous stretch of staging, and slab-consecutive rows coalesce
    into one copy between staging and slab."""
    size = pairs.row_bytes
    cap = staging_bytes // size
    if cap < 1:
        raise ValueError(f"staging buffer of {staging_bytes} B is smaller than one {size} B row")
    n = len(pairs.row)
    order = np.lexsort((pairs.slab, pairs.view))
    view, row, slab = pairs.view[order], pairs.row[order], pairs.slab[order]
    pieces = []
    for a in range(0, n, cap):
        b = min(a + cap, n)
        v, r, s = view[a:b], row[a:b], slab[a:b]
        joins = s[1:] == s[:-1] + size
        first = np.flatnonzero(np.concatenate(([True], ~joins)))
        lengths = np.diff(np.append(first, len(s)))
        runs = np.stack([s[first], first * size, lengths * size], axis=1)
        cuts = np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))
        ends = np.append(cuts[1:], len(v))
        gathers = tuple(Gather(int(v[c]), r[c:e], int(c)) for c, e in zip(cuts, ends, strict=True))
        pieces.append(StagedPiece(b - a, gathers, runs))
    return StagedPlan(tuple(pieces), size)
