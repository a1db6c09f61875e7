"""The job ledger: every load and store in flight, who owns it, and what must
be flushed before an engine block is reused.

Calls per scheduler step, in order:

1. ``blocks_allocated(ids)`` for every block the engine allocated this step
   (including copy-on-write destinations);
2. ``request_preempted(req)`` for preempted requests (their stores flush);
3. ``collect_fence_flushes()`` once: stores still reading a block that was
   just reallocated must finish before the engine overwrites it;
4. ``add_load`` / ``add_store`` for this step's new jobs;
5. ``end_step()`` → job ids the workers must finish before this step's
   forward pass writes to KV.

Completions arrive from ``complete(job_id, count)``, one count per worker;
a job is done when all ``num_workers`` reported.

``reset()`` is a fence: the jobs in flight leave their requests (nothing of
them is credited to a request again, and job ids are never reused) but stay
counted until their workers report them, because those workers still copy
into or out of the jobs' host slots. ``complete`` returns such a job (its
``before_reset`` set) once every worker reported it, and only then may its
slots be freed; ``in_flight_jobs()`` lists the jobs a reset is about to fence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvsdk.types import ChunkKey, JobId, ReqKey


@dataclass(slots=True)
class Job:
    job_id: JobId
    req_id: ReqKey
    is_store: bool
    keys: tuple[ChunkKey, ...]
    pending_workers: int
    fenced_block_ids: tuple[int, ...] = ()
    """Watched from creation (sliding-window blocks may be freed mid-request)."""
    deferred_fence_block_ids: tuple[int, ...] = ()
    """Watched once the request finishes (before that, the request holds them)."""
    failed: bool = False
    before_reset: bool = False
    """Issued before a reset: it belongs to no request now; its slots are
    released when ``complete`` returns it."""


@dataclass(slots=True)
class _Request:
    jobs: set[JobId] = field(default_factory=set)
    finished: bool = False
    forget_when_idle: bool = False


class JobLedger:
    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self._next_id: JobId = 0
        self._stale_below: JobId = 0
        self._jobs: dict[JobId, Job] = {}
        self._fenced: dict[JobId, Job] = {}
        """Jobs in flight at a reset, until every worker reported them."""
        self._requests: dict[ReqKey, _Request] = {}
        self._block_fences: dict[int, set[JobId]] = {}
        self._allocated_this_step: set[int] = set()
        self._flush_this_step: set[JobId] = set()

    # -- queries -------------------------------------------------------------------
    def has_jobs(self, req_id: ReqKey) -> bool:
        r = self._requests.get(req_id)
        return bool(r and r.jobs)

    def has_store_jobs(self, req_id: ReqKey) -> bool:
        r = self._requests.get(req_id)
        return bool(r and any(self._jobs[j].is_store for j in r.jobs))

    def jobs_of(self, req_id: ReqKey) -> frozenset[JobId]:
        r = self._requests.get(req_id)
        return frozenset(r.jobs) if r else frozenset()

    def job(self, job_id: JobId) -> Job:
        return self._jobs[job_id]

    def owners(self, job_ids: Iterable[JobId]) -> list[ReqKey]:
        """The request of each job (``job(j).req_id`` of each, in one call)."""
        jobs = self._jobs
        return [jobs[j].req_id for j in job_ids]

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_fenced_blocks(self) -> int:
        return len(self._block_fences)

    @property
    def num_jobs_before_reset(self) -> int:
        """Jobs issued before a reset whose workers have not all reported yet."""
        return len(self._fenced)

    def in_flight_jobs(self) -> list[Job]:
        """The jobs in flight now (those a ``reset`` would fence)."""
        return list(self._jobs.values())

    def is_empty(self) -> bool:
        return not (self._jobs or self._block_fences or self._requests or self._fenced)

    def tracked_requests(self) -> frozenset[ReqKey]:
        return frozenset(self._requests)

    # -- requests --------------------------------------------------------------------
    def request_finished(self, req_id: ReqKey) -> None:
        """The engine finished (or aborted) the request and frees its blocks:
        its stores' deferred fences start being watched. The request stays
        tracked (its final stores may still be added) until ``forget``."""
        r = self._request(req_id)
        r.finished = True
        for jid in r.jobs:
            job = self._jobs[jid]
            self._fence(job.deferred_fence_block_ids, jid)
            if not self._allocated_this_step.isdisjoint(job.deferred_fence_block_ids):
                self._flush_this_step.add(jid)

    def request_preempted(self, req_id: ReqKey) -> None:
        """A preempted request's blocks are freed now: flush its stores."""
        r = self._requests.get(req_id)
        if r is not None:
            self._flush_this_step.update(r.jobs)

    # -- step --------------------------------------------------------------------------
    def blocks_allocated(self, block_ids: Iterable[int]) -> None:
        self._allocated_this_step.update(block_ids)
        self._allocated_this_step.discard(0)  # the null block is never written

    def collect_fence_flushes(self) -> None:
        if self._block_fences and self._allocated_this_step:
            for bid in self._allocated_this_step.intersection(self._block_fences):
                self._flush_this_step.update(self._block_fences[bid])

    def step_is_empty(self) -> bool:
        """Nothing allocated or to flush this step so far (``end_step`` would return nothing)."""
        return not (self._allocated_this_step or self._flush_this_step)

    def end_step(self) -> set[JobId]:
        flush = self._flush_this_step
        self._flush_this_step = set()
        self._allocated_this_step = set()
        return flush

    def distrust(self, job_ids: Iterable[JobId]) -> None:
        """These stores may copy blocks the engine already overwrote: they
        complete as failed, whatever the workers report."""
        for jid in job_ids:
            job = self._jobs.get(jid)
            if job is not None and job.is_store:
                job.failed = True

    # -- jobs ----------------------------------------------------------------------------
    def _new_id(self) -> JobId:
        jid = self._next_id
        self._next_id += 1
        return jid

    def add_load(self, req_id: ReqKey, keys: Sequence[ChunkKey]) -> JobId:
        r = self._request(req_id)
        assert not r.jobs, f"load for {req_id} while it has jobs in flight"
        assert not r.finished, f"load for finished request {req_id}"
        jid = self._new_id()
        self._jobs[jid] = Job(jid, req_id, False, tuple(keys), self.num_workers)
        r.jobs.add(jid)
        return jid

    def add_store(
        self,
        req_id: ReqKey,
        keys: Sequence[ChunkKey],
        *,
        fenced_block_ids: Sequence[int] = (),
        deferred_fence_block_ids: Sequence[int] = (),
    ) -> JobId:
        r = self._request(req_id)
        assert all(self._jobs[j].is_store for j in r.jobs), f"store for {req_id} during a load"
        jid = self._new_id()
        job = Job(
            jid,
            req_id,
            True,
            tuple(keys),
            self.num_workers,
            _without_null(fenced_block_ids),
            _without_null(deferred_fence_block_ids),
        )
        self._jobs[jid] = job
        r.jobs.add(jid)
        self._fence(job.fenced_block_ids, jid)
        if r.finished:
            self._fence(job.deferred_fence_block_ids, jid)
            if not self._allocated_this_step.isdisjoint(job.deferred_fence_block_ids):
                self._flush_this_step.add(jid)
        return jid

    def complete(self, job_id: JobId, count: int = 1, *, failed: bool = False) -> Job | None:
        """Record ``count`` worker reports; returns the job once all reported.
        A job issued before a reset is returned with ``before_reset`` set (its
        host slots may be freed now); reports of ids nobody waits for are ignored."""
        assert count > 0
        if job_id < self._stale_below:
            return self._complete_fenced(job_id, count, failed)
        job = self._jobs[job_id]
        job.failed |= failed
        job.pending_workers -= count
        assert job.pending_workers >= 0, f"job {job_id} over-reported"
        if job.pending_workers:
            return None
        del self._jobs[job_id]
        self._unfence(job.fenced_block_ids, job_id)
        r = self._requests[job.req_id]
        if r.finished:
            self._unfence(job.deferred_fence_block_ids, job_id)
        r.jobs.discard(job_id)
        self._maybe_forget(job.req_id)
        return job

    def _complete_fenced(self, job_id: JobId, count: int, failed: bool) -> Job | None:
        job = self._fenced.get(job_id)
        if job is None:
            return None
        job.failed |= failed
        job.pending_workers -= count
        assert job.pending_workers >= 0, f"job {job_id} over-reported"
        if job.pending_workers:
            return None
        return self._fenced.pop(job_id)

    def reset(self) -> set[JobId]:
        """Take every job from its request (fenced until its workers report it,
        see the module's docstring); returns the ids workers must still flush."""
        assert not self._allocated_this_step, "reset() inside a scheduler step"
        flush = set(self._jobs) | self._flush_this_step
        self._stale_below = self._next_id
        for job in self._jobs.values():
            job.before_reset = True
        self._fenced.update(self._jobs)
        self._jobs.clear()
        self._block_fences.clear()
        for req_id in [rid for rid, r in self._requests.items() if r.finished]:
            del self._requests[req_id]  # finished requests store nothing more
        for r in self._requests.values():
            r.jobs.clear()
        self._flush_this_step = flush
        return set(flush)

    def rename(self, old: ReqKey, new: ReqKey) -> None:
        """File request ``old`` (its jobs included) as ``new`` from now on."""
        r = self._requests.pop(old, None)
        if r is None:
            return
        assert new not in self._requests, f"rename onto tracked request {new!r}"
        self._requests[new] = r
        for jid in r.jobs:
            self._jobs[jid].req_id = new

    def forget(self, req_id: ReqKey) -> None:
        """No more jobs will be added for this request: stop tracking it once
        its jobs in flight complete."""
        r = self._requests.get(req_id)
        if r is not None:
            r.forget_when_idle = True
            self._maybe_forget(req_id)

    # -- internals -------------------------------------------------------------------------
    def _request(self, req_id: ReqKey) -> _Request:
        r = self._requests.get(req_id)
        if r is None:
            r = self._requests[req_id] = _Request()
        return r

    def _fence(self, block_ids: Iterable[int], jid: JobId) -> None:
        fences = self._block_fences
        for bid in block_ids:
            pending = fences.get(bid)
            if pending is None:
                fences[bid] = {jid}
            else:
                pending.add(jid)

    def _unfence(self, block_ids: Iterable[int], jid: JobId) -> None:
        for bid in block_ids:
            pending = self._block_fences.get(bid)
            if pending is None:
                continue
            pending.discard(jid)
            if not pending:
                del self._block_fences[bid]

    def _maybe_forget(self, req_id: ReqKey) -> None:
        r = self._requests.get(req_id)
        if r is not None and r.forget_when_idle and not r.jobs:
            del self._requests[req_id]


def _without_null(block_ids: Sequence[int]) -> tuple[int, ...]:
    """The null block (0) is never written, so never fenced."""
    return tuple(b for b in block_ids if b != 0) if 0 in block_ids else tuple(block_ids)
