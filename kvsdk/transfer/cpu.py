"""``cpu``: the transfer worker for KV tensors in host memory (vLLM-CPU, tests).

Stores run on one background thread in submission order (numpy's copies
release the GIL, so the engine keeps going) while the engine leaves a
CPU free, else on the caller's thread (``sync_stores``); loads run on the
caller's thread by default (``sync_loads``), see ``submit``. A job is one row
gather and one row scatter for all layers when the engine's layers share a
storage (vLLM's layout), else one per layer; never a Python loop per block.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvsdk.hooks import hookimpl
from kvsdk.transfer.base import (
    Direction,
    GroupLayers,
    TransferJob,
    TransferResult,
    TransferWorker,
    as_index,
    block_bytes_view,
    slab_span,
    slot_views,
)


def _fused_rows(layers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One ``(rows, block_bytes)`` view over *all* layers' blocks, and each
    layer's first row, when the layers are equally strided views of one
    storage (vLLM's layout): then a job is one gather and one scatter."""
    first = layers[0]
    stride = first.stride(0)
    storage = first.untyped_storage()
    base = first.storage_offset()
    starts = []
    for t in layers:
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.stride(0) != stride
            or t.shape != first.shape
            or (t.storage_offset() - base) % stride
            or t.storage_offset() < base
        ):
            return None
        starts.append((t.storage_offset() - base) // stride)
    num_rows = max(starts) + first.shape[0]
    rows = torch.empty(0, dtype=torch.uint8).set_(
        storage, base, (num_rows, first.shape[1]), (stride, 1)
    )
    return rows, torch.tensor(starts, dtype=torch.int64)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """View uint8 rows as int64 when sizes and alignment allow (8x fewer elements)."""
    if t.shape[1] % 8 == 0 and t.stride(0) % 8 == 0 and t.storage_offset() % 8 == 0:
        return t.view(torch.int64)
    return t


STAGE_BYTES = 16 << 20
"""Size of each reused gather buffer; larger jobs go through it in pieces."""

DIRECT_COPY_BYTES = 128 << 10
"""Copies of at least this many bytes on average go straight from rows to rows
(one strided copy per run of rows, no gather buffer: half the memory traffic);
smaller ones through a gather and a scatter (fewer Python calls)."""


def row_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Greedy runs of index pairs where ``src`` and ``dst`` each advance by a
    constant positive step: ``(src_start, src_step, dst_start, dst_step, length)``.
    Each run is one strided copy."""
    runs = []
    i, n = 0, len(src)
    while i < n:
        j = i + 1
        if j < n:
            ds, dd = src[j] - src[i], dst[j] - dst[i]
            if ds > 0 and dd > 0:
                while j + 1 < n and src[j + 1] - src[j] == ds and dst[j + 1] - dst[j] == dd:
                    j += 1
                runs.append((src[i], ds, dst[i], dd, j - i + 1))
                i = j + 1
                continue
        runs.append((src[i], 1, dst[i], 1, 1))
        i += 1
    return runs


def _host_array(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host tensor (None where torch cannot give one)."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


def copy_rows(
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    stage: Callable[[], torch.Tensor],
) -> None:
    """``dst[dst_idx] = src[src_idx]`` for 2-D row tensors: one strided copy per
    run of rows when the runs are long enough (no buffer, half the memory
    traffic), else a gather into ``stage()`` (a reused buffer of rows like
    ``src``'s) and a scatter, in bounded pieces. kvsdk's CPU worker copies with
    it, and so does the native connector's CPU worker the benchmarks use.

    The copies run on the calling thread alone (numpy's), not on torch's
    OpenMP team: on a CPU engine that team is the model's, each torch copy
    would be a parallel region ending in a barrier, and a team thread the OS
    has lent to another process (vLLM's EngineCore spins while it waits for
    the worker) holds every barrier up. A memcpy is bound by memory, not by
    cores: one thread copies as fast (measured on a 2-core VM: 72 rows of
    256 KiB in 1.34 ms against torch's 1.48 ms, slowest of 30 1.43 ms against
    3.3-6.6 ms)."""
    s_np, d_np = _host_array(src), _host_array(dst)
    host = None if s_np is None or d_np is None else (s_np, d_np)
    row_bytes = src.shape[1] * src.element_size()
    if len(src_idx) * row_bytes >= DIRECT_COPY_BYTES:
        runs = row_runs(src_idx.tolist(), dst_idx.tolist())
        if len(src_idx) * row_bytes >= DIRECT_COPY_BYTES * len(runs):
            for s0, ds, d0, dd, length in runs:
                s_end, d_end = s0 + (length - 1) * ds + 1, d0 + (length - 1) * dd + 1
                if min(s0, d0) < 0 or s_end > len(src) or d_end > len(dst):
                    # a slice would stop short (or wrap) and copy less, silently
                    raise IndexError(
                        f"rows {s0}..{s_end - 1} -> {d0}..{d_end - 1} out of range of "
                        f"{len(src)} -> {len(dst)} rows"
                    )
                if host is not None:
                    np.copyto(host[1][d0:d_end:dd], host[0][s0:s_end:ds])
                else:
                    dst[d0:d_end:dd].copy_(src[s0:s_end:ds])
            return
    buf = stage()
    b_np = _host_array(buf)
    step = buf.shape[0]
    if host is not None and b_np is not None:
        s_rows, d_rows = host
        s_ids, d_ids = src_idx.numpy(), dst_idx.numpy()
        if len(s_ids) and min(s_ids.min(), d_ids.min()) < 0:  # numpy would wrap them
            raise IndexError(f"negative row in {s_ids.tolist()} -> {d_ids.tolist()}")
        for i in range(0, len(s_ids), step):
            piece = b_np[: len(s_ids[i : i + step])]
            np.take(s_rows, s_ids[i : i + step], axis=0, out=piece)
            d_rows[d_ids[i : i + step]] = piece
        return
    for i in range(0, len(src_idx), step):
        piece_t = buf[: len(src_idx[i : i + step])]
        torch.index_select(src, 0, src_idx[i : i + step], out=piece_t)
        dst.index_copy_(0, dst_idx[i : i + step], piece_t)


class _GroupPlan:
    """How one group's engine blocks map onto rows of the slab.

    When a slot is a whole number of block-sized rows, the slab is viewed as
    rows and a copy is a strided copy per run of rows, or a row gather plus a
    row scatter (:func:`copy_rows`): a memcpy per block. When all layers are equally
    strided views of one storage, the layers are fused: one gather and one
    scatter per job for all layers."""

    def __init__(self, g: GroupLayers, slab: torch.Tensor) -> None:
        bb = g.block_bytes
        self.num_layers = len(g.layers)
        self.blocks_per_chunk = g.blocks_per_chunk
        self.layers = [block_bytes_view(t) for t in g.layers]
        flat, slot_stride = slab_span(slab)
        self.rows_per_slot = slot_stride // bb if slot_stride % bb == 0 else 0
        self.slot_view = slot_views(slab, g)
        self.slab_rows: torch.Tensor | None = None
        self.engine_rows: torch.Tensor | None = None
        self.layer_starts = torch.zeros(0, dtype=torch.int64)
        self._stages: dict[Direction, torch.Tensor] = {}
        fused = _fused_rows(self.layers)
        if self.rows_per_slot and fused is not None:
            rows = flat[: len(flat) // bb * bb].view(-1, bb)
            slab_rows, engine_rows = _wide(rows), _wide(fused[0])
            if slab_rows.dtype == engine_rows.dtype:
                self.slab_rows, self.engine_rows, self.layer_starts = (
                    slab_rows,
                    engine_rows,
                    fused[1],
                )

    def _stage(self, direction: Direction, like: torch.Tensor) -> torch.Tensor:
        """A reused gather buffer per direction (loads and stores run on different
        threads): a fresh temporary per job costs more in page faults than the copy."""
        stage = self._stages.get(direction)
        if stage is None:
            rows = max(1, STAGE_BYTES // (like.shape[1] * like.element_size()))
            stage = self._stages[direction] = torch.empty((rows, like.shape[1]), dtype=like.dtype)
        return stage

    def copy(
        self, direction: Direction, blocks: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor
    ) -> int:
        n = len(blocks) * self.num_layers * self.layers[0].shape[1]
        if self.engine_rows is not None and self.slab_rows is not None:
            layer_idx = torch.arange(self.num_layers, dtype=torch.int64)
            engine_idx = (self.layer_starts[:, None] + blocks[None, :]).reshape(-1)
            slab_idx = (
                (slots * self.rows_per_slot + offsets)[None, :]
                + (layer_idx * self.blocks_per_chunk)[:, None]
            ).reshape(-1)
            if direction is Direction.STORE:
                src, src_idx, dst, dst_idx = self.engine_rows, engine_idx, self.slab_rows, slab_idx
            else:
                src, src_idx, dst, dst_idx = self.slab_rows, slab_idx, self.engine_rows, engine_idx
            copy_rows(src, src_idx, dst, dst_idx, lambda: self._stage(direction, src))
            return n
        for li, layer in enumerate(self.layers):  # general layout: per layer, advanced indexing
            if direction is Direction.STORE:
                self.slot_view[slots, li, offsets] = layer.index_select(0, blocks)
            else:
                layer[blocks] = self.slot_view[slots, li, offsets]
        return n


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def no_cpu_to_spare() -> bool:
    """Whether torch's thread team already spans every CPU this process may run
    on (a vLLM-CPU worker bound to its cores): a helper thread's work then comes
    out of the forward pass's time."""
    return torch.get_num_threads() >= _usable_cpus()


class CPUTransferWorker(TransferWorker):
    name = "cpu"

    def __init__(self, *, sync_loads: bool = True, sync_stores: bool | None = None) -> None:
        """``sync_stores=None``: stores run on the caller's thread when torch's
        thread team already spans every CPU this process may run on (a copy
        thread would only take cores from the engine: measured with 2 engine
        threads on 2 CPUs, the engine then sat idle a sixth of the time; a
        TP worker bound to one CPU is the same case), else on the copy thread."""
        self.sync_loads = sync_loads
        if sync_stores is None:
            sync_stores = no_cpu_to_spare()
        self.sync_stores = sync_stores
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsdk-xfer")
        self._futures: dict[int, Future[TransferResult]] = {}
        self._lock = threading.Lock()
        self._plans: dict[int, _GroupPlan] = {}

    def register(self, groups: Sequence[GroupLayers], slab: torch.Tensor) -> None:
        for g in groups:
            self._plans[g.group] = _GroupPlan(g, slab)

    def submit(self, job: TransferJob) -> None:
        fut: Future[TransferResult]
        if self.sync_stores if job.direction is Direction.STORE else self.sync_loads:
            # On a CPU the copy uses the same cores as compute, and a copy thread
            # would wait for the GIL behind the engine loop (5 ms switch interval,
            # per torch call): a load is a few ms of memcpy, done here.
            fut = Future()
            fut.set_result(self._run(job))
        else:
            fut = self._pool.submit(self._run, job)
        with self._lock:
            self._futures[job.job_id] = fut

    def _run(self, job: TransferJob) -> TransferResult:
        start = time.perf_counter()
        nbytes = 0
        try:
            for c in job.copies:
                if not len(c.engine_blocks) == len(c.slots) == len(c.offsets):
                    raise ValueError(
                        f"group {c.group}: engine blocks, slots, offsets differ in length"
                    )
                if c.num_blocks:
                    nbytes += self._plans[c.group].copy(
                        job.direction,
                        as_index(c.engine_blocks),
                        as_index(c.slots),
                        as_index(c.offsets),
                    )
        except Exception as exc:  # reported, never raised into the engine
            return TransferResult(
                job.job_id,
                job.direction,
                False,
                nbytes,
                time.perf_counter() - start,
                f"{type(exc).__name__}: {exc}",
            )
        return TransferResult(job.job_id, job.direction, True, nbytes, time.perf_counter() - start)

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            futs = [self._futures[j] for j in job_ids if j in self._futures]
        for f in futs:
            f.exception()  # waits; errors are reported through poll()

    def poll(self) -> list[TransferResult]:
        with self._lock:
            done = [j for j, f in self._futures.items() if f.done()]
            futs = [self._futures.pop(j) for j in done]
        return [f.result() for f in futs]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@hookimpl
def kvsdk_transfer_workers() -> dict[str, Callable[..., TransferWorker]]:
    return {"cpu": CPUTransferWorker}
