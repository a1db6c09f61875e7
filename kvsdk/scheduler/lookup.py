"""Lookups: the tokens past the engine's own that a request can load now (the
planner's hit, extended by the prompt's tail), and the lookup metrics.

A hit is a promise the engine may cut or decline before it allocates (vLLM:
one token fewer where it loads in the step, a sub-block tail where its own
cache holds the block, every tail hit where its auxiliary outputs cap hits to
whole cached blocks, ``cap_external_hit``). ``kvsdk_hit_tokens_total`` counts
the tokens the engine took (:meth:`Lookups.accepted`), not the promise: a
declined hit loads nothing and counts nothing."""

from __future__ import annotations

import time
from functools import partial

from kvsdk.metrics import Metrics
from kvsdk.planner import BeingLoaded, LookupFn, LookupPlanner, LookupRunFn, PlanRequest
from kvsdk.scheduler.request import RequestState
from kvsdk.scheduler.tail import tail_lookup
from kvsdk.store.tiered import TieredStore
from kvsdk.types import ReqId


class Lookups:
    def __init__(
        self,
        planner: LookupPlanner,
        store: TieredStore,
        metrics: Metrics,
        *,
        min_chunk_tokens: int,
        max_load_tokens: int | None,
    ) -> None:
        self.planner = planner
        self.store = store
        self.metrics = metrics
        self.min_chunk_tokens = min_chunk_tokens
        self.max_load_tokens = max_load_tokens
        self._sync_delay = metrics.histogram("kvsdk_lookup_delay_seconds", kind="sync")
        self._sync_delays: list[float] = []
        self._hit_tokens = 0
        """Planner times and accepted hit tokens not yet in the metrics (flushed once per step)."""

    def hit(
        self,
        req_id: ReqId,
        r: RequestState,
        max_num_new_tokens: int | None,
        being_loaded: BeingLoaded,
    ) -> int | None:
        """Tokens of ``r`` (its keys derived) beyond ``r.num_computed_local``
        that can be loaded; None: ask again."""
        start = time.perf_counter()
        hit = self._plan(req_id, r, max_num_new_tokens, being_loaded)
        if hit is None and self.store.settle_queries():
            try:  # the slower tiers answered within the step's wait: ask again
                hit = self._plan(req_id, r, max_num_new_tokens, being_loaded)
            finally:
                self.store.end_settled()
        if hit is None and self.store.settle_promotions():
            try:  # its chunks reached host RAM within the step's wait: ask again
                hit = self._plan(req_id, r, max_num_new_tokens, being_loaded)
            finally:
                self.store.end_settled()
        now = time.perf_counter()
        self._sync_delays.append(now - start)
        if hit is None:
            if r.deferred_since is None:
                r.deferred_since = start
            return None
        self.end_deferral(r, now)
        return hit

    def accepted(self, num_tokens: int) -> None:
        """The engine allocated blocks for ``num_tokens`` of a hit (what it
        took of the promise): counted as hit tokens."""
        self._hit_tokens += num_tokens

    def _plan(
        self,
        req_id: ReqId,
        r: RequestState,
        max_num_new_tokens: int | None,
        being_loaded: BeingLoaded,
    ) -> int | None:
        computed = r.num_computed_local
        lookup, lookup_run = self._store_lookups(r.tenant)
        plan = self.planner.plan(
            PlanRequest(
                req_id=req_id,
                num_tokens=r.num_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=computed,
                group_keys=r.keys,
                max_load_tokens=self.max_load_tokens,
            ),
            lookup,
            max_num_new_tokens=max_num_new_tokens,
            being_loaded=being_loaded,
            lookup_run=lookup_run,
        )
        if plan is None:
            if r.tail is not None:  # its query and promotion go with the chunks'
                for key in r.tail.keys:
                    lookup(key)
            return None
        return self._with_tail(r, computed, plan.num_hit_tokens, being_loaded, lookup)

    def _store_lookups(self, tenant: str) -> tuple[LookupFn, LookupRunFn]:
        """The store's lookups for ``tenant``'s request: what they promote is charged
        to its quota account (the plain ones when no quota sets one apart)."""
        store = self.store
        if not tenant or not store.tenant_quotas:
            return store.lookup, store.lookup_run
        return partial(store.lookup, tenant=tenant), partial(store.lookup_run, tenant=tenant)

    def _with_tail(
        self,
        r: RequestState,
        computed: int,
        hit: int,
        being_loaded: BeingLoaded,
        lookup: LookupFn,
    ) -> int:
        """``hit`` extended by the prompt's tail where it is readable now."""
        t = r.tail
        if t is None or not t.start <= computed + hit < t.end:
            return hit
        if len(r.keys[0]) * self.min_chunk_tokens > t.start:
            return hit  # the request grew past its prompt: a whole chunk is named there now
        if self.max_load_tokens is not None and t.end - computed > self.max_load_tokens:
            return hit
        # A tail on its way up from a slower tier is not waited for: it saves less
        # than a block of compute, and a deferred request loses a whole engine step
        # (its promotion goes on: a repeat finds it in host RAM).
        return t.end - computed if tail_lookup(t, lookup, being_loaded) else hit

    def end_deferral(self, r: RequestState, now: float | None = None) -> None:
        """``r``'s lookups, if any was deferred, end: their delay until
        ``now`` (default: the present) goes into the metrics."""
        if r.deferred_since is not None:
            if now is None:
                now = time.perf_counter()
            self.metrics.observe("kvsdk_lookup_delay_seconds", now - r.deferred_since, kind="async")
            r.deferred_since = None

    def flush_metrics(self) -> None:
        """Put the planner times and accepted hit tokens gathered since the last flush
        into the metrics (once per step)."""
        if self._hit_tokens:
            self.metrics.inc("kvsdk_hit_tokens_total", self._hit_tokens)
            self._hit_tokens = 0
        if self._sync_delays:
            self._sync_delay.observe_many(self._sync_delays)
            self._sync_delays.clear()
