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

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

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

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
"""Device staging buffer per direction; larger jobs go through it in pieces."""

DIRECT_PREFERENCE = 1.05
"""Copies per run win ties within 5%: they leave the SMs to the engine's
compute, where the gather kernels take a few."""

FALLBACK_DIRECT_MIN_RUN_BYTES = 1 << 20
"""Run size from which one copy per run beats gather + one copy, when it
could not be measured (see :func:`measure_direct_threshold`)."""


# -- the device seam ------------------------------------------------------------------


def _cuda() -> Any:
    """``torch.cuda``, reached only when a CUDA worker is set up (untyped: its
    stream/event constructors carry no annotations)."""
    return torch.cuda


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class StreamRuntime(Protocol):
    """What the worker needs from a device runtime; :class:`CudaRuntime` is the
    real one (tests drive the same worker code with a synchronous host one)."""

    def new_stream(self) -> Any: ...

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...

    def new_event(self) -> Event: ...

    def record(self, event: Event, stream: Any) -> None: ...

    def after_current(self, stream: Any) -> None:
        """Make ``stream`` wait for the work queued so far on the current stream."""

    def pin(self, t: torch.Tensor) -> bool:
        """Page-lock ``t`` unless it is; True when this call registered it."""

    def unpin(self, t: torch.Tensor) -> None: ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer on the device."""

    def index_tensor(self, a: np.ndarray) -> torch.Tensor:
        """Row ids on the device, copied in the current stream's order."""

    def synchronize(self, stream: Any) -> None: ...


class CudaRuntime:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"the cuda transfer worker needs KV tensors on a CUDA device, got {device}"
            )
        self.device = device

    def new_stream(self) -> Any:
        return _cuda().Stream(self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> Event:
        event: Event = _cuda().Event(enable_timing=True)
        return event

    def record(self, event: Event, stream: Any) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.record(stream)

    def after_current(self, stream: Any) -> None:
        ready = _cuda().Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.wait_event(ready)

    def pin(self, t: torch.Tensor) -> bool:
        if t.is_pinned():
            return False
        nbytes = t.numel() * t.element_size()
        # 1 = cudaHostRegisterPortable: pinned for every CUDA context of the process
        err = int(_cuda().cudart().cudaHostRegister(t.data_ptr(), nbytes, 1))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of the {nbytes} B host slab failed: error {err}")
        return True

    def unpin(self, t: torch.Tensor) -> None:
        _cuda().cudart().cudaHostUnregister(t.data_ptr())

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def index_tensor(self, a: np.ndarray) -> torch.Tensor:
        # through torch's pinned block cache: a true async copy that never waits
        # for the stream, and the block is not reused before the copy is done
        return torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()


# -- job bookkeeping ------------------------------------------------------------------


@dataclass
class _Pending:
    job_id: int
    direction: Direction
    num_bytes: int
    start: Event | None
    end: Event | None
    submitted: float
    error: str | None = None


class JobTracker:
    """Jobs in flight and their completion events; never blocks in ``poll``."""

    def __init__(self) -> None:
        self._jobs: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def add(
        self,
        job_id: int,
        direction: Direction,
        num_bytes: int,
        start: Event | None,
        end: Event | None,
        error: str | None = None,
    ) -> None:
        """A job queued up to ``end`` (None: nothing was queued). With an
        ``error`` it is reported failed, once ``end`` (if any) has completed."""
        self._jobs[job_id] = _Pending(
            job_id, direction, num_bytes, start, end, time.perf_counter(), error
        )

    def _finish(self, p: _Pending, error: str | None) -> TransferResult:
        err = p.error or error
        seconds = time.perf_counter() - p.submitted
        if err is None and p.start is not None and p.end is not None:
            with contextlib.suppress(Exception):  # timing is best effort
                seconds = p.start.elapsed_time(p.end) / 1e3
        return TransferResult(p.job_id, p.direction, err is None, p.num_bytes, seconds, err)

    def poll(self) -> list[TransferResult]:
        done: list[TransferResult] = []
        for job_id, p in list(self._jobs.items()):
            try:
                finished = p.end is None or p.end.query()
                error = None
            except Exception as exc:  # a CUDA error surfacing in this job
                finished, error = True, f"{type(exc).__name__}: {exc}"
            if finished:
                del self._jobs[job_id]
                done.append(self._finish(p, error))
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs' events complete; errors are kept for ``poll``."""
        for j in job_ids:
            p = self._jobs.get(j)
            if p is None or p.end is None:
                continue
            try:
                p.end.synchronize()
            except Exception as exc:
                p.error = p.error or f"{type(exc).__name__}: {exc}"
                p.end = None


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
    stream = _cuda().Stream(device)
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
                t0 = _cuda().Event(enable_timing=True)
                t1 = _cuda().Event(enable_timing=True)
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
