"""What one scheduler step consumes and produces: worker reports in, jobs out,
and how often generated tokens are stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvsdk.transfer import TransferJob

DECODE_STORE_CHUNKS = 4
"""Chunks completed by generated tokens are stored this many at a time, and
the rest when the request finishes: one store job for several chunks costs the
scheduler about what one for a single chunk does, and the next turn of a
conversation comes after the request finished. Prompt chunks, which concurrent
requests share, are stored as soon as they are computed. (A preempted
request's blocks are freed at once, so its deferred chunks are recomputed on
resume, like any chunk of a preempted request that was not stored yet.)"""


@dataclass(frozen=True)
class StepJobs:
    loads: tuple[TransferJob, ...]
    stores: tuple[TransferJob, ...]
    flush: frozenset[int]
    """Jobs the workers must finish before this step's loads and forward pass
    (their source blocks are about to be overwritten)."""


NO_JOBS = StepJobs((), (), frozenset())
"""A step with nothing to load, store or flush."""


class WorkerResult(NamedTuple):
    job_id: int
    ok: bool = True
    workers: int = 1
    """How many workers this report stands for."""
