"""The CUDA transfer worker on a real device: byte-exact round trips for the
vLLM GPU KV layouts and several block sizes on both copy paths, loads and
stores at once, stores ordered after the compute that wrote the blocks (with
a negative control), non-blocking polls, and failures reported per job.

Run on a GPU host with ``scripts/gpu_check.sh``; skips cleanly without CUDA."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from kvsdk.transfer import BlockCopies, Direction, GroupLayers, TransferJob, TransferResult
from kvsdk.transfer.cuda import CudaRuntime, CUDATransferWorker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda", 0)
NB = 48  # blocks per layer
TOKENS = 16

# bytes of one layer's block (K and V) → (tokens, kv heads, head size) in fp16
BLOCK_SIZES = {
    "16KB": (16, 2, 128),
    "64KB": (16, 8, 128),
    "256KB": (16, 32, 128),
    "1MB": (64, 32, 128),
}


def caches(kind: str, layers: int, n: int, h: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        t = torch.randint(-30000, 30000, shape, dtype=torch.int16, device=DEV, generator=g)
        return t.view(torch.float16)

    if kind == "kv_dim0":  # FlashAttention: (2, num_blocks, N, H, D), one allocation per layer
        return [rnd(2, NB, n, h, d) for _ in range(layers)]
    if kind == "kv_dim0_hnd":  # the same with the HND stride order
        return [rnd(2, NB, h, n, d).permute(0, 1, 3, 2, 4) for _ in range(layers)]
    if kind == "kv_dim1":  # FlashInfer / Triton: (num_blocks, 2, N, H, D)
        return [rnd(NB, 2, n, h, d) for _ in range(layers)]
    if kind == "one_allocation":  # all layers in one storage (vLLM >= 0.32): fused
        return list(rnd(layers, NB, 2, n, h, d).unbind(0))
    if kind == "cross_layer":  # block-outermost: a block's layers contiguous
        big = rnd(NB, layers, 2, n, h, d)
        return [big[:, i] for i in range(layers)]
    raise AssertionError(kind)


def block_bytes(t: torch.Tensor, b: int) -> torch.Tensor:
    """Block ``b`` of one layer in the slot's byte order (K then V)."""
    parts = [t[0, b], t[1, b]] if t.shape[0] == 2 and t.shape[1] == NB else [t[b]]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def job(
    job_id: int, direction: Direction, blocks: list[int], slots: list[int], offsets: list[int]
) -> TransferJob:
    arr = [np.asarray(x, dtype=np.int64) for x in (blocks, slots, offsets)]
    return TransferJob(job_id, direction, (BlockCopies(0, *arr),))


def finish(w: CUDATransferWorker, ids: list[int]) -> dict[int, TransferResult]:
    w.wait(ids)
    results = {r.job_id: r for r in w.poll()}
    assert set(ids) <= set(results), results
    return results


PATHS: dict[str, dict[str, Any]] = {
    "measured": {},
    "direct": {"direct_min_run_bytes": 1},
    "staged": {"direct_min_run_bytes": 1 << 50},
    "staged_pieces": {"direct_min_run_bytes": 1 << 50, "staging_bytes": 3 << 20},
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("size", sorted(BLOCK_SIZES))
@pytest.mark.parametrize(
    "kind", ["kv_dim0", "kv_dim0_hnd", "kv_dim1", "one_allocation", "cross_layer"]
)
def test_round_trip_is_byte_exact(kind: str, size: str, path: str) -> None:
    layers, bpc = 3, 4
    n, h, d = BLOCK_SIZES[size]
    src = caches(kind, layers, n, h, d, seed=1)
    dst = caches(kind, layers, n, h, d, seed=2)
    dst_before = [torch.cat([block_bytes(t, b) for b in range(NB)]) for t in dst]
    bb = block_bytes(src[0], 0).numel()
    slab = torch.zeros((6, layers * bpc * bb), dtype=torch.uint8, pin_memory=True)
    store_blocks = [5, 6, 7, 8, 30, 2, 41, 17]  # one run of 4, then scattered
    slots, offsets = [4] * 4 + [1] * 4, [0, 1, 2, 3] * 2
    w = CUDATransferWorker(**PATHS[path])
    w.register([GroupLayers(0, tuple(src), bpc)], slab)
    w.submit(job(1, Direction.STORE, store_blocks, slots, offsets))
    r = finish(w, [1])[1]
    assert r.ok, r.error
    assert r.num_bytes == len(store_blocks) * layers * bb and r.seconds > 0
    for b, s, o in zip(store_blocks, slots, offsets, strict=True):
        want = torch.cat([block_bytes(t, b) for t in src]).view(layers, bb).cpu()
        assert torch.equal(slab[s].view(layers, bpc, bb)[:, o], want)
    assert int(slab[[0, 2, 3, 5]].sum()) == 0
    w2 = CUDATransferWorker(**PATHS[path])
    w2.register([GroupLayers(0, tuple(dst), bpc)], slab)
    load_blocks = [40, 12, 13, 14, 0, 1, 2, 47]
    w2.submit(job(2, Direction.LOAD, load_blocks, slots, offsets))
    assert finish(w2, [2])[2].ok
    loaded = dict(zip(load_blocks, store_blocks, strict=True))
    for li in range(layers):
        for b in range(NB):
            got = block_bytes(dst[li], b)
            if b in loaded:
                assert torch.equal(got, block_bytes(src[li], loaded[b])), (li, b)
            else:
                assert torch.equal(got, dst_before[li][b * bb : (b + 1) * bb]), (li, b)
    w.shutdown()
    w2.shutdown()


def test_a_pageable_slab_is_pinned_for_the_worker_and_released_after() -> None:
    src = caches("kv_dim1", 2, 16, 8, 128, seed=3)
    bb = block_bytes(src[0], 0).numel()
    slab = torch.zeros((2, 2 * bb), dtype=torch.uint8)
    assert not slab.is_pinned()
    w = CUDATransferWorker()
    w.register([GroupLayers(0, tuple(src), 1)], slab)
    assert slab.is_pinned()
    w.submit(job(1, Direction.STORE, [9, 3], [0, 1], [0, 0]))
    assert finish(w, [1])[1].ok
    assert torch.equal(slab[1].view(2, bb)[1], block_bytes(src[1], 3).cpu())
    w.shutdown()
    assert not slab.is_pinned()


def test_loads_and_stores_run_at_the_same_time() -> None:
    layers, bpc = 4, 4
    n, h, d = 64, 32, 128  # 1 MB blocks: 192 MB per direction
    a = caches("one_allocation", layers, n, h, d, seed=4)
    b = caches("one_allocation", layers, n, h, d, seed=5)
    bb = block_bytes(a[0], 0).numel()
    chunks = NB // bpc
    slab = torch.zeros((2 * chunks, layers * bpc * bb), dtype=torch.uint8, pin_memory=True)
    w = CUDATransferWorker()
    w.register([GroupLayers(0, tuple(a), bpc), GroupLayers(1, tuple(b), bpc)], slab)
    blocks = np.arange(NB, dtype=np.int64)
    offs = np.tile(np.arange(bpc, dtype=np.int64), chunks)
    store_slots = np.repeat(np.arange(chunks, dtype=np.int64), bpc)
    load_slots = store_slots + chunks

    def store(j: int) -> TransferJob:
        return TransferJob(j, Direction.STORE, (BlockCopies(0, blocks, store_slots, offs),))

    def load(j: int) -> TransferJob:
        return TransferJob(j, Direction.LOAD, (BlockCopies(1, blocks, load_slots, offs),))

    def timed(*jobs: TransferJob) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for j in jobs:
            w.submit(j)
        results = finish(w, [j.job_id for j in jobs])
        assert all(r.ok for r in results.values())
        return time.perf_counter() - t0

    timed(store(1), load(2))  # warm up
    sequential = min(timed(store(10 + 2 * i)) + timed(load(11 + 2 * i)) for i in range(3))
    together = min(timed(store(20 + 2 * i), load(21 + 2 * i)) for i in range(3))
    print(
        f"\nstore+load of {NB * layers * bb / 2**20:.0f} MiB each: sequential "
        f"{sequential * 1e3:.1f} ms, together {together * 1e3:.1f} ms"
    )
    assert together < 0.9 * sequential
    for li in range(layers):
        assert torch.equal(
            slab[:chunks].view(chunks, layers, bpc, bb)[:, li].reshape(NB, bb).to(DEV),
            torch.stack([block_bytes(a[li], i) for i in range(NB)]),
        )
    w.shutdown()


class UnorderedRuntime(CudaRuntime):
    """The negative control: transfers do not wait for the compute stream."""

    def after_current(self, stream: Any) -> None:
        return None


def slow_then_write(layer: torch.Tensor, block: int, value: int) -> None:
    """On the compute stream: ~50 ms of spinning (1e8 cycles), then a kernel
    writes the block; returns before either has run."""
    torch.cuda._sleep(int(100e6))  # type: ignore[no-untyped-call]
    layer[block].fill_(value)


@pytest.mark.parametrize("ordered", [True, False])
def test_a_store_captures_what_the_compute_before_it_wrote(ordered: bool) -> None:
    layer = torch.zeros((NB, 2, 16, 8, 128), dtype=torch.float16, device=DEV)
    bb = block_bytes(layer, 0).numel()
    slab = torch.zeros((2, bb), dtype=torch.uint8, pin_memory=True)
    runtime = None if ordered else UnorderedRuntime(DEV)
    w = CUDATransferWorker(runtime=runtime)
    w.register([GroupLayers(0, (layer,), 1)], slab)
    slow_then_write(layer, 7, 3)  # queued, not run yet
    w.submit(job(1, Direction.STORE, [7], [1], [0]))
    assert finish(w, [1])[1].ok
    torch.cuda.synchronize()
    want = torch.full((bb // 2,), 3, dtype=torch.float16).view(torch.uint8)
    if ordered:
        assert torch.equal(slab[1], want)
    else:  # without the wait the copy overtakes the compute: the test can tell
        assert int(slab[1].sum()) == 0
    w.shutdown()


def test_a_load_lands_after_the_compute_queued_before_it() -> None:
    layer = torch.zeros((NB, 2, 16, 8, 128), dtype=torch.float16, device=DEV)
    bb = block_bytes(layer, 0).numel()
    slab = torch.full((1, bb), 0x11, dtype=torch.uint8, pin_memory=True)
    w = CUDATransferWorker()
    w.register([GroupLayers(0, (layer,), 1)], slab)
    slow_then_write(layer, 4, 9)  # an older write to the block the load fills
    w.submit(job(1, Direction.LOAD, [4], [0], [0]))
    assert finish(w, [1])[1].ok
    torch.cuda.synchronize()
    assert torch.equal(block_bytes(layer, 4).cpu(), slab[0])
    w.shutdown()


def test_poll_does_not_block_on_unfinished_jobs() -> None:
    layer = torch.zeros((NB, 2, 16, 8, 128), dtype=torch.float16, device=DEV)
    bb = block_bytes(layer, 0).numel()
    slab = torch.zeros((1, bb), dtype=torch.uint8, pin_memory=True)
    w = CUDATransferWorker()
    w.register([GroupLayers(0, (layer,), 1)], slab)
    slow_then_write(layer, 1, 5)
    w.submit(job(1, Direction.STORE, [1], [0], [0]))
    t0 = time.perf_counter()
    assert w.poll() == []  # the store waits behind ~50 ms of compute
    assert time.perf_counter() - t0 < 0.01
    assert finish(w, [1])[1].ok
    w.shutdown()


def test_failed_jobs_are_reported_and_the_worker_keeps_going() -> None:
    src = caches("kv_dim0", 2, 16, 8, 128, seed=6)
    before = [t.clone() for t in src]
    bb = block_bytes(src[0], 0).numel()
    slab = torch.zeros((2, 2 * bb), dtype=torch.uint8, pin_memory=True)
    w = CUDATransferWorker()
    w.register([GroupLayers(0, tuple(src), 1)], slab)
    w.submit(job(1, Direction.LOAD, [NB + 3], [0], [0]))  # no such block
    w.submit(job(2, Direction.LOAD, [0], [2], [0]))  # no such slot
    bad_group = TransferJob(3, Direction.STORE, (BlockCopies(9, *([np.zeros(1, np.int64)] * 3)),))
    w.submit(bad_group)
    w.submit(job(4, Direction.STORE, [5], [1], [0]))  # a good one after them
    results = finish(w, [1, 2, 3, 4])
    assert [results[j].ok for j in (1, 2, 3, 4)] == [False, False, False, True]
    assert all(results[j].error for j in (1, 2, 3))
    torch.cuda.synchronize()
    for t, b in zip(src, before, strict=True):
        assert torch.equal(t.view(torch.int16), b.view(torch.int16))
    w.shutdown()
    w.submit(job(5, Direction.STORE, [5], [1], [0]))  # after shutdown: failed, not raised
    (r,) = w.poll()
    assert not r.ok
