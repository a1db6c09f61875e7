"""The host tier's memory is committed at start (``kvsdk.prefault``): the shared
slab's pages exist once its creator's prefault thread is done, in every
attaching process too, with the slab's content untouched; ``prefault: false``
leaves them to the first store, as before."""

from __future__ import annotations

import os
import uuid

import torch

from kvsdk.backend import SlabRequest, TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.prefault import populate
from kvsdk.slab import SHM_DIR, SharedSlab, SlabGeometry, segment_name

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
        assert not slab.prefaulting.is_alive()
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


def test_the_cpu_tier_prefaults_by_default_and_not_when_told_so() -> None:
    for prefault in (True, False):
        name = segment_name(f"test-prefault-{uuid.uuid4()}")
        ctx = TierContext(
            namespace_fp=bytes(16),
            namespace_hex="00" * 16,
            chunk_bytes=256 << 10,
            slab=SlabRequest(name=name, regions=1),
        )
        tier = CPUBackend(CPUOptions(capacity=16 << 20, prefault=prefault), ctx)
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
        assert not (SHM_DIR / name).exists()


def test_populate_reports_whether_the_kernel_could() -> None:
    buf = torch.empty(8 << 20, dtype=torch.uint8)
    assert populate(buf.data_ptr(), buf.nbytes) is kernel_has_populate_write()
