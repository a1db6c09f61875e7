"""The CUDA transfer worker's seams: the device runtime it drives (streams,
events, pinning; a Protocol, so its bookkeeping is tested without CUDA) and the
tracker of jobs in flight and their completion events."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvsdk.transfer.base import (
    Direction,
    TransferResult,
)

log = logging.getLogger(__name__)


# -- the device seam ------------------------------------------------------------------


def cuda_module() -> Any:
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
        return cuda_module().Stream(self.device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> Event:
        event: Event = cuda_module().Event(enable_timing=True)
        return event

    def record(self, event: Event, stream: Any) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.record(stream)

    def after_current(self, stream: Any) -> None:
        ready = cuda_module().Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.wait_event(ready)

    def pin(self, t: torch.Tensor) -> bool:
        if t.is_pinned():
            return False
        nbytes = t.numel() * t.element_size()
        # 1 = cudaHostRegisterPortable: pinned for every CUDA context of the process
        err = int(cuda_module().cudart().cudaHostRegister(t.data_ptr(), nbytes, 1))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of the {nbytes} B host slab failed: error {err}")
        return True

    def unpin(self, t: torch.Tensor) -> None:
        cuda_module().cudart().cudaHostUnregister(t.data_ptr())

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
