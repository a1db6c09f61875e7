"""The native baseline's CPU worker (``TorchCPUOffloadingWorker``, what kvsdk's
benchmarks run vLLM's ``OffloadingConnector`` with) follows the installed
vLLM's ``OffloadingWorker`` interface: vLLM 0.33's connector submits the
synchronous loads of ``sync_load_budget_bytes`` as
``submit_load(..., expedited=True)``; 0.32 never passes it. Either way a load
copies the stored blocks back, byte for byte."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvsdk.plugins.vllm.workloads.native_offload import TorchCPUOffloadingWorker

NUM_BLOCKS, PAGE = 16, 256


def worker() -> tuple[TorchCPUOffloadingWorker, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=kv, page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )
    return TorchCPUOffloadingWorker(
        caches, num_chunks=4, blocks_per_chunk=1, store_thread=False
    ), kv


def test_submit_load_takes_every_argument_of_the_installed_vllms_interface() -> None:
    base = inspect.signature(OffloadingWorker.submit_load).parameters
    ours = inspect.signature(TorchCPUOffloadingWorker.submit_load).parameters
    assert list(base) == list(ours)[: len(base)]
    for name, p in base.items():
        assert ours[name].default == p.default, name


@pytest.mark.parametrize("expedited", [False, True])
def test_a_load_copies_the_stored_blocks_back(expedited: bool) -> None:
    w, kv = worker()
    try:
        stored = kv[[3, 5]].clone()
        assert w.submit_store(1, GPULoadStoreSpec([3, 5], group_sizes=[2], block_indices=[0]),
                              CPULoadStoreSpec([0, 2]))  # fmt: skip
        w.wait({1})
        kv[[7, 9]] = 0
        dst = GPULoadStoreSpec([7, 9], group_sizes=[2], block_indices=[0])
        kwargs = {"expedited": True} if expedited else {}
        assert w.submit_load(2, CPULoadStoreSpec([0, 2]), dst, **kwargs)
        w.wait({2})
        done = {r.job_id: r for r in w.get_finished()}
        assert done[1].success and done[2].success
        assert done[2].transfer_size == 2 * PAGE
        assert torch.equal(kv[[7, 9]], stored)
        assert np.array_equal(kv[[3, 5]].numpy(), stored.numpy())
    finally:
        w.shutdown()
