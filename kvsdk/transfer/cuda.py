"""``cuda``: the transfer worker for KV caches on a CUDA device.

- **Host pool**: the host tier's slab, page-locked (pinned) so copies are true
  asynchronous DMA; a slab that is not pinned yet is registered with
  ``cudaHostRegister`` (and unregistered at shutdown).
- **Streams**: one for loads (host → device), one for stores (device → host),
  so the two directions run at once on the two copy engines, and both beside
  the engine's compute stream.
- **Ordering**: at submit, an event is recorded on the caller's current
  (compute) stream and the transfer stream waits on it, so a store copies the
  blocks the compute queued so far has written, and a load never overtakes
  work already queued on its blocks.
- **Completion**: a CUDA event per job, polled with ``event.query()``;
  ``wait`` synchronizes only the asked jobs' events.
- **Batched copies** (plans in :mod:`kvsdk.transfer.layout`): a job's blocks, for
  all layers, are sorted and coalesced into runs contiguous on both sides.
  When runs are large (at least ``direct_min_run_bytes``, measured per device
  at register) each run is one ``cudaMemcpyAsync``. Otherwise the blocks are
  gathered (``index_select``) into a device staging buffer in slab order and
  moved by a few large copies (stores), or copied to staging and scattered
  (``index_copy_``) into the engine's blocks (loads): one kernel per row view,
  one view for all layers when the engine's layers share one allocation.
- **Failures**: a job with a bad id, an error while enqueuing, or a CUDA error
  surfacing in its event is reported ``ok=False`` (never raised into the
  engine); a job whose enqueue failed midway is reported only once what it
  queued has drained, so a recompute never races a half-done load.

``torch.cuda`` is touched only from ``register`` on, so this module imports
(and its plans are tested) on machines without CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsdk.hooks import hookimpl
from kvsdk.transfer import layout as kvl
from kvsdk.transfer.base import (
    BlockCopies,
    Direction,
    GroupLayers,
    TransferJob,
    TransferResult,
    TransferWorker,
    slab_span,
)
from kvsdk.transfer.cuda_runtime import CudaRuntime, JobTracker, StreamRuntime, cuda_module

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
"""Device staging buffer per direction; larger jobs go through it in pieces."""

DIRECT_PREFERENCE = 1.05
"""Copies per run win ties within 5%: they leave the SMs to the engine's
compute, where the gather kernels take a few."""

FALLBACK_DIRECT_MIN_RUN_BYTES = 1 << 20
"""Run size from which one copy per run beats gather + one copy, when it
could not be measured (see :func:`measure_direct_threshold`)."""


# -- device-side views ----------------------------------------------------------------


def _as_rows(storage: torch.UntypedStorage, device: torch.device, v: kvl.RowView) -> torch.Tensor:
    rows = torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, v.origin, (v.num_rows, v.row_bytes), (v.pitch, 1)
    )
    return rows


def _as_flat(storage: torch.UntypedStorage, device: torch.device, v: kvl.RowView) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, v.origin, (v.span_bytes,), (1,)
    )


def _widen(t: torch.Tensor) -> torch.Tensor:
    """uint8 rows as int64 rows (8x fewer elements for the gather kernels)."""
    return t.view(torch.int64)


def _can_widen(v: kvl.RowView) -> bool:
    return v.row_bytes % 8 == 0 and v.pitch % 8 == 0 and v.origin % 8 == 0


@dataclass
class _GroupState:
    layout: kvl.KVLayout
    blocks_per_chunk: int
    rows: list[torch.Tensor]
    """Per view: ``(num_rows, row)`` int64 (or uint8) rows for gathers/scatters."""
    flat: list[torch.Tensor]
    """Per view: its bytes from the origin, for direct run copies."""
    wide: list[bool]


class _Staging:
    """A device buffer reused by every job of one direction (stream-ordered)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def rows(self, row_bytes: int, wide: bool, first: int, count: int) -> torch.Tensor:
        t = self.buf[first * row_bytes : (first + count) * row_bytes].view(count, row_bytes)
        return _widen(t) if wide else t


# -- the worker -----------------------------------------------------------------------


class CUDATransferWorker(TransferWorker):
    """Moves KV blocks between an engine's CUDA paged tensors and the pinned slab.

    ``num_blocks`` settles the K/V-split-on-dim-0 ambiguity of 2-block caches;
    ``direct_min_run_bytes`` fixes the copy path threshold (None: measure it
    on the device at register); ``runtime`` replaces the CUDA runtime (tests)."""

    name = "cuda"

    def __init__(
        self,
        *,
        num_blocks: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        direct_min_run_bytes: int | None = None,
        loads_wait_for_compute: bool = True,
        runtime: StreamRuntime | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.staging_bytes = staging_bytes
        self.direct_min_run_bytes = direct_min_run_bytes
        self.loads_wait_for_compute = loads_wait_for_compute
        self._runtime = runtime
        self._rt: StreamRuntime | None = None
        self._groups: dict[int, _GroupState] = {}
        self._tracker = JobTracker()
        self._streams: dict[Direction, Any] = {}
        self._staging: dict[Direction, _Staging] = {}
        self._slab: torch.Tensor | None = None
        self._slab_flat: torch.Tensor | None = None
        self._pinned_here = False
        self._copy_many: Callable[[list[torch.Tensor], list[torch.Tensor]], None] = _copy_each
        self.stats = {"direct_jobs": 0, "staged_jobs": 0, "copies": 0, "gathers": 0}

    # -- setup ----------------------------------------------------------------------
    def register(self, groups: Sequence[GroupLayers], slab: torch.Tensor) -> None:
        if not groups:
            raise ValueError("no KV groups to register")
        device = groups[0].layers[0].device
        for g in groups:
            for t in g.layers:
                if t.device != device:
                    raise ValueError(f"KV group {g.group}: layers on {t.device} and {device}")
        slab_flat, slot_stride = slab_span(slab)  # rows may be strided: a rank's region
        if slab.device.type != "cpu":
            raise ValueError(f"the host slab must be in host memory, got {slab.device}")
        rt = self._runtime if self._runtime is not None else CudaRuntime(device)
        self._rt = rt
        num_slots, slot_bytes = int(slab.shape[0]), int(slab.shape[1])
        for g in groups:
            layout = kvl.kv_layout(g.layers, self.num_blocks)
            need = layout.chunk_bytes(g.blocks_per_chunk)
            if need > slot_bytes:
                raise ValueError(
                    f"group {g.group}: chunk of {need} B does not fit a {slot_bytes} B slot"
                )
            storages = {int(t.untyped_storage().data_ptr()): t.untyped_storage() for t in g.layers}
            rows, flat, wide = [], [], []
            for v in layout.views:
                st = storages[v.storage]
                w = _can_widen(v)
                r = _as_rows(st, device, v)
                rows.append(_widen(r) if w else r)
                flat.append(_as_flat(st, device, v))
                wide.append(w)
            self._groups[g.group] = _GroupState(layout, g.blocks_per_chunk, rows, flat, wide)
            log.info(
                "kvsdk cuda worker: group %d, %d layers x %d region(s) of %d B per block, "
                "%d row view(s)%s",
                g.group,
                layout.num_layers,
                layout.regions_per_block,
                layout.region_bytes,
                len(layout.views),
                " (all layers fused)" if layout.fused else "",
            )
        self._pinned_here = rt.pin(slab_flat)
        self._slab, self._slab_flat = slab_flat, slab_flat
        self._num_slots, self._slot_bytes = num_slots, slot_stride
        for d in Direction:
            self._streams[d] = rt.new_stream()
            self._staging[d] = _Staging(rt.empty(self.staging_bytes))
        if self._runtime is None:
            self._copy_many = _batched_copy_if_it_works(device)
            if self.direct_min_run_bytes is None:
                self.direct_min_run_bytes = _threshold_for(device)
        elif self.direct_min_run_bytes is None:
            self.direct_min_run_bytes = FALLBACK_DIRECT_MIN_RUN_BYTES

    # -- jobs -----------------------------------------------------------------------
    def submit(self, job: TransferJob) -> None:
        try:
            self._submit(job)
        except Exception as exc:  # never into the engine
            self._tracker.add(job.job_id, job.direction, 0, None, None, _describe(exc))

    def _submit(self, job: TransferJob) -> None:
        rt = self._rt
        if rt is None:
            raise RuntimeError("the cuda transfer worker is not registered (or shut down)")
        # validated and planned on the host first: a bad job queues nothing
        plans = [self._plan(job.direction, c) for c in job.copies if c.num_blocks]
        stream = self._streams[job.direction]
        start, end = rt.new_event(), rt.new_event()
        nbytes = 0
        error: str | None = None
        try:
            if job.direction is Direction.STORE or self.loads_wait_for_compute:
                rt.after_current(stream)
            with rt.use(stream):
                rt.record(start, stream)
                for enqueue in plans:
                    nbytes += enqueue()
        except Exception as exc:  # reported once what was queued has drained
            error = _describe(exc)
        rt.record(end, stream)
        self._tracker.add(job.job_id, job.direction, nbytes, start, end, error)

    def _plan(self, direction: Direction, c: BlockCopies) -> Callable[[], int]:
        """Validate and plan one group's copies on the host; the returned
        callable enqueues them on the current stream and returns the bytes."""
        state = self._groups.get(c.group)
        if state is None:
            raise KeyError(f"KV group {c.group} is not registered")
        pairs = kvl.job_pairs(
            state.layout,
            c.engine_blocks,
            c.slots,
            c.offsets,
            blocks_per_chunk=state.blocks_per_chunk,
            slot_bytes=self._slot_bytes,
            num_slots=self._num_slots,
        )
        direct = kvl.direct_plan(state.layout, pairs)
        threshold = self.direct_min_run_bytes or FALLBACK_DIRECT_MIN_RUN_BYTES
        if direct.mean_run_bytes >= threshold:
            return lambda: self._run_direct(direction, state, direct)
        staged = kvl.staged_plan(pairs, self.staging_bytes)
        return lambda: self._run_staged(direction, state, staged)

    def _run_direct(self, direction: Direction, state: _GroupState, plan: kvl.DirectPlan) -> int:
        assert self._slab_flat is not None
        slab = self._slab_flat
        engine, host = [], []
        for v, e, s, n in plan.runs.tolist():
            engine.append(state.flat[v][e : e + n])
            host.append(slab[s : s + n])
        if direction is Direction.STORE:
            self._copy_many(host, engine)
        else:
            self._copy_many(engine, host)
        self.stats["direct_jobs"] += 1
        self.stats["copies"] += len(engine)
        return plan.num_bytes

    def _run_staged(self, direction: Direction, state: _GroupState, plan: kvl.StagedPlan) -> int:
        assert self._slab_flat is not None
        slab = self._slab_flat
        staging = self._staging[direction]
        size = plan.row_bytes
        assert self._rt is not None
        # every gather's row ids in one host → device copy
        idx = self._rt.index_tensor(
            np.concatenate([g.rows for p in plan.pieces for g in p.gathers])
        )
        k = 0
        for piece in plan.pieces:
            buf = staging.buf
            spans = piece.runs.tolist()
            if direction is Direction.LOAD:
                self._copy_many(
                    [buf[o : o + n] for _, o, n in spans], [slab[s : s + n] for s, _, n in spans]
                )
            for g in piece.gathers:
                rows = state.rows[g.view]
                wide = state.wide[g.view]
                sel = idx[k : k + len(g.rows)]
                k += len(g.rows)
                stage = staging.rows(size, wide, g.staging_row, len(g.rows))
                if direction is Direction.STORE:
                    torch.index_select(rows, 0, sel, out=stage)
                else:
                    rows.index_copy_(0, sel, stage)
            if direction is Direction.STORE:
                self._copy_many(
                    [slab[s : s + n] for s, _, n in spans], [buf[o : o + n] for _, o, n in spans]
                )
            self.stats["copies"] += len(spans)
            self.stats["gathers"] += len(piece.gathers)
        self.stats["staged_jobs"] += 1
        return plan.num_bytes

    def wait(self, job_ids: Iterable[int]) -> None:
        self._tracker.wait(job_ids)

    def poll(self) -> list[TransferResult]:
        return self._tracker.poll()

    def shutdown(self) -> None:
        rt = self._rt
        if rt is None:
            return
        for s in self._streams.values():
            try:
                rt.synchronize(s)
            except Exception as exc:
                log.warning("kvsdk cuda worker: pending copies failed at shutdown: %s", exc)
        if self._pinned_here and self._slab is not None:
            try:
                rt.unpin(self._slab)
            except Exception as exc:
                log.warning("kvsdk cuda worker: could not unregister the host slab: %s", exc)
        self._pinned_here = False
        self._staging.clear()
        self._streams.clear()
        self._groups.clear()
        self._rt = None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _copy_each(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)


def _copy_foreach(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src, non_blocking=True)


def _batched_copy_if_it_works(
    device: torch.device,
) -> Callable[[list[torch.Tensor], list[torch.Tensor]], None]:
    """``torch._foreach_copy_`` (one call, a C++ loop of async copies) when this
    torch accepts host/device pairs in it; else a Python loop of ``copy_``."""
    try:
        dev = torch.arange(64, dtype=torch.uint8, device=device)
        host = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
        _copy_foreach([host[:32], host[32:]], [dev[32:], dev[:32]])
        torch.cuda.synchronize(device)
        if torch.equal(host[:32], dev[32:].cpu()) and torch.equal(host[32:], dev[:32].cpu()):
            return _copy_foreach
    except Exception as exc:
        log.debug("torch._foreach_copy_ across devices unavailable: %s", exc)
    return _copy_each


_thresholds: dict[int, int] = {}


def _threshold_for(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _thresholds:
        try:
            _thresholds[index] = measure_direct_threshold(device)
        except Exception as exc:
            log.warning(
                "kvsdk cuda worker: could not measure the copy threshold (%s); using %d B",
                exc,
                FALLBACK_DIRECT_MIN_RUN_BYTES,
            )
            _thresholds[index] = FALLBACK_DIRECT_MIN_RUN_BYTES
        log.info("kvsdk cuda worker: one copy per run from %d B runs", _thresholds[index])
    return _thresholds[index]


@dataclass(frozen=True)
class PathTiming:
    run_bytes: int
    direct_s: float
    staged_s: float


def time_copy_paths(
    device: torch.device,
    sizes: Sequence[int] = (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20),
    total_bytes: int = 32 << 20,
    repeats: int = 3,
) -> list[PathTiming]:
    """Device → pinned host, per run size: one copy per scattered run vs a gather
    into staging plus one copy (the two store paths), best of ``repeats``."""
    stream = cuda_module().Stream(device)
    src = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    staging = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
    copy_many = _batched_copy_if_it_works(device)
    out = []
    for size in sizes:
        n = total_bytes // size
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(size))
        idx = perm.to(device)
        wide = size % 8 == 0
        rows = src[: n * size].view(n, size)
        stage = staging[: n * size].view(n, size)
        if wide:
            rows, stage = rows.view(torch.int64), stage.view(torch.int64)
        dst = [host[i * size : (i + 1) * size] for i in range(n)]
        srcs = [src[p * size : (p + 1) * size] for p in perm.tolist()]

        def direct() -> None:
            copy_many(dst, srcs)  # noqa: B023

        def staged() -> None:
            torch.index_select(rows, 0, idx, out=stage)  # noqa: B023
            host[: n * size].copy_(staging[: n * size], non_blocking=True)  # noqa: B023

        best = {}
        for name, fn in (("direct", direct), ("staged", staged)):
            times = []
            for _ in range(repeats + 1):
                t0 = cuda_module().Event(enable_timing=True)
                t1 = cuda_module().Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    t0.record(stream)
                    fn()
                    t1.record(stream)
                t1.synchronize()
                times.append(t0.elapsed_time(t1) / 1e3)
            best[name] = min(times[1:])
        out.append(PathTiming(size, best["direct"], best["staged"]))
    return out


def measure_direct_threshold(device: torch.device) -> int:
    """Smallest run size from which one copy per run is about as fast as
    gather + one copy (within ``DIRECT_PREFERENCE``), for every larger size
    measured too."""
    timings = time_copy_paths(device)
    threshold = 1 << 62
    for t in reversed(timings):
        if t.direct_s <= t.staged_s * DIRECT_PREFERENCE:
            threshold = t.run_bytes
        else:
            break
    return threshold


@hookimpl
def kvsdk_transfer_workers() -> dict[str, Callable[..., TransferWorker]]:
    return {"cuda": CUDATransferWorker}
