"""Load jobs: one per promised hit once the engine allocated its blocks, tracked
until the workers report it (the chunks it reads and the request it fills)."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.ledger import Job, JobLedger
from kvsdk.metrics import Metrics
from kvsdk.scheduler.request import RequestState, load_copies
from kvsdk.store.tiered import TieredStore
from kvsdk.transfer import BlockCopies, Direction, TransferJob
from kvsdk.types import ChunkKey, KVGroupSpec, ReqKey


class LoadJobs:
    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        store: TieredStore,
        ledger: JobLedger,
        metrics: Metrics,
    ) -> None:
        self.groups = tuple(groups)
        self.store = store
        self.ledger = ledger
        self.metrics = metrics
        self.being_loaded: dict[ChunkKey, int] = {}
        """Chunks that loads in flight copy out of, with how many loads do."""
        self.loading: set[ReqKey] = set()
        """Requests a load into whose blocks has not been reported done."""
        self.queued: list[TransferJob] = []
        """This step's loads, not handed to the workers yet."""
        self._jobs: dict[int, TransferJob] = {}
        """Load jobs in flight (the engine blocks of a failed one are reported back)."""
        self._before_reset: dict[int, TransferJob] = {}
        """Load jobs in flight at a reset, until their workers report them."""

    def add(self, r: RequestState, end: int) -> None:
        """Queue the load that continues ``r`` at ``end`` tokens from
        ``r.num_computed_local`` (its blocks allocated)."""
        keys, per_group = load_copies(r, self.groups, end)
        slots = self.store.prepare_load(keys)
        if len(per_group) == 1 and len(per_group[0][2]) == len(keys):
            gi, eb, _, offs = per_group[0]  # a block per key, in the keys' order
            copies: tuple[BlockCopies, ...] = (BlockCopies(self.groups[gi].index, eb, slots, offs),)
        else:
            slot_of = dict(zip(keys, slots)).__getitem__
            copies = tuple(
                BlockCopies(self.groups[gi].index, eb, list(map(slot_of, bkeys)), offs)
                for gi, eb, bkeys, offs in per_group
            )
        job_id = self.ledger.add_load(r.req_id, keys)
        self.loading.add(r.req_id)
        job = TransferJob(job_id, Direction.LOAD, copies)
        self.queued.append(job)
        self._jobs[job_id] = job
        being_loaded = self.being_loaded
        for k in keys:
            being_loaded[k] = being_loaded.get(k, 0) + 1

    def take_queued(self) -> tuple[TransferJob, ...]:
        """This step's loads, for the workers."""
        loads, self.queued = tuple(self.queued), []
        return loads

    def completed(self, job: Job) -> Sequence[int]:
        """The workers finished load ``job``: the engine blocks it was to fill
        if it failed (the chunks it read are misses from now on), else none."""
        load = self._jobs.pop(job.job_id)
        self.loading.discard(job.req_id)
        self.store.complete_load(job.keys)
        for k in job.keys:
            n = self.being_loaded.get(k, 0) - 1
            if n > 0:
                self.being_loaded[k] = n
            else:
                self.being_loaded.pop(k, None)
        if not job.failed:
            return ()
        self.metrics.inc("kvsdk_failed_jobs_total", direction="load")
        # never offer chunks that just failed to load again: they are misses now
        self.store.discard(job.keys)
        return [b for c in load.copies for b in c.engine_blocks]

    def rename(self, old: ReqKey, new: ReqKey) -> None:
        """File request ``old``'s load as ``new``'s from now on."""
        if old in self.loading:
            self.loading.discard(old)
            self.loading.add(new)

    def reset(self) -> None:
        """Forget the loads in flight: their slots stay pinned, and the engine
        blocks of one that fails are still reported, when it completes
        (:meth:`completed_after_reset`)."""
        self.being_loaded.clear()
        self._before_reset.update(self._jobs)
        self._jobs.clear()
        self.loading.clear()

    def completed_after_reset(self, job: Job) -> Sequence[int]:
        """Load ``job``, issued before a reset, finished: its slots are unpinned
        (the store frees them); the engine blocks it was to fill if it failed."""
        load = self._before_reset.pop(job.job_id, None)
        self.store.complete_load(job.keys)
        if not job.failed or load is None:
            return ()
        self.metrics.inc("kvsdk_failed_jobs_total", direction="load")
        return [b for c in load.copies for b in c.engine_blocks]
