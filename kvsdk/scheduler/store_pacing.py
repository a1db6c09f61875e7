"""Store pacing: per request, the token count at which its next store is due,
and the chunks (and prompt tail) it offers in a step that reaches it."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.scheduler.chunk_keys import ChunkKeys
from kvsdk.scheduler.load_jobs import LoadJobs
from kvsdk.scheduler.request import RequestState, chunks_to_store
from kvsdk.scheduler.steps import DECODE_STORE_CHUNKS
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, ReqKey


class StorePacing:
    def __init__(self, groups: Sequence[KVGroupSpec], keys: ChunkKeys, loads: LoadJobs) -> None:
        self.groups = tuple(groups)
        self.keys = keys
        self.loads = loads
        self._chunk_tokens = [g.tokens_per_chunk for g in self.groups]
        self._min_chunk_tokens = min(self._chunk_tokens)
        self._batch_decode_stores = all(g.kind is GroupKind.FULL_ATTENTION for g in self.groups)
        """Sliding-window and Mamba groups lose blocks while a request runs (the
        engine frees what falls out of the window, or a state two blocks back, and
        may hand it to another request): their chunks are stored in the step they
        complete, where the store is fenced before any reuse, never batched."""
        self.due: dict[ReqKey, int] = {}
        """Per running request, the token count at which its next store is built
        (the scheduler's ``store_due``)."""

    def update(self, r: RequestState) -> None:
        """Set ``r``'s next store (its chunks or tail to store changed)."""
        tpcs = self._chunk_tokens
        if len(tpcs) == 1:
            r.next_store_at = (r.next_store_chunk[0] + 1) * tpcs[0]
        else:
            r.next_store_at = min((c + 1) * t for c, t in zip(r.next_store_chunk, tpcs))
        due = r.next_store_at
        if due > r.num_prompt_tokens and self._batch_decode_stores:  # generated: in batches
            due += (DECODE_STORE_CHUNKS - 1) * self._min_chunk_tokens
        if r.tail is not None and not r.tail.stored:
            due = min(due, r.tail.end)
        self.due[r.req_id] = due

    def store_candidates(
        self, r: RequestState, upto: int
    ) -> tuple[list[Sequence[int]], list[ChunkKey]] | None:
        """Chunks of ``r`` complete at ``upto`` tokens and not offered yet:
        per group the chunk indices, and their keys."""
        if r.req_id in self.loads.loading:
            return None  # stores wait until the request's load landed
        self.keys.refresh(r)
        found = chunks_to_store(r, self.groups, upto)
        self.update(r)
        return found

    def tail_due(self, r: RequestState, upto: int) -> bool:
        """Whether ``r``'s prompt tail is to be stored at ``upto`` tokens."""
        t = r.tail
        return (
            t is not None and not t.stored and upto >= t.end and r.req_id not in self.loads.loading
        )

    def tail_taken(self, r: RequestState) -> None:
        """``r``'s prompt tail goes into this step's store jobs (once per
        request: stored, or not if the tier has no room)."""
        assert r.tail is not None
        r.tail.stored = True
        self.update(r)
