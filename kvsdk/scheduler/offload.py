"""OffloadScheduler: the scheduler side of an offloading connector, as plain data
(the call order an adapter follows is in :mod:`kvsdk.scheduler`)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence

from kvsdk.events import KVEvent
from kvsdk.keys import Namespace, epoch_fingerprint, token_chunk_hashes
from kvsdk.ledger import JobLedger
from kvsdk.metrics import Metrics
from kvsdk.planner import LookupPlanner
from kvsdk.scheduler.chunk_keys import ChunkKeys
from kvsdk.scheduler.load_jobs import LoadJobs
from kvsdk.scheduler.lookup import Lookups
from kvsdk.scheduler.request import RequestState, covered_tokens, follow_hashes, handoff_keys
from kvsdk.scheduler.steps import NO_JOBS, StepJobs, WorkerResult
from kvsdk.scheduler.store_jobs import Candidate, StoreJobs
from kvsdk.scheduler.store_pacing import StorePacing
from kvsdk.scheduler.tail import tails_supported
from kvsdk.store.tiered import TieredStore
from kvsdk.transfer import TransferJob
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, ReqId, ReqKey


class OffloadScheduler:
    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        namespace: Namespace,
        store: TieredStore,
        *,
        tokens_per_hash: int | None = None,
        num_workers: int = 1,
        max_load_tokens: int | None = None,
        metrics: Metrics | None = None,
        blocks_rewritten_before_flush: bool = False,
        stores: bool = True,
    ) -> None:
        """``blocks_rewritten_before_flush``: the engine may zero or overwrite a
        reallocated block before its workers flush the stores reading it (vLLM's
        model runner V2 zeroes new blocks and applies copy-on-write first): a
        store caught by a flush is then discarded, never trusted.
        ``stores``: False for an engine that only loads (a P/D decode engine):
        no step builds a store, and no finished request holds its blocks."""
        self.groups = tuple(groups)
        self.namespace = namespace
        self.store = store
        self.metrics = metrics or store.metrics
        self.tokens_per_hash = tokens_per_hash or self.groups[0].tokens_per_block
        for g in self.groups:
            if g.tokens_per_chunk % self.tokens_per_hash:
                raise ValueError(
                    f"group {g.index}: chunk of {g.tokens_per_chunk} tokens is not a multiple "
                    f"of the hash block ({self.tokens_per_hash} tokens)"
                )
        mamba = {g.tokens_per_chunk for g in self.groups if g.kind is GroupKind.MAMBA}
        if len(mamba) > 1:
            raise ValueError(f"state-space groups with different chunk sizes {sorted(mamba)}")
        self.planner = LookupPlanner(
            self.groups,
            tokens_per_hash=self.tokens_per_hash,
            mamba_align_tokens=mamba.pop() if mamba else None,  # a hit ends on a state
        )
        self._tails = tails_supported(self.groups)
        self._lookups = Lookups(
            self.planner,
            store,
            self.metrics,
            min_chunk_tokens=min(g.tokens_per_chunk for g in self.groups),
            max_load_tokens=max_load_tokens,
        )
        self.ledger = JobLedger(num_workers)
        self._keys = ChunkKeys(
            self.groups, self.tokens_per_hash, namespace.fingerprint, store.events
        )
        self._loads = LoadJobs(self.groups, store, self.ledger, self.metrics)
        self._pacing = StorePacing(self.groups, self._keys, self._loads)
        self._jobs = StoreJobs(self.groups, store, self.ledger)
        self.blocks_rewritten_before_flush = blocks_rewritten_before_flush
        self.stores = stores
        self._requests: dict[ReqKey, RequestState] = {}
        self._retired = 0
        """Incarnations retired so far (a reused id: see :meth:`add_request`)."""
        self._resets = 0
        """Resets so far: a hit promised before one cannot be loaded after it."""
        self._finishing: dict[ReqId, list[ReqKey]] = {}
        """Per id, retired incarnations the engine finished whose final step is next."""
        self._awaiting_final_store: set[ReqKey] = set()

    @property
    def store_due(self) -> dict[ReqKey, int]:
        """Per running request, the token count at which its next store is built
        (inside the prompt: the next chunk's end; past it, ``DECODE_STORE_CHUNKS``
        chunks later). An adapter may leave requests below it out of
        ``computed_after_step`` (most requests on most steps): read-only."""
        return self._pacing.due

    @property
    def ns_fp(self) -> bytes:
        """The fingerprint chunk keys are derived under (a fresh epoch's after a reset)."""
        return self._keys.ns_fp

    @property
    def max_load_tokens(self) -> int | None:
        return self._lookups.max_load_tokens

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        req_id: ReqId,
        *,
        num_prompt_tokens: int,
        block_hashes: Sequence[bytes] | None = None,
        token_ids: Sequence[int] | None = None,
        tenant: str = "",
        prompt_token_ids: Sequence[int] | None = None,
        tail_salt: bytes = b"",
    ) -> None:
        """``block_hashes`` (the engine's hash of each full block so far; copied,
        see :meth:`hashes_grew`) or ``token_ids`` (kvsdk hashes them) identify
        the content. ``prompt_token_ids`` (with ``tail_salt``: whatever else
        changes the prompt's KV) enable the prompt's tail entry, where the
        token ids alone name the tail's content (see :mod:`kvsdk.scheduler.tail`).

        An id the engine reuses while its finished request is still tracked
        (its final stores are next step, or stores are in flight) names a new
        request: the old one is retired under ``(req_id, n)`` and finishes as
        it would have; nothing of it (hashes, keys, blocks) reaches the new one.
        An id still live (the engine has not finished it) is refused with a
        ValueError, and the live request is left as it was."""
        if req_id in self._requests:
            if self.has_request(req_id):
                raise ValueError(
                    f"add_request: request id {req_id!r} is still live (the engine has not "
                    "finished it); a live request's id cannot name a new request"
                )
            self._retire(req_id)
        if block_hashes is None:
            if token_ids is None:
                raise ValueError("add_request needs block_hashes or token_ids")
            block_hashes = token_chunk_hashes(token_ids, self.tokens_per_hash)
        r = self._requests[req_id] = RequestState(
            req_id=req_id,
            num_prompt_tokens=num_prompt_tokens,
            num_tokens=num_prompt_tokens,
            hashes=list(block_hashes),
            block_ids=[[] for _ in self.groups],
            keys=[[] for _ in self.groups],
            next_store_chunk=[0] * len(self.groups),
            tenant=tenant,
        )
        if self._tails and prompt_token_ids is not None:
            r.tail = self._keys.prompt_tail(r.hashes, prompt_token_ids, tail_salt)
        self._pacing.update(r)

    def _retire(self, req_id: ReqId) -> None:
        """File the finished request under ``req_id`` as ``(req_id, n)``."""
        r = self._requests.pop(req_id)
        self._retired += 1
        key: ReqKey = (req_id, self._retired)
        r.req_id = key
        self._requests[key] = r
        if req_id in self.store_due:
            self.store_due[key] = self.store_due.pop(req_id)
        self._loads.rename(req_id, key)
        if req_id in self._awaiting_final_store:  # its final step is next: by this id
            self._awaiting_final_store.discard(req_id)
            self._awaiting_final_store.add(key)
            self._finishing.setdefault(req_id, []).append(key)
        self.ledger.rename(req_id, key)

    def _incarnations(self, finished: Mapping[ReqId, int]) -> dict[ReqKey, int]:
        """``build_step``'s ``finished`` by incarnation: each id's retired
        incarnations the engine finished (with the tokens each reported), and
        the live one unless the id was reused since."""
        out: dict[ReqKey, int] = {}
        for req_id, upto in finished.items():
            retired = self._finishing.pop(req_id, None)
            if retired is None:
                out[req_id] = upto
                continue
            for key in retired:
                t = self._requests[key].finish_tokens if key in self._requests else None
                out[key] = upto if t is None else t
            live = self._requests.get(req_id)
            if live is not None and live.engine_finished:
                out[req_id] = upto if live.finish_tokens is None else live.finish_tokens
        return out

    def hashes_grew(self, req_id: ReqId, block_hashes: Sequence[bytes]) -> None:
        """The engine hashed more full blocks of a request, or rewound some
        (``block_hashes``: all of them so far; see
        :func:`~kvsdk.scheduler.request.follow_hashes`). Call before a lookup,
        a step that may store its chunks, and its finish."""
        r = self._requests.get(req_id)
        if r is None:
            return
        withdrawn = follow_hashes(r, block_hashes, self.groups, self.tokens_per_hash)
        if withdrawn is not None:  # rewound: nothing keyed by a dropped hash is stored
            if withdrawn:
                self.ledger.distrust(self.ledger.jobs_of(req_id))
            self._pacing.update(r)

    def is_loading(self, req_id: ReqId) -> bool:
        """Whether a load into ``req_id``'s blocks has not been reported done."""
        return req_id in self._loads.loading

    def has_request(self, req_id: ReqId) -> bool:
        """Whether ``req_id`` names a live request (one the engine has not
        finished): a finished one's id names a new request when added again."""
        r = self._requests.get(req_id)
        return r is not None and not (r.finished or r.engine_finished)

    # -- lookup -------------------------------------------------------------------------
    def lookup(
        self,
        req_id: ReqId,
        num_computed_tokens: int,
        *,
        num_tokens: int | None = None,
        max_num_new_tokens: int | None = None,
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded; None: ask again."""
        r = self._requests[req_id]
        if num_tokens is not None:
            r.num_tokens = num_tokens
        for ids in r.block_ids:
            ids.clear()
        if self.ledger.has_jobs(req_id):
            return None  # its stores must land before anything is loaded into it
        self._keys.refresh(r)
        r.num_computed_local = num_computed_tokens
        hit = self._lookups.hit(req_id, r, max_num_new_tokens, self._loads.being_loaded)
        if hit is not None:
            r.hit_resets = self._resets
        return hit

    def expect(self, req_id: ReqId) -> None:
        """``req_id``'s chunks are on their way into a slower tier (a P/D hand-off
        names them): a miss a slower tier answered for them is not kept, so the
        next lookup asks again at once instead of after the miss's lifetime."""
        r = self._requests[req_id]
        self._keys.refresh(r)
        for keys in r.keys:
            self.store.forget_absent(keys)
        if r.tail is not None:
            self.store.forget_absent(r.tail.keys)

    # -- loads ----------------------------------------------------------------------------
    def allocated(
        self, req_id: ReqId, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """The engine allocated blocks (per group, the request's full list) for
        ``num_external_tokens`` promised by ``lookup``: queue their load."""
        r = self._requests[req_id]
        for gi, ids in enumerate(block_ids):
            r.block_ids[gi] = list(ids)
            self.ledger.blocks_allocated(ids)
        if num_external_tokens == 0:
            return
        if r.hit_resets != self._resets:
            # its chunks left with the reset; vLLM never allocates across one
            # (lookup and allocation happen in one scheduler step)
            raise RuntimeError(
                f"kvsdk: request {req_id!r} was allocated {num_external_tokens} tokens promised "
                "before a reset; look it up again after reset_prefix_cache"
            )
        self._lookups.accepted(num_external_tokens)  # a declined hit (0) counts nothing
        end = r.num_computed_local + num_external_tokens
        self._loads.add(r, end)
        for gi, g in enumerate(self.groups):  # loaded chunks need no store
            r.next_store_chunk[gi] = max(r.next_store_chunk[gi], end // g.tokens_per_chunk)
        self._pacing.update(r)

    # -- the step ---------------------------------------------------------------------------
    def build_step(
        self,
        *,
        computed_after_step: Mapping[ReqId, int],
        new_block_ids: Mapping[ReqId, Sequence[Sequence[int]]] = {},
        replace_block_ids: Iterable[ReqId] = (),
        preempted: Iterable[ReqId] = (),
        finished: Mapping[ReqId, int] = {},
        reallocated_block_ids: Iterable[int] = (),
    ) -> StepJobs:
        """Close a scheduler step.

        ``computed_after_step``: for each scheduled request, tokens whose KV
        will be in the engine after this step; ``new_block_ids``: blocks
        appended this step (per group), or the full lists for requests in
        ``replace_block_ids`` (new and resumed requests); ``finished``: requests finished in
        the previous step → tokens of theirs safe to store (the engine's
        commit point); ``reallocated_block_ids``: other blocks written this
        step (e.g. copy-on-write destinations).
        """
        if (
            not (computed_after_step or new_block_ids or finished or self._loads.queued)
            and not (preempted or replace_block_ids or reallocated_block_ids)
            and self.ledger.step_is_empty()
        ):
            # most steps of a decoding batch: nothing to store, load or flush
            self._lookups.flush_metrics()
            self.store.step()
            return NO_JOBS
        # by incarnation (an id reused since its request finished names two)
        done = self._incarnations(finished) if self._finishing else dict[ReqKey, int](finished)
        replace = set(replace_block_ids)
        for req_id, groups in new_block_ids.items():
            r = self._requests.get(req_id)
            for gi, ids in enumerate(groups):
                if r is not None:
                    if req_id in replace:
                        r.block_ids[gi] = list(ids)
                    else:
                        r.block_ids[gi].extend(ids)
                self.ledger.blocks_allocated(ids)
        self.ledger.blocks_allocated(reallocated_block_ids)
        for req_id in preempted:
            self.ledger.request_preempted(req_id)
            r = self._requests.get(req_id)
            if r is not None:
                for ids in r.block_ids:
                    ids.clear()
        for key in done:
            self.ledger.request_finished(key)
        self.ledger.collect_fence_flushes()
        candidates: dict[str, list[Candidate]] = {}
        requests = self._requests
        pacing = self._pacing
        store_due = pacing.due
        tails: list[RequestState] = []
        # a loading-only engine offers nothing for storing
        done_offers = done if self.stores else dict[ReqKey, int]()
        if not self.stores:
            computed_after_step = {}
        for req_id, upto in computed_after_step.items():
            # most steps complete no new chunk for most requests: one comparison
            if upto >= store_due.get(req_id, upto + 1):
                r = requests[req_id]
                if (found := pacing.store_candidates(r, upto)) is not None:
                    candidates.setdefault(r.tenant, []).append((r, *found))
                if pacing.tail_due(r, upto):
                    tails.append(r)
        for key, upto in done_offers.items():
            r = requests.get(key)
            if r is None:
                continue
            if upto >= r.next_store_at and (found := pacing.store_candidates(r, upto)) is not None:
                candidates.setdefault(r.tenant, []).append((r, *found))
            if pacing.tail_due(r, upto):
                tails.append(r)
        by_tenant: dict[str, list[RequestState]] = {}
        for r in tails:
            pacing.tail_taken(r)
            by_tenant.setdefault(r.tenant, []).append(r)
        stores = []
        for tenant in [*candidates, *(t for t in by_tenant if t not in candidates)]:
            stores += self._jobs.store_jobs(
                tenant, candidates.get(tenant, []), by_tenant.get(tenant, ())
            )
        self._lookups.flush_metrics()
        for key in done:
            self._finish(key)
        loads = self._loads.take_queued()
        flush = frozenset(self.ledger.end_step())
        if flush and self.blocks_rewritten_before_flush:
            self.ledger.distrust(flush)
        self.store.step()
        return StepJobs(loads, tuple(stores), flush)

    # -- completions ----------------------------------------------------------------------------
    def worker_results(self, results: Iterable[WorkerResult]) -> set[int]:
        """Apply worker reports; returns engine block ids of failed loads."""
        failed_blocks: set[int] = set()
        stored_ok: list[ChunkKey] = []
        stored_failed: list[ChunkKey] = []
        for res in results:
            job = self.ledger.complete(res.job_id, res.workers, failed=not res.ok)
            if job is None:
                continue
            if job.before_reset:  # the reset's fence: its slots are free from now on
                if not job.is_store:
                    failed_blocks.update(self._loads.completed_after_reset(job))
                self.store.release(job.keys)
                continue
            if job.is_store:
                (stored_failed if job.failed else stored_ok).extend(job.keys)
                if job.failed:
                    self.metrics.inc("kvsdk_failed_jobs_total", direction="store")
            else:
                failed_blocks.update(self._loads.completed(job))
            r = self._requests.get(job.req_id)
            if r is not None and r.finished and not self.ledger.has_jobs(job.req_id):
                del self._requests[job.req_id]  # (its store_due entry went at _finish)
        # one tier update for all the finished stores
        if stored_failed:
            self.store.complete_store(stored_failed, ok=False)
        if stored_ok:
            self.store.complete_store(stored_ok, ok=True)
        return failed_blocks

    def request_finished(self, req_id: ReqId, num_tokens: int | None = None) -> bool:
        """The engine is done with the request. Remaining chunks (up to
        ``num_tokens``, the tokens whose KV it computed) are stored by the next
        ``build_step`` via ``finished``. Returns whether the request's blocks
        must stay allocated until its stores land: stores are in flight, or
        its last chunks are stored next step (blocks freed now could be
        reallocated, zeroed or overwritten before a store reads them)."""
        r = self._requests.get(req_id)
        if r is None:
            return False
        r.engine_finished = True
        r.finish_tokens = num_tokens
        self._awaiting_final_store.add(req_id)
        self._lookups.end_deferral(r)
        final_store_due = (
            self.stores
            and num_tokens is not None
            and (
                (num_tokens >= r.next_store_at and req_id not in self._loads.loading)
                or self._pacing.tail_due(r, num_tokens)
            )
        )
        return final_store_due or self.ledger.has_store_jobs(req_id)

    # -- prefill/decode hand-off ------------------------------------------------------------------
    def handoff(self, req_id: ReqId, upto: int) -> tuple[int, bytes]:
        """A finished prefill's hand-off: of its first ``upto`` tokens (its
        prompt), how many its stored entries cover (whole chunks, then the
        prompt's tail), and the digest of those entries' keys
        (:meth:`handoff_digest`). Call before :meth:`request_finished`."""
        r = self._requests[req_id]
        self._keys.refresh(r)
        tokens = covered_tokens(r, self.groups, upto)
        digest = self.handoff_digest(req_id, tokens)
        assert digest is not None
        return tokens, digest

    def handoff_digest(self, req_id: ReqId, tokens: int) -> bytes | None:
        """Digest of the keys of the entries holding ``req_id``'s first
        ``tokens`` tokens, under this scheduler's key space: equal on two
        engines exactly when they name the same chunks (same namespace, epoch,
        tokens and salt). None: its keys do not reach ``tokens``."""
        r = self._requests[req_id]
        self._keys.refresh(r)
        keys = handoff_keys(r, self.groups, tokens)
        if keys is None:
            return None
        return hashlib.blake2b(b"".join(keys), digest_size=16, person=b"kvsdk pd").digest()

    def _finish(self, req_id: ReqKey) -> None:
        self._awaiting_final_store.discard(req_id)
        self.store_due.pop(req_id, None)  # it stores nothing more
        self.ledger.forget(req_id)
        r = self._requests.get(req_id)
        if r is None:
            return
        r.finished = True
        if not self.ledger.has_jobs(req_id):
            del self._requests[req_id]

    # -- housekeeping ---------------------------------------------------------------------------
    def job_request(self, job_id: int) -> ReqId:
        """The engine's id of the request a job belongs to."""
        key = self.ledger.job(job_id).req_id
        return key if isinstance(key, str) else key[0]

    def job_requests(self, jobs: Iterable[TransferJob]) -> list[ReqId]:
        """``job_request`` of each job, in one call."""
        keys = self.ledger.owners(j.job_id for j in jobs)
        return [k if isinstance(k, str) else k[0] for k in keys]

    def has_pending_work(self) -> bool:
        return (
            self.ledger.num_jobs > 0
            or self.ledger.num_jobs_before_reset > 0
            or bool(self._awaiting_final_store)
            or self.store.has_pending_work()
        )

    def reset(self) -> frozenset[int]:
        """Forget every stored chunk and in-flight job; returns ids to flush.

        Scoped to this instance: the host tier and in-flight state are
        dropped, and the keys move to a fresh random epoch
        (:func:`~kvsdk.keys.epoch_fingerprint`), so nothing stored before
        the reset is served to this instance after it, while the shared
        tiers keep every entry for the other instances (a full wipe is
        ``kvsdk clear``).

        A fence for the engine's workers: the host slots their jobs in flight
        copy into or out of stay taken until those jobs are reported
        (:meth:`worker_results`), and those reports are credited to no
        request; the returned ids ask the workers to finish them first."""
        held = [k for job in self.ledger.in_flight_jobs() for k in job.keys]
        self._keys.new_epoch(epoch_fingerprint(self.namespace.fingerprint, os.urandom(16)))
        self._resets += 1
        flush = self.ledger.reset()
        # finished requests store nothing more: their KV predates the reset
        for req_id in [rid for rid, r in self._requests.items() if r.finished or r.engine_finished]:
            del self._requests[req_id]
            self.store_due.pop(req_id, None)
        self._awaiting_final_store.clear()
        self._finishing.clear()
        for r in self._requests.values():
            r.next_store_chunk = [0] * len(self.groups)
            r.keys = [[] for _ in self.groups]  # the new epoch's, derived again when needed
            r.tail = None  # its key is the old epoch's
            self._pacing.update(r)
        self._loads.reset()
        self.store.reset(held)
        return frozenset(flush)

    def take_events(self) -> list[KVEvent]:
        return self.store.events.take_events()

    def num_tracked_requests(self) -> int:
        return len(self._requests)
