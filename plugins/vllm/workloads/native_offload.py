"""An out-of-tree ``OffloadingSpec`` that lets vLLM's native ``OffloadingConnector``
run on the CPU platform (vLLM-CPU), for side-by-side benchmarks with kvsdk.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses any platform that is not
CUDA-alike or XPU (its worker copies with CUDA streams and DMA kernels). This
spec keeps everything of ``CPUOffloadingSpec`` on the scheduler side (its
``CPUOffloadingManager``, sizing from ``cpu_bytes_to_use``, eviction policy,
events, metrics) and swaps in a worker that copies with torch on the host:

- the "device" side is vLLM's canonical ``(num_blocks, page_bytes)`` int8 view
  of each KV tensor, the host side one ``(num_chunks, blocks_per_chunk *
  page_bytes)`` tensor per KV tensor (allocated lazily, like any host buffer);
- a job is, per KV tensor of each group, one call of kvsdk's own row copy
  (:func:`kvsdk.transfer.cpu.copy_rows`: a strided copy per run of rows
  when runs are long, else a gather into a reused buffer and a scatter), on
  8-byte words where the layout allows, so both connectors copy the same way;
- loads run on the calling thread (they are done when ``submit_load`` returns:
  on a CPU the copy shares cores with compute, and a copy thread would queue
  behind the model runner for the GIL), so vLLM 0.33's expedited loads
  (``submit_load(..., expedited=True)``, the synchronous loads of
  ``sync_load_budget_bytes``) need nothing more; stores run in submission order on one
  background thread when torch's threads leave a CPU free, else on the
  calling thread (``store_thread``, default: that rule), as kvsdk's CPU
  transfer worker does, so both connectors are measured with the same copy
  strategy.

Multiple KV groups (``group_sizes``) and chunks of several blocks
(``blocks_per_chunk`` > 1, first chunk possibly partial via ``block_indices``)
follow the semantics of vLLM's ``SingleDirectionOffloadingHandler``. The
canonical (cross-rank) CPU layout is not supported.

Turn it on with::

    kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TorchCPUOffloadingSpec",
            "spec_module_path": "kvsdk.plugins.vllm.workloads.native_offload",
            "cpu_bytes_to_use": 2 << 30,
        },
    }
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvsdk.transfer.cpu import STAGE_BYTES, copy_rows

__all__ = ["TorchCPUOffloadingSpec", "TorchCPUOffloadingWorker"]


def _words(t: torch.Tensor) -> torch.Tensor:
    """View int8 rows as int64 when size, stride and alignment allow (8x fewer elements)."""
    if (
        t.shape[1] % 8 == 0
        and t.stride(0) % 8 == 0
        and t.stride(1) == 1
        and t.storage_offset() % 8 == 0
        and t.untyped_storage().data_ptr() % 8 == 0
    ):
        return t.view(torch.int64)
    return t


def _sub_blocks(chunks: np.ndarray, per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Row ids of ``count`` consecutive sub-blocks of ``chunks``, skipping the first ``skip``."""
    if per_chunk == 1:
        return chunks[:count].astype(np.int64)
    rows = chunks.astype(np.int64)[:, None] * per_chunk + np.arange(per_chunk, dtype=np.int64)
    return rows.ravel()[skip : skip + count]


class TorchCPUOffloadingWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_chunks: int,
        blocks_per_chunk: int,
        *,
        store_thread: bool = True,
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        # KV tensor indices each group reads/writes (several layers may share one)
        self.group_tensors = [
            list(dict.fromkeys(ref.tensor_idx for ref in refs))
            for refs in kv_caches.group_data_refs
        ]
        self.device_rows: list[torch.Tensor] = []
        self.host_rows: list[torch.Tensor] = []
        self.page_bytes: list[int] = []
        for t in kv_caches.tensors:
            dev = t.tensor
            assert dev.dtype == torch.int8 and dev.ndim == 2, (dev.dtype, dev.shape)
            page = int(dev.shape[1])
            host = torch.empty((max(num_chunks, 1) * blocks_per_chunk, page), dtype=torch.int8)
            dev_w, host_w = _words(dev), _words(host)
            if dev_w.dtype != host_w.dtype:
                dev_w, host_w = dev, host
            self.device_rows.append(dev_w)
            self.host_rows.append(host_w)
            self.page_bytes.append(page)
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="native-cpu-offload")
            if store_thread
            else None
        )
        self._stage: dict[tuple[bool, torch.dtype, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._jobs: OrderedDict[int, Future[TransferResult]] = OrderedDict()

    # -- copies -------------------------------------------------------------------------
    def _plan(
        self, gpu: GPULoadStoreSpec, host: BlockIDsLoadStoreSpec
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per group: (group index, device rows, host rows), aligned one to one."""
        group_sizes = list(gpu.group_sizes)
        block_indices = list(gpu.block_indices)
        assert len(group_sizes) == len(self.group_tensors), (group_sizes, self.group_tensors)
        bpc = self.blocks_per_chunk
        plan = []
        g_off = h_off = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % bpc
            n_chunks = -(-(size + skip) // bpc)
            dev_ids = gpu.block_ids[g_off : g_off + size].astype(np.int64)
            host_ids = _sub_blocks(host.block_ids[h_off : h_off + n_chunks], bpc, skip, size)
            g_off += size
            h_off += n_chunks
            plan.append((g, torch.from_numpy(dev_ids), torch.from_numpy(host_ids)))
        assert g_off == len(gpu.block_ids) and h_off == len(host.block_ids)
        return plan

    def _staging(self, store: bool, like: torch.Tensor) -> torch.Tensor:
        """A reused gather buffer per direction (stores and loads run on different
        threads), sized as kvsdk's CPU worker sizes its own."""
        key = (store, like.dtype, like.shape[1])
        buf = self._stage.get(key)
        if buf is None:
            rows = max(1, STAGE_BYTES // (like.shape[1] * like.element_size()))
            buf = self._stage[key] = torch.empty((rows, like.shape[1]), dtype=like.dtype)
        return buf

    def _run(
        self, job_id: int, plan: list[tuple[int, torch.Tensor, torch.Tensor]], store: bool
    ) -> TransferResult:
        start = time.perf_counter()
        nbytes = 0
        for g, dev_ids, host_ids in plan:
            for t in self.group_tensors[g]:
                dev, host = self.device_rows[t], self.host_rows[t]
                src, src_ids, dst, dst_ids = (
                    (dev, dev_ids, host, host_ids) if store else (host, host_ids, dev, dev_ids)
                )
                copy_rows(src, src_ids, dst, dst_ids, partial(self._staging, store, src))
                nbytes += len(dev_ids) * self.page_bytes[t]
        return TransferResult(job_id, True, nbytes, time.perf_counter() - start)

    def _add(self, job_id: int, fut: Future[TransferResult]) -> None:
        with self._lock:
            self._jobs[job_id] = fut

    # -- OffloadingWorker ---------------------------------------------------------------------
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        plan = self._plan(src_spec, dst_spec)
        if self._pool is not None:
            self._add(job_id, self._pool.submit(self._run, job_id, plan, True))
        else:
            fut: Future[TransferResult] = Future()
            fut.set_result(self._run(job_id, plan, True))
            self._add(job_id, fut)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Copies before it returns. ``expedited`` (vLLM 0.33: a load the connector
        waits for within the step, with ``sync_load_budget_bytes``) changes nothing
        here: no load ever queues behind another."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        fut: Future[TransferResult] = Future()
        fut.set_result(self._run(job_id, self._plan(dst_spec, src_spec), False))
        self._add(job_id, fut)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done = [j for j, f in self._jobs.items() if f.done()]
            futs = [self._jobs.pop(j) for j in done]
        return [f.result() for f in futs]

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futs = [self._jobs[j] for j in job_ids if j in self._jobs]
        for f in futs:
            f.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            self._jobs.clear()


def _cpu_left_free() -> bool:
    """Whether torch's thread team leaves a CPU for a copy thread (kvsdk's rule)."""
    return torch.get_num_threads() < (os.cpu_count() or 1)


class TorchCPUOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with a torch-copy worker that runs on the CPU platform.

    Extra config (besides ``CPUOffloadingSpec``'s own, ``cpu_bytes_to_use`` first):
    ``store_thread`` (bool): stores on one background thread; default: when
    torch's threads (in the model worker) leave a CPU free, as kvsdk decides.
    """

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if getattr(self.config, "canonical_layout", False):
                raise NotImplementedError("TorchCPUOffloadingSpec: canonical_layout is unsupported")
            extra: Mapping[str, Any] = self.extra_config
            self._worker = TorchCPUOffloadingWorker(  # type: ignore[assignment]
                kv_caches,
                self.num_chunks,
                self.blocks_per_chunk,
                store_thread=bool(extra.get("store_thread", _cpu_left_free())),
            )
        return self._worker  # type: ignore[return-value]
