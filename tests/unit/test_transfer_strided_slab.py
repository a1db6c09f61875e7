"""Transfer workers on one rank's region of a shared slab: a strided
``(num_slots, region_bytes)`` view whose rows are a whole slot apart. Stores
into region 1 and loads back from it move exactly the bytes the same copies
move on a contiguous slab, and never touch another rank's region."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# the CUDA worker's fake host runtime and cache layouts (tests/unit is on sys.path under pytest)
from test_transfer_cuda_cpu_parts import NB, block_bytes, caches, make_worker

import kvsdk.transfer.cpu
from kvsdk.slab import SharedSlab, SlabGeometry, segment_name
from kvsdk.transfer import (
    BlockCopies,
    Direction,
    GroupLayers,
    TransferJob,
    TransferWorker,
    slab_span,
)
from kvsdk.transfer.cpu import CPUTransferWorker

NUM_SLOTS, BPC, LAYERS = 6, 2, 3
STORE_BLOCKS = [3, 4, 9, 0, 6]
STORE_SLOTS = [2, 2, 5, 5, 0]
OFFSETS = [0, 1, 0, 1, 1]
LOAD_BLOCKS = [7, 8, 1, 11, 2]


def copies(blocks: list[int]) -> tuple[BlockCopies, ...]:
    return (
        BlockCopies(
            0,
            np.array(blocks, dtype=np.int64),
            np.array(STORE_SLOTS, dtype=np.int64),
            np.array(OFFSETS, dtype=np.int64),
        ),
    )


def run(w: TransferWorker, job: TransferJob) -> None:
    w.submit(job)
    w.wait([job.job_id])
    (r,) = w.poll()
    assert r.ok, r.error


def shared_slab(tmp_path: Path, region_bytes: int) -> SharedSlab:
    geometry = SlabGeometry(NUM_SLOTS, region_bytes, num_regions=2)
    return SharedSlab.create(segment_name(f"strided-{uuid.uuid4()}"), geometry, shm_dir=tmp_path)


def noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def roundtrip_on_region_1(
    tmp_path: Path,
    new_worker: Callable[[], TransferWorker],
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    chunk_bytes: int,
    extra_bytes: int,
) -> None:
    """Store ``src``'s blocks into region 1 of a 2-region slab and load them
    into ``dst``; the same store on a contiguous slab gives the same bytes."""
    region_bytes = chunk_bytes + extra_bytes
    slab = shared_slab(tmp_path, region_bytes)
    try:
        slab.tensor.copy_(noise(tuple(slab.tensor.shape), seed=7))  # every rank's old bytes
        before = slab.tensor.clone()
        region = slab.region(1)
        assert not region.is_contiguous() and slab_span(region)[1] == 2 * region_bytes

        w = new_worker()
        w.register([GroupLayers(0, tuple(src), BPC)], region)
        run(w, TransferJob(1, Direction.STORE, copies(STORE_BLOCKS)))

        contiguous = before[:, region_bytes:].clone()  # region 1's old bytes, unstrided
        assert contiguous.is_contiguous()
        wc = new_worker()
        wc.register([GroupLayers(0, tuple(src), BPC)], contiguous)
        run(wc, TransferJob(2, Direction.STORE, copies(STORE_BLOCKS)))

        # region 1 holds exactly what the contiguous slab holds; region 0 is untouched
        assert torch.equal(slab.tensor[:, :region_bytes], before[:, :region_bytes])
        assert torch.equal(region, contiguous)
        written = (region != before[:, region_bytes:]).any(dim=1)
        assert set(torch.nonzero(written).flatten().tolist()) <= set(STORE_SLOTS)
        assert torch.equal(region[:, chunk_bytes:], before[:, region_bytes + chunk_bytes :])

        dst_before = [t.clone() for t in dst]
        w2 = new_worker()
        w2.register([GroupLayers(0, tuple(dst), BPC)], slab.region(1))
        run(w2, TransferJob(3, Direction.LOAD, copies(LOAD_BLOCKS)))
        assert torch.equal(slab.tensor, torch.cat([before[:, :region_bytes], contiguous], dim=1))
        for layer in range(LAYERS):
            for s_blk, d_blk in zip(STORE_BLOCKS, LOAD_BLOCKS, strict=True):
                assert torch.equal(block_bytes(dst[layer], d_blk), block_bytes(src[layer], s_blk))
            for untouched in set(range(NB)) - set(LOAD_BLOCKS):
                assert torch.equal(
                    block_bytes(dst[layer], untouched), block_bytes(dst_before[layer], untouched)
                )
        for worker in (w, wc, w2):
            worker.shutdown()
    finally:
        slab.unlink()


# -- the CPU worker ----------------------------------------------------------------------------


def cpu_caches(kind: str, seed: int) -> list[torch.Tensor]:
    """Layer tensors with dim 0 = block id (the CPU worker's contract)."""
    if kind == "one_storage":  # vLLM's layout: the fused path, one gather per job
        return list(caches("one_allocation", LAYERS, seed))
    return caches("kv_dim1", LAYERS, seed)  # a tensor per layer: per-layer copies


@pytest.mark.parametrize("kind", ["one_storage", "per_layer"])
@pytest.mark.parametrize(
    "extra_bytes",
    [0, 512, 24, 4],  # slots a whole number of blocks; more blocks; not; not 8-aligned
)
@pytest.mark.parametrize("direct_copy_bytes", [0, 1 << 40])  # row runs / gather + scatter
@pytest.mark.parametrize("sync_stores", [True, False])
def test_cpu_worker_on_region_1_matches_a_contiguous_slab(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    extra_bytes: int,
    direct_copy_bytes: int,
    sync_stores: bool,
) -> None:
    monkeypatch.setattr(kvsdk.transfer.cpu, "DIRECT_COPY_BYTES", direct_copy_bytes)
    src, dst = cpu_caches(kind, seed=1), cpu_caches(kind, seed=2)
    chunk = GroupLayers(0, tuple(src), BPC).chunk_bytes
    roundtrip_on_region_1(
        tmp_path, lambda: CPUTransferWorker(sync_stores=sync_stores), src, dst, chunk, extra_bytes
    )


def test_cpu_worker_fast_path_engages_on_a_region(tmp_path: Path) -> None:
    """A region whose slot stride is a whole number of blocks still gets the
    fused row copies (the strided slab is not pushed onto the slow path)."""
    src = cpu_caches("one_storage", seed=1)
    g = GroupLayers(0, tuple(src), BPC)
    slab = shared_slab(tmp_path, g.chunk_bytes)
    try:
        plan = kvsdk.transfer.cpu._GroupPlan(g, slab.region(1))
        assert plan.slab_rows is not None and plan.engine_rows is not None
        assert plan.rows_per_slot == 2 * LAYERS * BPC  # both regions' rows per slot
    finally:
        slab.unlink()


def test_two_ranks_store_into_their_own_regions_side_by_side(tmp_path: Path) -> None:
    """Rank 0 and rank 1 store the same slots: each region gets its own rank's bytes."""
    rank_caches = [cpu_caches("one_storage", seed=10 + r) for r in range(2)]
    chunk = GroupLayers(0, tuple(rank_caches[0]), BPC).chunk_bytes
    slab = shared_slab(tmp_path, chunk)
    try:
        workers = []
        for r, layers in enumerate(rank_caches):
            w = CPUTransferWorker()
            w.register([GroupLayers(0, tuple(layers), BPC)], slab.region(r))
            run(w, TransferJob(r, Direction.STORE, copies(STORE_BLOCKS)))
            workers.append(w)
        for r, layers in enumerate(rank_caches):
            back = cpu_caches("one_storage", seed=99)
            w = CPUTransferWorker()
            w.register([GroupLayers(0, tuple(back), BPC)], slab.region(r))
            run(w, TransferJob(10 + r, Direction.LOAD, copies(LOAD_BLOCKS)))
            for layer in range(LAYERS):
                for s_blk, d_blk in zip(STORE_BLOCKS, LOAD_BLOCKS, strict=True):
                    assert torch.equal(
                        block_bytes(back[layer], d_blk), block_bytes(layers[layer], s_blk)
                    )
            workers.append(w)
        for w in workers:
            w.shutdown()
    finally:
        slab.unlink()


# -- the CUDA worker, through the synchronous host runtime -------------------------------------


@pytest.mark.parametrize(
    "kind", ["kv_dim0", "kv_dim1", "kv_dim0_hnd", "one_allocation", "cross_layer"]
)
@pytest.mark.parametrize("extra_bytes", [0, 24])
@pytest.mark.parametrize(
    "options",
    [
        {"direct_min_run_bytes": 1},
        {"direct_min_run_bytes": 1 << 40},
        {"direct_min_run_bytes": 1 << 40, "staging_bytes": 3 * 4 * 2 * 8 * 2},
    ],
    ids=["direct", "staged", "staged_in_pieces"],
)
def test_cuda_worker_on_region_1_matches_a_contiguous_slab(
    tmp_path: Path, kind: str, extra_bytes: int, options: dict[str, Any]
) -> None:
    src, dst = caches(kind, LAYERS, seed=1), caches(kind, LAYERS, seed=2)
    chunk = LAYERS * BPC * block_bytes(src[0], 0).numel()
    roundtrip_on_region_1(tmp_path, lambda: make_worker(**options)[0], src, dst, chunk, extra_bytes)


def test_cuda_worker_pins_the_region_span_once(tmp_path: Path) -> None:
    """The pinned range is region 1's span: from slot 0's region to the last
    slot's region end (the other rank's bytes in between, never past the slab)."""
    src = caches("kv_dim1", 1, seed=0)
    region_bytes = BPC * block_bytes(src[0], 0).numel()
    slab = shared_slab(tmp_path, region_bytes)
    try:
        w, rt = make_worker()
        w.register([GroupLayers(0, tuple(src), BPC)], slab.region(1))
        (pinned,) = rt.pinned
        assert pinned.data_ptr() == slab.tensor.data_ptr() + region_bytes
        end = pinned.data_ptr() + pinned.numel()
        assert end == slab.tensor.data_ptr() + slab.tensor.numel()
        w.shutdown()
        assert rt.unpinned == [pinned]
    finally:
        slab.unlink()
