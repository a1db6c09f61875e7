"""Store jobs from chosen chunks: one tier reservation for a step's candidates,
then one job per request (its whole chunks and, once its prompt is computed,
its prompt's tail), registered with the job ledger."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.ledger import JobLedger
from kvsdk.scheduler.request import RequestState, store_copies
from kvsdk.scheduler.tail import tail_blocks_ready, tail_copies
from kvsdk.store.tiered import TieredStore
from kvsdk.transfer import BlockCopies, Direction, TransferJob
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

    def store_jobs(
        self,
        tenant: str,
        found: list[Candidate],
        tails: Sequence[RequestState] = (),
        admitted: frozenset[ChunkKey] | None = None,
    ) -> list[TransferJob]:
        """One tier reservation for the step's candidates and prompt tails (one
        per request if the tier cannot take them all at once), then a job per
        request: a request's tail rides in the job of its chunks, so a prompt
        finishing in this step is one job, one ledger entry, one completion.
        ``admitted``: the step's keys the store admitted (given to the parts of
        a step split for lack of room: the step's offer is admitted once)."""
        tails = [r for r in tails if r.tail and tail_blocks_ready(r.tail, self.groups, r.block_ids)]
        keys = [k for _, _, ks in found for k in ks]
        tail_keys = [k for r in tails if r.tail for k in r.tail.keys]
        if admitted is None:
            prompts = (  # requests offering their chunk 0: the admission's evidence
                sum(1 for _, chosen, _ in found if any(c and c[0] == 0 for c in chosen))
                if self.store.second_sight is not None
                else 0
            )
            keys, tail_keys = self.store.admit(keys, tail_keys, prompts)
            admitted = frozenset((*keys, *tail_keys))
        else:
            keys = [k for k in keys if k in admitted]
            tail_keys = [k for k in tail_keys if k in admitted]
        plan = self.store.prepare_store(keys, tenant, tails=tail_keys)
        if plan is None:  # the tier cannot take them all at once: one part at a time
            parts = _per_request(found, tails)
            if len(parts) == 1:  # one request: each chunk candidate, then its tail
                parts = [([c], []) for c in found] + ([([], list(tails))] if tails else [])
            jobs = []
            if len(parts) > 1:  # (one part alone that does not fit: nothing stored)
                for units in parts:
                    jobs += self.store_jobs(tenant, *units, admitted=admitted)
            return jobs
        if not plan.keys:
            return []
        slot_of = dict(zip(plan.keys, plan.slots))
        with_tail = {id(r) for r in tails}
        jobs = []
        for r, chosen, _ in found:
            job = self._store_job(r, chosen, slot_of, id(r) in with_tail)
            with_tail.discard(id(r))
            if job is not None:
                jobs.append(job)
        for r in tails:  # a tail due in a step that completes no chunk of its request
            if id(r) in with_tail and (job := self._store_job(r, None, slot_of, True)):
                jobs.append(job)
        return jobs

    def _store_job(
        self,
        r: RequestState,
        chosen: list[Sequence[int]] | None,
        slot_of: dict[ChunkKey, int],
        tail: bool,
    ) -> TransferJob | None:
        """``r``'s store job for the chunks that got a slot and, with ``tail``,
        its prompt's tail if every group's entry got one (None: nothing did)."""
        keys: list[ChunkKey] = []
        per_group: dict[int, BlockCopies] = {}
        fenced: list[int] = []
        deferred: list[int] = []
        found = None if chosen is None else store_copies(r, self.groups, chosen, slot_of)
        if found is not None:
            keys += found.keys
            per_group = {c.group: c for c in found.copies}
            fenced, deferred = found.fenced, found.deferred
        if tail and (slots := self._tail_slots(r, slot_of)) is not None:
            assert r.tail is not None
            keys += r.tail.keys
            for c in tail_copies(r.tail, self.groups, r.block_ids, slots):
                deferred.extend(c.engine_blocks)
                had = per_group.get(c.group)
                per_group[c.group] = c if had is None else _joined(had, c)
        if not keys:
            return None
        job_id = self.ledger.add_store(
            r.req_id, keys, fenced_block_ids=fenced, deferred_fence_block_ids=deferred
        )
        return TransferJob(job_id, Direction.STORE, tuple(per_group.values()))

    def _tail_slots(self, r: RequestState, slot_of: dict[ChunkKey, int]) -> list[int] | None:
        """The slots of every group's tail entry, claimed from ``slot_of``; None
        if some group's got none (stored already, or another request's): the
        ones claimed are released, a tail is stored whole or not at all."""
        assert r.tail is not None
        slots = [slot_of.pop(k, None) for k in r.tail.keys]
        if all(s is not None for s in slots):
            return slots  # type: ignore[return-value]
        part = [k for k, s in zip(r.tail.keys, slots) if s is not None]
        if part:
            self.store.complete_store(part, ok=False)
        return None


def _joined(a: BlockCopies, b: BlockCopies) -> BlockCopies:
    """One group's copies of ``a`` then ``b``."""
    return BlockCopies(
        a.group,
        [*a.engine_blocks, *b.engine_blocks],
        [*a.slots, *b.slots],
        [*a.offsets, *b.offsets],
    )


def _per_request(
    found: list[Candidate], tails: Sequence[RequestState]
) -> list[tuple[list[Candidate], list[RequestState]]]:
    """The candidates and tails of one step, by request (in order)."""
    out: dict[int, tuple[list[Candidate], list[RequestState]]] = {}
    for c in found:
        out.setdefault(id(c[0]), ([], []))[0].append(c)
    for r in tails:
        out.setdefault(id(r), ([], []))[1].append(r)
    return list(out.values())
