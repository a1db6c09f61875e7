"""The CUDA transfer worker's device-independent parts, on CPU: job bookkeeping
with fake events, and the worker's planning and copy code driven through a
synchronous host runtime (same torch ops, CPU tensors, no streams)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from kvsdk.transfer import BlockCopies, Direction, GroupLayers, TransferJob
from kvsdk.transfer.cuda import (
    CUDATransferWorker,
    JobTracker,
    kvsdk_transfer_workers,
)

# -- job bookkeeping ----------------------------------------------------------------------


class FakeEvent:
    def __init__(self, done: bool = False, fail: str | None = None, ms: float = 2.0) -> None:
        self.done, self.fail, self.ms = done, fail, ms
        self.synced = 0
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        if self.fail:
            raise RuntimeError(self.fail)
        self.done = True

    def elapsed_time(self, end_event: Any) -> float:
        return self.ms


def test_poll_reports_finished_jobs_once_and_never_blocks() -> None:
    t = JobTracker()
    e1, e2 = FakeEvent(), FakeEvent()
    t.add(1, Direction.STORE, 100, FakeEvent(ms=4.0), e1)
    t.add(2, Direction.LOAD, 200, FakeEvent(), e2)
    assert t.poll() == [] and e1.synced == e2.synced == 0
    e2.done = True
    (r,) = t.poll()
    assert (r.job_id, r.direction, r.ok, r.num_bytes) == (2, Direction.LOAD, True, 200)
    assert r.seconds == pytest.approx(0.002)  # from the events, not the wall clock
    e1.done = True
    (r,) = t.poll()
    assert r.job_id == 1 and r.seconds == pytest.approx(0.004)
    assert t.poll() == [] and len(t) == 0


def test_wait_synchronizes_only_the_asked_jobs() -> None:
    t = JobTracker()
    events = {j: FakeEvent() for j in (1, 2, 3)}
    for j, e in events.items():
        t.add(j, Direction.STORE, 1, FakeEvent(), e)
    t.wait([2, 99])  # unknown ids are ignored
    assert [events[j].synced for j in (1, 2, 3)] == [0, 1, 0]
    assert [r.job_id for r in t.poll()] == [2]


def test_a_cuda_error_in_a_job_is_reported_failed_not_raised() -> None:
    t = JobTracker()
    t.add(
        1, Direction.LOAD, 10, FakeEvent(), FakeEvent(fail="CUDA error: an illegal memory access")
    )
    t.add(2, Direction.STORE, 10, FakeEvent(), FakeEvent(done=True))
    results = {r.job_id: r for r in t.poll()}
    assert not results[1].ok and "illegal memory access" in (results[1].error or "")
    assert results[2].ok


def test_wait_keeps_a_sync_error_for_poll() -> None:
    t = JobTracker()
    t.add(1, Direction.STORE, 10, FakeEvent(), FakeEvent(fail="CUDA error: launch failure"))
    t.wait([1])
    (r,) = t.poll()
    assert not r.ok and "launch failure" in (r.error or "")


def test_a_job_that_failed_while_enqueuing_is_reported_after_its_queued_work() -> None:
    t = JobTracker()
    end = FakeEvent()
    t.add(1, Direction.LOAD, 10, FakeEvent(), end, error="RuntimeError: boom")
    t.add(2, Direction.LOAD, 0, None, None, error="ValueError: bad id")  # nothing queued
    (r,) = t.poll()
    assert r.job_id == 2 and not r.ok
    end.done = True
    (r,) = t.poll()
    assert r.job_id == 1 and not r.ok and r.error == "RuntimeError: boom"


# -- the worker through a host runtime ------------------------------------------------------


class HostRuntime:
    """Runs every copy at once on the CPU; records the ordering calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.streams: list[str] = []
        self.pinned: list[torch.Tensor] = []
        self.unpinned: list[torch.Tensor] = []
        self.current: str | None = None

    def new_stream(self) -> str:
        self.streams.append(f"stream{len(self.streams)}")
        return self.streams[-1]

    @contextmanager
    def _use(self, stream: str) -> Iterator[None]:
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def use(self, stream: Any) -> Any:
        return self._use(stream)

    def new_event(self) -> FakeEvent:
        return FakeEvent(done=True)

    def record(self, event: Any, stream: Any) -> None:
        self.calls.append(("record", stream))

    def after_current(self, stream: Any) -> None:
        self.calls.append(("after_current", stream))

    def pin(self, t: torch.Tensor) -> bool:
        self.pinned.append(t)
        return True

    def unpin(self, t: torch.Tensor) -> None:
        self.unpinned.append(t)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xEE, dtype=torch.uint8)

    def index_tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a)

    def synchronize(self, stream: Any) -> None:
        self.calls.append(("synchronize", stream))


NB, N, H, D = 12, 4, 2, 8


def caches(kind: str, layers: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g).view(
            torch.float16
        )

    if kind == "kv_dim0":  # FlashAttention: (2, num_blocks, ...), one allocation per layer
        return [rnd(2, NB, N, H, D) for _ in range(layers)]
    if kind == "kv_dim1":  # FlashInfer: (num_blocks, 2, ...)
        return [rnd(NB, 2, N, H, D) for _ in range(layers)]
    if kind == "kv_dim0_hnd":
        return [rnd(2, NB, H, N, D).permute(0, 1, 3, 2, 4) for _ in range(layers)]
    if kind == "one_allocation":  # all layers in one storage: fused
        return list(rnd(layers, NB, 2, N, H, D).unbind(0))
    if kind == "cross_layer":  # block-outermost
        big = rnd(NB, layers, 2, N, H, D)
        return [big[:, i] for i in range(layers)]
    raise AssertionError(kind)


def block_bytes(t: torch.Tensor, b: int) -> torch.Tensor:
    """Bytes of block ``b`` of a layer in the slot's order (K then V)."""
    parts = [t[0, b], t[1, b]] if t.shape[0] == 2 and t.shape[1] == NB else [t[b]]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def make_worker(**kw: Any) -> tuple[CUDATransferWorker, HostRuntime]:
    rt = HostRuntime()
    kw.setdefault("staging_bytes", 1 << 16)
    return CUDATransferWorker(runtime=rt, **kw), rt


def job(
    job_id: int,
    direction: Direction,
    blocks: list[int],
    slots: list[int],
    offsets: list[int],
    group: int = 0,
) -> TransferJob:
    return TransferJob(
        job_id,
        direction,
        (
            BlockCopies(
                group,
                np.array(blocks, dtype=np.int64),
                np.array(slots, dtype=np.int64),
                np.array(offsets, dtype=np.int64),
            ),
        ),
    )


@pytest.mark.parametrize(
    "kind", ["kv_dim0", "kv_dim1", "kv_dim0_hnd", "one_allocation", "cross_layer"]
)
@pytest.mark.parametrize(
    ("path", "options"),
    [
        ("direct", {"direct_min_run_bytes": 1}),
        ("staged", {"direct_min_run_bytes": 1 << 40}),
        ("staged", {"direct_min_run_bytes": 1 << 40, "staging_bytes": 3 * N * H * D * 2}),
    ],
)
def test_store_then_load_moves_exact_bytes(kind: str, path: str, options: dict[str, int]) -> None:
    L, bpc = 3, 2
    src = caches(kind, L, seed=1)
    dst = caches(kind, L, seed=2)
    dst_before = [t.clone() for t in dst]
    w, _rt = make_worker(**options)
    slot_bytes = L * bpc * block_bytes(src[0], 0).numel() + 16
    slab = torch.zeros((5, slot_bytes), dtype=torch.uint8)
    w.register([GroupLayers(0, tuple(src), bpc)], slab)
    store = job(1, Direction.STORE, [3, 4, 9, 0], [2, 2, 4, 4], [0, 1, 0, 1])
    w.submit(store)
    w.wait([1])
    (r,) = w.poll()
    assert r.ok, r.error
    assert r.num_bytes == 4 * L * block_bytes(src[0], 0).numel()
    assert w.stats[f"{path}_jobs"] == 1
    w2, _ = make_worker(**options)
    w2.register([GroupLayers(0, tuple(dst), bpc)], slab)
    w2.submit(job(2, Direction.LOAD, [7, 8, 1, 11], [2, 2, 4, 4], [0, 1, 0, 1]))
    (r,) = w2.poll()
    assert r.ok, r.error
    for layer in range(L):
        for s_blk, d_blk in ((3, 7), (4, 8), (9, 1), (0, 11)):
            assert torch.equal(block_bytes(dst[layer], d_blk), block_bytes(src[layer], s_blk))
        for untouched in (0, 2, 3, 4, 5, 6, 9, 10):
            assert torch.equal(
                block_bytes(dst[layer], untouched), block_bytes(dst_before[layer], untouched)
            )
    assert int(slab[[0, 1, 3]].sum()) == 0
    w.shutdown()
    w2.shutdown()


def test_stores_and_loads_wait_for_compute_on_their_own_streams() -> None:
    w, rt = make_worker()
    t = caches("kv_dim1", 1, 0)
    w.register(
        [GroupLayers(0, tuple(t), 1)],
        torch.zeros((4, block_bytes(t[0], 0).numel()), dtype=torch.uint8),
    )
    load_stream, store_stream = rt.streams  # one per direction
    assert load_stream != store_stream
    rt.calls.clear()
    w.submit(job(1, Direction.STORE, [1], [0], [0]))
    assert rt.calls[:2] == [("after_current", store_stream), ("record", store_stream)]
    rt.calls.clear()
    w.submit(job(2, Direction.LOAD, [2], [0], [0]))
    assert rt.calls[:2] == [("after_current", load_stream), ("record", load_stream)]
    assert {r.job_id for r in w.poll()} == {1, 2}


def test_bad_jobs_are_reported_failed_and_queue_nothing() -> None:
    w, rt = make_worker()
    t = caches("kv_dim0", 2, 0)
    before = [x.clone() for x in t]
    w.register(
        [GroupLayers(0, tuple(t), 1)],
        torch.zeros((4, 2 * block_bytes(t[0], 0).numel()), dtype=torch.uint8),
    )
    rt.calls.clear()
    w.submit(job(1, Direction.LOAD, [NB], [0], [0]))  # no such block
    w.submit(job(2, Direction.LOAD, [0], [0], [0], group=5))  # no such group
    w.submit(job(3, Direction.LOAD, [0], [4], [0]))  # no such slot
    assert rt.calls == []
    results = {r.job_id: r for r in w.poll()}
    assert not any(r.ok for r in results.values())
    assert "engine block 12" in (results[1].error or "")
    assert "group 5" in (results[2].error or "")
    assert "slot 4" in (results[3].error or "")
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(t, before, strict=True)
    )


def test_an_error_while_enqueuing_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = make_worker(direct_min_run_bytes=1 << 40)
    t = caches("kv_dim1", 1, 0)
    w.register(
        [GroupLayers(0, tuple(t), 1)],
        torch.zeros((4, block_bytes(t[0], 0).numel()), dtype=torch.uint8),
    )

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch, "index_select", boom)
    w.submit(job(1, Direction.STORE, [1], [0], [0]))
    (r,) = w.poll()
    assert not r.ok and "out of memory" in (r.error or "")


def test_submit_before_register_is_a_failed_job() -> None:
    w, _ = make_worker()
    w.submit(job(1, Direction.STORE, [1], [0], [0]))
    (r,) = w.poll()
    assert not r.ok and "not registered" in (r.error or "")


def test_a_slab_pinned_at_register_is_unpinned_at_shutdown() -> None:
    w, rt = make_worker()
    t = caches("kv_dim1", 1, 0)
    slab = torch.zeros((4, block_bytes(t[0], 0).numel()), dtype=torch.uint8)
    w.register([GroupLayers(0, tuple(t), 1)], slab)
    (pinned,) = rt.pinned  # the slab's bytes, as one span
    assert (pinned.data_ptr(), pinned.numel()) == (slab.data_ptr(), slab.numel())
    w.shutdown()
    assert rt.unpinned == [pinned]
    assert ("synchronize", rt.streams[0]) in rt.calls


def test_a_chunk_that_does_not_fit_a_slot_fails_at_register() -> None:
    w, _ = make_worker()
    t = caches("kv_dim0", 2, 0)
    with pytest.raises(ValueError, match="does not fit"):
        w.register([GroupLayers(0, tuple(t), 2)], torch.zeros((4, 100), dtype=torch.uint8))


def test_the_cuda_worker_needs_cuda_tensors() -> None:
    w = CUDATransferWorker()
    t = caches("kv_dim1", 1, 0)
    with pytest.raises(ValueError, match="CUDA device"):
        w.register([GroupLayers(0, tuple(t), 1)], torch.zeros((4, 4096), dtype=torch.uint8))


def test_registers_as_the_cuda_transfer_worker() -> None:
    assert kvsdk_transfer_workers() == {"cuda": CUDATransferWorker}


def test_importing_touches_neither_cuda_nor_the_backends() -> None:
    code = (
        "import sys, torch, kvsdk.transfer.cuda, kvsdk.transfer.layout\n"
        "assert not torch.cuda.is_initialized()\n"
        "bad = [m for m in sys.modules if m.startswith('kvsdk.backends')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
