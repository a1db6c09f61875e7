"""``cpu``: the transfer worker for KV tensors in host memory (vLLM-CPU, tests).

Jobs run on one background thread in submission order; torch's gather and
scatter kernels release the GIL, so the engine thread keeps going. Per job
and layer there is one gather (``index_select``) and one scatter
(``index_put_``), never a Python loop per block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvsdk.hooks import hookimpl
from kvsdk.transfer import (
    Direction,
    GroupLayers,
    TransferJob,
    TransferResult,
    TransferWorker,
    block_bytes_view,
    slot_views,
)


class CPUTransferWorker(TransferWorker):
    name = "cpu"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsdk-xfer")
        self._futures: dict[int, Future[TransferResult]] = {}
        self._lock = threading.Lock()
        self._layers: dict[int, list[torch.Tensor]] = {}
        self._slots: dict[int, torch.Tensor] = {}

    def register(self, groups: Sequence[GroupLayers], slab: torch.Tensor) -> None:
        for g in groups:
            self._layers[g.group] = [block_bytes_view(t) for t in g.layers]
            self._slots[g.group] = slot_views(slab, g)

    def submit(self, job: TransferJob) -> None:
        fut = self._pool.submit(self._run, job)
        with self._lock:
            self._futures[job.job_id] = fut

    def _run(self, job: TransferJob) -> TransferResult:
        start = time.perf_counter()
        nbytes = 0
        try:
            for c in job.copies:
                if not c.num_blocks:
                    continue
                blocks = torch.from_numpy(c.engine_blocks)
                slots = torch.from_numpy(c.slots)
                offsets = torch.from_numpy(c.offsets)
                sv = self._slots[c.group]
                for li, layer in enumerate(self._layers[c.group]):
                    if job.direction is Direction.STORE:
                        sv[slots, li, offsets] = layer.index_select(0, blocks)
                    else:
                        layer[blocks] = sv[slots, li, offsets]
                    nbytes += c.num_blocks * layer.shape[1]
        except Exception as exc:  # reported, never raised into the engine
            return TransferResult(
                job.job_id,
                job.direction,
                False,
                nbytes,
                time.perf_counter() - start,
                f"{type(exc).__name__}: {exc}",
            )
        return TransferResult(job.job_id, job.direction, True, nbytes, time.perf_counter() - start)

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            futs = [self._futures[j] for j in job_ids if j in self._futures]
        for f in futs:
            f.exception()  # waits; errors are reported through poll()

    def poll(self) -> list[TransferResult]:
        with self._lock:
            done = [j for j, f in self._futures.items() if f.done()]
            futs = [self._futures.pop(j) for j in done]
        return [f.result() for f in futs]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@hookimpl
def kvsdk_transfer_workers() -> dict[str, Callable[..., TransferWorker]]:
    return {"cpu": CPUTransferWorker}
