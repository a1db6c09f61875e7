"""The host tier's memory is committed ahead of the stores (``kvsdk.prefault``):
the shared slab's pages exist once its creator's prefault thread has walked
them, in every attaching process too, with the slab's content untouched; the
walk keeps a fixed distance past the slots stores reach, not the whole tier at
start; a creator that copies no slot data (a host tier alone under vLLM) leaves
the walk to the workers; ``prefault: false`` leaves the pages to the first
store, as before."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable

import pytest
import torch

import kvsdk.prefault
from kvsdk.backend import SlabRequest, TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.prefault import Prefault, populate
from kvsdk.slab import HEADER_BYTES, SharedSlab, SlabGeometry, segment_name
from kvsdk.types import ChunkKey

GEOMETRY = SlabGeometry(num_slots=64, region_bytes=256 << 10, num_regions=1)  # 16 MiB


def kernel_has_populate_write() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


def allocated_bytes(slab: SharedSlab) -> int:
    """Bytes of the segment the kernel has pages for (tmpfs counts them in st_blocks)."""
    return os.stat(slab.path).st_blocks * 512


def test_a_prefaulted_slab_has_every_page_and_keeps_what_was_stored() -> None:
    slab = SharedSlab.create(segment_name(f"test-prefault-{uuid.uuid4()}"), GEOMETRY)
    try:
        assert slab.prefaulting is None
        assert allocated_bytes(slab) < GEOMETRY.nbytes // 4  # only what was written: the header
        pattern = torch.arange(GEOMETRY.slot_bytes, dtype=torch.int64).to(torch.uint8)
        slab.tensor[3].copy_(pattern)  # a store before the walk
        slab.prefault()
        assert slab.prefaulting is not None
        slab.prefaulting.join(30)
        assert not slab.prefaulting.thread.is_alive()
        if kernel_has_populate_write():
            assert allocated_bytes(slab) >= GEOMETRY.nbytes
        assert torch.equal(slab.tensor[3], pattern)  # populate writes nothing
        assert int(slab.tensor[10].sum()) == 0
    finally:
        slab.unlink()


def test_an_attaching_process_prefaults_its_own_mapping() -> None:
    name = segment_name(f"test-prefault-{uuid.uuid4()}")
    slab = SharedSlab.create(name, GEOMETRY)
    try:
        other = SharedSlab.attach(name, prefault=True)
        assert other.prefaulting is not None
        other.prefaulting.join(30)
        if kernel_has_populate_write():  # the worker's walk allocated the shared pages
            assert allocated_bytes(slab) >= GEOMETRY.nbytes
        other.tensor[5].fill_(7)
        assert int(slab.tensor[5][0]) == 7  # one segment
    finally:
        slab.unlink()


def shared_cpu_tier(prefault: bool = True, *, creator_copies: bool = True) -> CPUBackend:
    """A 16 MiB cpu tier of 256 KiB slots in shared memory (as under vLLM)."""
    ctx = TierContext(
        namespace_fp=bytes(16),
        namespace_hex="00" * 16,
        chunk_bytes=256 << 10,
        slab=SlabRequest(
            segment_name(f"test-prefault-{uuid.uuid4()}"), regions=1, creator_copies=creator_copies
        ),
    )
    return CPUBackend(CPUOptions(capacity=16 << 20, prefault=prefault), ctx)


def test_the_cpu_tier_prefaults_by_default_and_not_when_told_so() -> None:
    for prefault in (True, False):
        tier = shared_cpu_tier(prefault)
        shared = tier._shared
        assert shared is not None
        try:
            assert (shared.prefaulting is not None) is prefault
            if prefault:
                shared.prefaulting.join(30)
                if kernel_has_populate_write():
                    assert allocated_bytes(shared) >= shared.geometry.nbytes
            else:
                assert allocated_bytes(shared) < shared.geometry.nbytes // 4
        finally:
            tier.close()
            shared.unlink()
        assert not shared.path.exists()


def test_a_creator_that_copies_nothing_leaves_the_walk_to_the_attaching_workers() -> None:
    tier = shared_cpu_tier(creator_copies=False)  # a host tier alone under vLLM
    shared = tier._shared
    assert shared is not None
    try:
        assert shared.prefaulting is None
        assert tier.reserve([ChunkKey(bytes([i]) * 16) for i in range(8)]) is not None
        assert allocated_bytes(shared) < shared.geometry.nbytes // 4
        worker = SharedSlab.attach(shared.name, prefault=True)
        assert worker.prefaulting is not None
        worker.stores_reached(shared.geometry.num_slots)
        worker.prefaulting.join(30)
        if kernel_has_populate_write():  # the worker's walk allocated the pages
            assert allocated_bytes(shared) >= shared.geometry.nbytes
    finally:
        tier.close()
        shared.unlink()


def test_populate_reports_whether_the_kernel_could() -> None:
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    assert populate(buf.data_ptr(), buf.nbytes) is kernel_has_populate_write()


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


MiB = 1 << 20


@pytest.mark.skipif(not kernel_has_populate_write(), reason="kernel before 5.14")
def test_the_walk_keeps_its_distance_ahead_of_the_stores_not_the_whole_tier() -> None:
    geometry = SlabGeometry(num_slots=64, region_bytes=MiB, num_regions=1)  # 64 MiB
    slab = SharedSlab.create(segment_name(f"test-prefault-{uuid.uuid4()}"), geometry)
    try:
        addr = slab.tensor.data_ptr() - HEADER_BYTES
        walk = Prefault(addr, geometry.nbytes, slab.tensor, "test", ahead=8 * MiB)
        assert wait_for(lambda: walk.committed_bytes >= 8 * MiB)
        time.sleep(0.2)  # it stops there
        assert walk.committed_bytes == 8 * MiB and not walk.done
        assert 8 * MiB <= allocated_bytes(slab) < 9 * MiB
        walk.reached(32 * MiB)
        assert wait_for(lambda: walk.committed_bytes >= 40 * MiB)
        assert 40 * MiB <= allocated_bytes(slab) < 41 * MiB
        walk.reached(geometry.nbytes)  # past the end: the rest, then the thread ends
        walk.join(30)
        assert walk.done and not walk.thread.is_alive()
        assert allocated_bytes(slab) >= geometry.nbytes
    finally:
        slab.unlink()


@pytest.mark.skipif(not kernel_has_populate_write(), reason="kernel before 5.14")
def test_the_cpu_tier_walks_ahead_of_the_slots_it_hands_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvsdk.prefault, "AHEAD_BYTES", MiB)
    monkeypatch.setattr(kvsdk.prefault, "START_BYTES", 0)  # the walk alone
    tier = shared_cpu_tier()  # 64 slots of 256 KiB
    shared = tier._shared
    assert shared is not None and shared.prefaulting is not None
    walk = shared.prefaulting
    try:
        assert wait_for(lambda: walk.committed_bytes >= MiB)
        assert allocated_bytes(shared) < 2 * MiB  # one MiB ahead of no store yet
        keys = [ChunkKey(bytes([i]) * 16) for i in range(48)]
        assert tier.reserve(keys[:8]) is not None  # slots 0-7: 2 MiB
        assert wait_for(lambda: walk.committed_bytes >= 3 * MiB)
        assert tier.reserve(keys[8:]) is not None  # slots up to 47: 12 MiB
        assert wait_for(lambda: walk.committed_bytes >= 13 * MiB)
        assert 13 * MiB <= allocated_bytes(shared) < 14 * MiB + HEADER_BYTES
    finally:
        tier.close()
        shared.unlink()


@pytest.mark.skipif(not kernel_has_populate_write(), reason="kernel before 5.14")
def test_a_tier_commits_its_first_bytes_before_it_serves_and_walks_the_rest_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvsdk.prefault, "AHEAD_BYTES", MiB)
    monkeypatch.setattr(kvsdk.prefault, "START_BYTES", 6 * MiB)
    tier = shared_cpu_tier()  # 64 slots of 256 KiB: 16 MiB
    shared = tier._shared
    assert shared is not None and shared.prefaulting is not None
    try:
        # committed when the constructor returned, not by the thread later
        assert 6 * MiB <= allocated_bytes(shared) < 8 * MiB
        assert shared.prefaulting.committed_bytes >= 6 * MiB
        keys = [ChunkKey(bytes([i]) * 16) for i in range(48)]
        assert tier.reserve(keys) is not None  # slots up to 47: 12 MiB, the walk goes on
        walk = shared.prefaulting
        assert wait_for(lambda: walk.committed_bytes >= 13 * MiB)  # a MiB ahead of them
        assert 13 * MiB <= allocated_bytes(shared) < 14 * MiB + HEADER_BYTES
    finally:
        tier.close()
        shared.unlink()


@pytest.mark.skipif(not kernel_has_populate_write(), reason="kernel before 5.14")
def test_an_inline_walk_commits_just_what_the_stores_reach_on_their_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker with no CPU to spare: no thread, nothing ahead of the stores."""
    monkeypatch.setattr(kvsdk.prefault, "START_BYTES", 0)
    geometry = SlabGeometry(num_slots=64, region_bytes=MiB, num_regions=1)  # 64 MiB
    name = segment_name(f"test-prefault-{uuid.uuid4()}")
    slab = SharedSlab.create(name, geometry)
    try:
        worker = SharedSlab.attach(name, prefault=True, prefault_inline=True)
        walk = worker.prefaulting
        assert walk is not None and walk.thread is None and walk.inline
        assert allocated_bytes(slab) < MiB
        worker.stores_reached(8)  # slots 0-7 about to be written: committed now
        assert 8 * MiB <= walk.committed_bytes < 9 * MiB
        assert 8 * MiB <= allocated_bytes(slab) < 9 * MiB + HEADER_BYTES
        worker.stores_reached(4)  # behind: nothing to do
        assert walk.committed_bytes < 9 * MiB
        worker.stores_reached(geometry.num_slots)
        assert walk.done and allocated_bytes(slab) >= geometry.nbytes
    finally:
        slab.unlink()


def test_the_worker_walks_inline_exactly_when_torch_threads_fill_its_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvsdk.transfer import cpu

    monkeypatch.setattr(cpu, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cpu.no_cpu_to_spare()
    assert cpu.CPUTransferWorker().sync_stores
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not cpu.no_cpu_to_spare()
    assert not cpu.CPUTransferWorker().sync_stores
