"""The CPU transfer worker moves whole blocks between paged tensors and slots, exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsdk.transfer import BlockCopies, Direction, GroupLayers, TransferJob
from kvsdk.transfer.cpu import CPUTransferWorker


def roundtrip(
    block_shape: tuple[int, ...],
    num_layers: int,
    bpc: int,
    extra_slot_bytes: int,
    shared: bool,
    sync_stores: bool = False,
) -> None:
    gen = torch.Generator().manual_seed(0)
    if shared:  # vLLM's layout: every layer a view of one storage
        big = torch.randint(
            0, 255, (num_layers, 64, *block_shape), dtype=torch.uint8, generator=gen
        )
        src = list(big.unbind(0))
        dst = list(torch.zeros_like(big).unbind(0))
    else:
        src = [
            torch.randint(0, 255, (64, *block_shape), dtype=torch.uint8, generator=gen)
            for _ in range(num_layers)
        ]
        dst = [torch.zeros_like(t) for t in src]
    g_src = GroupLayers(0, tuple(src), bpc)
    slab = torch.zeros((32, g_src.chunk_bytes + extra_slot_bytes), dtype=torch.uint8)
    blocks = np.array([5, 9, 1, 33, 60, 2], dtype=np.int64)[: 2 * bpc]
    slots = np.repeat(np.array([7, 3], dtype=np.int64), bpc)
    offsets = np.tile(np.arange(bpc, dtype=np.int64), 2)
    copies = (BlockCopies(0, blocks, slots, offsets),)
    w = CPUTransferWorker(sync_stores=sync_stores)
    w.register([g_src], slab)
    w.submit(TransferJob(1, Direction.STORE, copies))
    w.wait([1])
    (res,) = w.poll()
    assert res.ok and res.num_bytes == len(blocks) * num_layers * g_src.block_bytes
    w2 = CPUTransferWorker()
    w2.register([GroupLayers(0, tuple(dst), bpc)], slab)
    targets = np.array([11, 12, 13, 14, 15, 16], dtype=np.int64)[: 2 * bpc]
    w2.submit(TransferJob(2, Direction.LOAD, (BlockCopies(0, targets, slots, offsets),)))
    w2.wait([2])
    assert w2.poll()[0].ok
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[torch.from_numpy(targets)], s[torch.from_numpy(blocks)])
        assert int(d[0].sum()) == 0  # nothing else written
    w.shutdown()
    w2.shutdown()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(
    ("block_shape", "layers", "bpc", "extra"),
    [
        ((2, 4, 8), 3, 2, 0),  # rows of int64: the fast path
        ((3, 4), 2, 1, 0),  # 12-byte blocks: uint8 rows
        ((2, 4, 8), 2, 2, 40),  # slot larger than the chunk and not a multiple of a block
    ],
)
@pytest.mark.parametrize("sync_stores", [False, True])
def test_store_then_load_copies_exact_blocks(
    block_shape: tuple[int, ...], layers: int, bpc: int, extra: int, shared: bool, sync_stores: bool
) -> None:
    roundtrip(block_shape, layers, bpc, extra, shared, sync_stores)


def test_a_failing_copy_is_reported_not_raised() -> None:
    t = torch.zeros((4, 16), dtype=torch.uint8)
    w = CPUTransferWorker()
    w.register([GroupLayers(0, (t,), 1)], torch.zeros((2, 16), dtype=torch.uint8))
    bad = BlockCopies(0, np.array([99]), np.array([0]), np.array([0]))  # no block 99
    w.submit(TransferJob(3, Direction.LOAD, (bad,)))
    w.wait([3])
    (res,) = w.poll()
    assert not res.ok and res.error
    w.shutdown()


def test_jobs_larger_than_the_gather_buffer_go_through_it_in_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvsdk.transfer.cpu

    monkeypatch.setattr(kvsdk.transfer.cpu, "STAGE_BYTES", 1)  # one row per piece
    roundtrip((2, 4, 8), 3, 2, 0, shared=True)


def test_row_runs_cover_every_pair_once_with_constant_steps() -> None:
    from kvsdk.transfer.cpu import row_runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        src = np.cumsum(rng.integers(-2, 4, n)).tolist()
        dst = np.cumsum(rng.integers(-2, 4, n)).tolist()
        pairs = []
        for s0, ds, d0, dd, length in row_runs(src, dst):
            assert ds > 0 and dd > 0 and length >= 1
            pairs += [(s0 + k * ds, d0 + k * dd) for k in range(length)]
        assert pairs == list(zip(src, dst))
    assert row_runs([8, 16, 24, 25], [3, 4, 5, 9]) == [(8, 8, 3, 1, 3), (25, 1, 9, 1, 1)]


@pytest.mark.parametrize("direct_bytes", [0, 1 << 40])
def test_direct_and_gathered_copies_move_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, direct_bytes: int
) -> None:
    """Both copy paths (straight row runs, and gather + scatter) on every layout."""
    import kvsdk.transfer.cpu

    monkeypatch.setattr(kvsdk.transfer.cpu, "DIRECT_COPY_BYTES", direct_bytes)
    for shared in (False, True):
        roundtrip((2, 4, 8), 3, 2, 0, shared)
        roundtrip((2, 4, 8), 2, 1, 0, shared)


def test_copies_of_unequal_lengths_fail_the_job() -> None:
    t = torch.zeros((4, 16), dtype=torch.uint8)
    w = CPUTransferWorker()
    w.register([GroupLayers(0, (t,), 1)], torch.zeros((2, 16), dtype=torch.uint8))
    w.submit(TransferJob(4, Direction.STORE, (BlockCopies(0, [1, 2], [0], [0, 0]),)))
    w.wait([4])
    (res,) = w.poll()
    assert not res.ok and "length" in (res.error or "")
    w.shutdown()


def test_stores_run_inline_when_torch_threads_span_every_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvsdk.transfer.cpu

    monkeypatch.setattr(kvsdk.transfer.cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(kvsdk.transfer.cpu.torch, "get_num_threads", lambda: 4)
    inline = CPUTransferWorker()
    monkeypatch.setattr(kvsdk.transfer.cpu.torch, "get_num_threads", lambda: 2)
    threaded = CPUTransferWorker()
    assert inline.sync_stores and not threaded.sync_stores
    t = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    slab = torch.zeros((2, 16), dtype=torch.uint8)
    inline.register([GroupLayers(0, (t,), 1)], slab)
    inline.submit(TransferJob(5, Direction.STORE, (BlockCopies(0, [2], [1], [0]),)))
    (res,) = inline.poll()  # done before submit returned: no wait needed
    assert res.ok and torch.equal(slab[1], t[2])
    inline.shutdown()
    threaded.shutdown()


def test_a_worker_bound_to_one_cpu_stores_inline_whatever_the_machine_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TP worker bound to its own CPU (VLLM_CPU_OMP_THREADS_BIND='0|1'): a
    copy thread would only take that CPU from the engine."""
    import kvsdk.transfer.cpu

    monkeypatch.setattr(kvsdk.transfer.cpu.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kvsdk.transfer.cpu.os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(kvsdk.transfer.cpu.torch, "get_num_threads", lambda: 1)
    w = CPUTransferWorker()
    assert w.sync_stores
    w.shutdown()


@pytest.mark.parametrize("direct_bytes", [0, 1 << 40])
def test_a_block_out_of_range_fails_the_job_on_either_copy_path(
    monkeypatch: pytest.MonkeyPatch, direct_bytes: int
) -> None:
    import kvsdk.transfer.cpu

    monkeypatch.setattr(kvsdk.transfer.cpu, "DIRECT_COPY_BYTES", direct_bytes)
    t = torch.zeros((4, 16), dtype=torch.int64)
    w = CPUTransferWorker()
    w.register([GroupLayers(0, (t,), 1)], torch.zeros((2, 128), dtype=torch.uint8))
    for job_id, direction in ((5, Direction.LOAD), (6, Direction.STORE)):
        bad = BlockCopies(0, np.array([99]), np.array([0]), np.array([0]))  # no block 99
        w.submit(TransferJob(job_id, direction, (bad,)))
        w.wait([job_id])
        (res,) = w.poll()
        assert not res.ok and res.error, direction
    w.shutdown()


@pytest.mark.parametrize("direct_bytes", [0, 1 << 40])
def test_host_copies_stay_off_torchs_thread_team(
    monkeypatch: pytest.MonkeyPatch, direct_bytes: int
) -> None:
    """On a CPU engine torch's OpenMP team is the model's: each torch copy would
    end in a barrier every team thread must reach. Host rows go through numpy,
    on the calling thread alone."""
    import kvsdk.transfer.cpu

    def no_torch_copies(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch copy on host tensors")

    monkeypatch.setattr(kvsdk.transfer.cpu, "DIRECT_COPY_BYTES", direct_bytes)
    monkeypatch.setattr(torch.Tensor, "copy_", no_torch_copies)
    monkeypatch.setattr(torch.Tensor, "index_copy_", no_torch_copies)
    monkeypatch.setattr(torch, "index_select", no_torch_copies)
    for shared in (False, True):
        roundtrip((2, 4, 8), 3, 2, 0, shared)


def test_a_negative_row_fails_the_gathered_copy_instead_of_wrapping() -> None:
    from kvsdk.transfer.cpu import copy_rows

    src, dst = torch.arange(8, dtype=torch.int64).view(4, 2), torch.zeros((4, 2), dtype=torch.int64)
    stage = torch.empty((4, 2), dtype=torch.int64)
    with pytest.raises(IndexError):
        copy_rows(src, torch.tensor([1]), dst, torch.tensor([-1]), lambda: stage)
    assert not dst.any()  # nothing written to the last row
