"""Store jobs from chosen chunks: one tier reservation for a step's candidates,
then the block copies of each request, registered with the job ledger."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.ledger import JobLedger
from kvsdk.scheduler.request import RequestState, store_copies
from kvsdk.scheduler.tail import tail_blocks_ready, tail_copies
from kvsdk.store.tiered import TieredStore
from kvsdk.transfer import Direction, TransferJob
from kvsdk.types import ChunkKey, KVGroupSpec

Candidate = tuple[RequestState, list[Sequence[int]], list[ChunkKey]]
"""A request, per group the chunk indices to store, and their keys."""


class StoreJobs:
    def __init__(
        self, groups: Sequence[KVGroupSpec], store: TieredStore, ledger: JobLedger
    ) -> None:
        self.groups = tuple(groups)
        self.store = store
        self.ledger = ledger

    def store_jobs(self, tenant: str, found: list[Candidate]) -> list[TransferJob]:
        """One tier reservation for the step's candidates (one per request
        if the tier cannot take them all at once), then a job per request."""
        plan = self.store.prepare_store([k for _, _, keys in found for k in keys], tenant)
        if plan is None and len(found) > 1:
            jobs = []
            for item in found:
                jobs += self.store_jobs(tenant, [item])
            return jobs
        if plan is None or not plan.keys:
            return []
        slot_of = dict(zip(plan.keys, plan.slots))
        jobs = []
        for r, chosen, _ in found:
            job = self._store_job(r, chosen, slot_of)
            if job is not None:
                jobs.append(job)
        return jobs

    def _store_job(
        self, r: RequestState, chosen: list[Sequence[int]], slot_of: dict[ChunkKey, int]
    ) -> TransferJob | None:
        """``r``'s store job for the chunks that got a slot (None: none did)."""
        found = store_copies(r, self.groups, chosen, slot_of)
        if found is None:
            return None
        job_id = self.ledger.add_store(
            r.req_id,
            found.keys,
            fenced_block_ids=found.fenced,
            deferred_fence_block_ids=found.deferred,
        )
        return TransferJob(job_id, Direction.STORE, found.copies)

    def tail_job(self, r: RequestState) -> TransferJob | None:
        """The store of ``r``'s prompt tail, if its blocks are whole and the
        tier takes every group's entry (None: stored already, or no room)."""
        t = r.tail
        assert t is not None
        if not tail_blocks_ready(t, self.groups, r.block_ids):
            return None
        plan = self.store.prepare_store(t.keys, r.tenant)
        if plan is None or len(plan.keys) != len(t.keys):
            if plan is not None and plan.keys:
                self.store.complete_store(list(plan.keys), ok=False)  # release the part
            return None
        copies = tail_copies(t, self.groups, r.block_ids, plan.slots)
        blocks = [b for c in copies for b in c.engine_blocks]
        job_id = self.ledger.add_store(r.req_id, list(t.keys), deferred_fence_block_ids=blocks)
        return TransferJob(job_id, Direction.STORE, tuple(copies))
