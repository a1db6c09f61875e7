"""The tiered store: the manager the planner asks.

Primitives, in the order an adapter calls them:

- ``lookup(key)``           HIT (readable in host RAM) / HIT_PENDING (being
                             promoted from a slower tier) / RETRY (a slower
                             tier is being asked) / MISS
- ``prepare_load(keys)``    host slots to copy from; entries pinned
- ``complete_load(keys)``   unpin
- ``admit(keys, tails)``    of a step's offer, the keys worth storing
                             (``admission.policy``): once per step
- ``prepare_store(keys)``   slots for the keys not yet stored (``min_lookups``,
                             eviction, the prompt tails' share); None when
                             there is no room
- ``complete_store(keys)``  entries become readable (or are dropped on failure)
                             and are written through to slower tiers
- ``touch(keys)``           recency for eviction
- ``settle_queries()``      after a lookup answered RETRY: ask the slower tiers
                             now and wait for them, up to what is left of the
                             step's ``lookup_wait_s``; True if they answered (a
                             second lookup then says MISS or HIT_PENDING)
- ``settle_promotions()``   after a lookup answered HIT_PENDING: wait for the
                             promotions in flight, up to what is left of the
                             step's ``promotion_wait_s`` and never longer than
                             the engine's recent steps; True if they all landed
                             (a second lookup then says HIT, or MISS)
- ``step()``                once per scheduler step: send batched lookups to
                             slower tiers, apply finished I/O, publish events
- ``reset()``               this instance's view is dropped (host tier,
                             lookups, promotions); the shared tiers keep
                             their entries (the scheduler's keys move to a
                             new epoch, so none of them is served to it)

Threading: every method runs on the scheduler thread, which owns the host
index. The slower tiers (a :class:`~kvsdk.store.chain.TierChain`) are called
only from the I/O pool, with bytes going to and from slots that are reserved
(not readable) or pinned (not evictable), so the two never race; what the
I/O found is booked on the scheduler thread (``step``). The scheduler never
waits for a slow tier longer than ``lookup_wait_s`` per step (whether a chunk
is there at all: a disk's ``lstat``, a Redis ``EXISTS``), and a tier with a
local index (``Backend.may_contain``) answers a chunk it surely lacks at once,
so a request that cannot hit is not deferred a step.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvsdk.admission import SecondSight
from kvsdk.backend import Backend, HostTier
from kvsdk.config import StoreBackoffConfig
from kvsdk.events import EventKind, EventTracker
from kvsdk.metrics import Metrics, multiprocess_gauges
from kvsdk.store.chain import TierChain
from kvsdk.types import ChunkKey, LookupResult

log = logging.getLogger(__name__)


class RemoteState(enum.Enum):
    """What the store knows of a key not readable in host RAM."""

    QUERYING = "querying"
    """The slower tiers are being asked."""
    PROMOTING = "promoting"
    """Being copied from a slower tier into a reserved host slot."""
    ABSENT = "absent"
    """No slower tier had it (remembered for ``ABSENT_TTL_S``)."""


class IOKind(enum.Enum):
    """A job on the I/O pool."""

    QUERY = "query"
    """Which slower tier holds each key."""
    PROMOTE = "promote"
    """Slower tier → reserved host slots."""
    WRITE = "write"
    """Pinned host entries → every slower tier."""
    DELETE = "delete"
    """Drop a tenant's excess from a slower tier."""


_HOLDS_SLOTS = (IOKind.WRITE, IOKind.PROMOTE)
"""Jobs whose host slots stay reserved or pinned until they end."""


@dataclass(frozen=True)
class StorePlan:
    keys: tuple[ChunkKey, ...]
    """The subset of the requested keys to copy (others are stored or refused)."""
    slots: tuple[int, ...]


@dataclass
class _Remote:
    state: RemoteState
    since: float
    tier: int = -1


@dataclass
class _IO:
    kind: IOKind
    keys: list[ChunkKey]
    future: Future[Any]
    generation: int
    extra: dict[str, object] = field(default_factory=dict)


WARM_UP_KEY = bytes(32)
"""The key the slower tiers are first asked about (no chunk is named so)."""


def _warm_up(tier: Backend) -> None:
    """I/O thread: ask ``tier`` about a key once (its failure, if any, is met and
    counted by the first real call)."""
    with contextlib.suppress(Exception):
        tier.exists([WARM_UP_KEY])


TAIL_OWNER = "\0prompt tails"
"""The host-tier owner prompt tails are reserved under (no tenant can be named so)."""


class TieredStore:
    ABSENT_TTL_S = 1.0
    """A slow-tier miss is remembered this long (another instance may store it later)."""
    PENDING_GIVE_UP_S = 10.0
    """A chunk whose query or promotion has been in flight this long is a miss to
    lookups: the request computes it rather than wait on (the I/O goes on, its
    host slots held, and lands for later requests). A tier's call bounds it
    first as a rule; a read into host slots that cannot be abandoned (the
    mooncake tier's) may take the store's own timeout, ~30 s, to return."""
    QUERY_S_WEIGHT = 0.25
    """Weight of the latest query's duration in the moving average of them."""
    STEPS_KEPT = 15
    """Steps whose duration the promotion wait's bound is the median of."""
    MAX_WRITES_IN_FLIGHT = 256
    """Write-through batches in flight; beyond it new write-throughs are dropped (counted)."""

    def __init__(
        self,
        host: HostTier,
        lower: Sequence[Backend] = (),
        *,
        events: EventTracker | None = None,
        metrics: Metrics | None = None,
        min_lookups: int = 0,
        second_sight: SecondSight | None = None,
        io_threads: int = 4,
        tenant_quotas: Mapping[str, float] | Sequence[tuple[str, float]] | None = None,
        tail_share: float = 1.0,
        lookup_wait_s: float = 0.005,
        promotion_wait_s: float = 0.0,
        store_backoff: StoreBackoffConfig | None = None,
    ) -> None:
        """``store_backoff``: when to stop offering stores to a slower tier that
        refuses them (:mod:`kvsdk.store.backoff`)."""
        self.host = host
        self.lower = tuple(lower)
        self.tiers: tuple[Backend, ...] = (host, *self.lower)
        self.events = events or EventTracker()
        self.metrics = metrics or Metrics()
        self.min_lookups = min_lookups
        self.second_sight = second_sight
        """Stores only chunks seen before while the workload does not reuse (None: every one)."""
        self.tenant_quotas = dict(tenant_quotas or {})
        self.tail_slots = max(1, int(tail_share * host.num_slots))
        """Host slots prompt tails may hold together (``prompt_tail_share``)."""
        self._lookup_counts: OrderedDict[ChunkKey, int] = OrderedDict()
        self._remote: dict[ChunkKey, _Remote] = {}
        self._to_query: list[ChunkKey] = []
        self.lookup_wait_s = lookup_wait_s
        """Time the scheduler thread may wait per step for slower tiers to answer lookups."""
        self._wait_left = lookup_wait_s
        self.promotion_wait_s = promotion_wait_s
        """Time the scheduler thread may wait per step for promotions to land."""
        self._promotion_wait_left = 0.0
        self._steps_s: deque[float] = deque(maxlen=self.STEPS_KEPT)
        """The latest times between two steps (the engine's steps; their median
        is not moved by the one after an idle spell)."""
        self._last_step: float | None = None
        self._query_s = 0.0
        """Moving average of how long the slower tiers take to answer a query."""
        self._query_account: dict[ChunkKey, str] = {}
        """The quota account a queried key's promotion is charged to (with ``tenant_quotas``)."""
        self._io: list[_IO] = []
        self._generation = 0
        self._slot_bytes = int(host.slab.shape[1])
        """One slot's bytes, read once: a torch call costs the scheduler's hot path
        hundreds of microseconds between engine steps (measured in vLLM's EngineCore)."""
        self.chain = TierChain(
            self.lower,
            metrics=self.metrics,
            events=self.events,
            item_bytes=self._slot_bytes,
            store_backoff=store_backoff,
        )
        self._store_tenant: dict[ChunkKey, str] = {}
        self._lower_owned: dict[tuple[int, str], OrderedDict[ChunkKey, None]] = {}
        self._lower_capacity: dict[int, int] = {}
        self._hits = self._misses = self._deferred = 0  # flushed to metrics by step()
        self._index_misses = self._settled = self._unsettled = 0
        self._waited_promotions = 0
        self._settled_now = False
        """A request's lookups are asked again after ``settle_queries``: not counted
        twice for ``min_lookups``."""
        self._pool = (
            ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvsdk-io")
            if self.lower
            else None
        )
        self._shut_down = False
        """The I/O pool is shut down: nothing more is submitted to it."""
        self._indexed = self.chain.all_indexed
        """Every slower tier answers ``may_contain`` from memory."""
        self._info: list[dict[str, Any]] | None = None
        self.metrics.add_gauge_source(self.tier_info)
        if self.lower:
            self.metrics.add_gauge_source(self.tier_stats)
        self._published = multiprocess_gauges(self.metrics)
        """With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM's ``--api-server-count`` > 1),
        the gauges also go to that directory, for the API servers' ``/metrics``."""

    def tier_info(self) -> Iterator[tuple[str, dict[str, Any], float]]:
        """``kvsdk_tier_info`` of each tier, 1 with its configuration as labels:
        number, backend, medium, locality, capacity in bytes (empty when the
        tier has no byte budget, e.g. Redis) and chunk bytes. Never a path, a
        URL or a credential. Read once, at the first scrape."""
        if self._info is None:
            info = []
            for t, tier in enumerate(self.tiers):
                try:
                    cap = tier.capacity_bytes()
                except Exception:
                    cap = None
                info.append(
                    {
                        "tier": t,
                        "backend": str(getattr(tier, "name", "") or type(tier).__name__),
                        "medium": tier.medium.value,
                        "locality": tier.locality.value,
                        "capacity_bytes": "" if cap is None else int(cap),
                        "chunk_bytes": self._slot_bytes,
                    }
                )
            self._info = info
        for labels in self._info:
            yield "kvsdk_tier_info", labels, 1.0

    def tier_stats(self) -> Iterator[tuple[str, dict[str, Any], float]]:
        """Each slower tier's ``stats()`` as ``kvsdk_backend_stat`` gauges (read at
        a scrape, on the exporter's thread)."""
        for t, tier in enumerate(self.lower, start=1):
            for stat, value in tier.stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    labels = {"tier": t, "backend": type(tier).__name__, "stat": stat}
                    yield "kvsdk_backend_stat", labels, float(value)

    # -- lookups -----------------------------------------------------------------------
    def lookup(self, key: ChunkKey, tenant: str = "") -> LookupResult:
        """Where ``key`` is, for ``tenant``'s request: a key found in a slower tier
        is promoted into host slots charged to ``tenant``'s quota account."""
        if self.min_lookups and not self._settled_now:
            self._count_lookup(key)
        if self.host.slot_of(key) is not None:
            self._hits += 1
            return LookupResult.HIT
        if not self.lower:
            self._misses += 1
            return LookupResult.MISS
        remote = self._remote.get(key)
        if remote is not None and remote.state is RemoteState.PROMOTING:
            if time.monotonic() - remote.since > self.PENDING_GIVE_UP_S:
                self._misses += 1
                return LookupResult.MISS
            self._deferred += 1
            return LookupResult.HIT_PENDING
        if self.host.contains(key):  # a store of it is in flight: not readable yet
            self._misses += 1
            return LookupResult.MISS
        if remote is None or (
            remote.state is RemoteState.ABSENT
            and time.monotonic() - remote.since > self.ABSENT_TTL_S
        ):
            if self._indexed and not self.chain.may_contain(key):
                self._remote[key] = _Remote(RemoteState.ABSENT, time.monotonic())
                self._misses += 1
                self._index_misses += 1
                return LookupResult.MISS
            self._remote[key] = _Remote(RemoteState.QUERYING, time.monotonic())
            self._to_query.append(key)
            if self.tenant_quotas:
                self._query_account[key] = self.quota_account(tenant)
            remote = self._remote[key]
        if remote.state is RemoteState.ABSENT or (
            remote.state is RemoteState.QUERYING
            and time.monotonic() - remote.since > self.PENDING_GIVE_UP_S
        ):
            self._misses += 1
            return LookupResult.MISS
        self._deferred += 1
        if remote.state is RemoteState.QUERYING:
            return LookupResult.RETRY
        return LookupResult.HIT_PENDING

    def forget_absent(self, keys: Sequence[ChunkKey]) -> None:
        """Drop the slower tiers' remembered misses of ``keys`` (they are expected
        there soon): their next lookup asks the tiers again."""
        remote = self._remote
        for key in keys:
            r = remote.get(key)
            if r is not None and r.state is RemoteState.ABSENT:
                del remote[key]

    def lookup_run(
        self, keys: Sequence[ChunkKey], start: int, stop: int, tenant: str = ""
    ) -> tuple[int, int]:
        """``lookup`` over ``keys[start:stop]`` until the first MISS:
        ``(present_end, hit_end)``, where ``keys[start:present_end]`` are all
        present (HIT, HIT_PENDING or RETRY) and ``keys[start:hit_end]`` all
        plain HITs (``hit_end <= present_end``)."""
        if not self.lower and not self.min_lookups:  # host RAM only: one tight loop
            end = self.host.readable_run(keys, start, stop)
            self._hits += end - start
            if end < stop:
                self._misses += 1
            return end, end
        hit_end = -1
        i = start
        while i < stop:
            r = self.lookup(keys[i], tenant)
            if r is LookupResult.MISS:
                break
            if r is not LookupResult.HIT and hit_end < 0:
                hit_end = i
            i += 1
        return i, i if hit_end < 0 else hit_end

    def settle_queries(self) -> bool:
        """Ask the slower tiers about the keys lookups queued (RETRY) now, and
        wait for the answer up to what is left of this step's ``lookup_wait_s``.
        True if it came in time and is booked (those keys' lookups now say MISS
        or HIT_PENDING); False leaves the question to the I/O pool, answered at
        a later step, as without waiting. While the tiers' recent answers took
        longer than the wait on average, it does not wait at all."""
        if not self._to_query or self._wait_left <= 0 or self._pool is None:
            return False
        if self._query_s > self.lookup_wait_s:
            return False  # the tiers have been answering slower than the wait: don't
        keys, self._to_query = self._to_query, []
        start = time.perf_counter()
        fut: Future[Any] = self._pool.submit(self._locate, keys)
        io = _IO(IOKind.QUERY, keys, fut, self._generation)
        try:
            result = fut.result(timeout=self._wait_left)
        except TimeoutError:
            self._io.append(io)  # booked by _reap when it ends
            self._wait_left = 0.0
            self._unsettled += 1
            return False
        except Exception as exc:  # a bug in a backend: never crash serving
            log.exception("kvsdk I/O job failed: %s", exc)
            result = None
        finally:
            self._wait_left -= time.perf_counter() - start
        self._apply_query(keys, self._timed(result))
        self._settled += 1
        self._settled_now = True
        return True

    def _locate(self, keys: list[ChunkKey]) -> tuple[list[int], float]:
        """I/O thread: which tier holds each key, and how long asking took."""
        start = time.perf_counter()
        where = self.chain.locate(keys)
        return where, time.perf_counter() - start

    def _timed(self, result: tuple[list[int], float] | None) -> list[int] | None:
        """A query's answer; its duration goes into the moving average
        ``settle_queries`` compares with the wait."""
        if result is None:
            return None
        where, seconds = result
        self._query_s += self.QUERY_S_WEIGHT * (seconds - self._query_s)
        return where

    def end_settled(self) -> None:
        """The lookups asked again after ``settle_queries`` are done (counted again
        for ``min_lookups`` from here on)."""
        self._settled_now = False

    def warm_up(self) -> None:
        """Ask each slower tier about a key once, in the background, before any
        request does: their one-time work (connections, a directory check,
        threads) is not charged to the first lookup's wait."""
        if self._pool is not None:
            for tier in self.lower:
                self._pool.submit(_warm_up, tier)

    def _count_lookup(self, key: ChunkKey) -> None:
        self._lookup_counts[key] = self._lookup_counts.get(key, 0) + 1
        self._lookup_counts.move_to_end(key)
        if len(self._lookup_counts) > 4 * self.host.num_slots + 1024:
            self._lookup_counts.popitem(last=False)

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[ChunkKey]) -> list[int]:
        if self.second_sight is not None:
            self.second_sight.served(len(keys))
        return self.host.pin_readable(keys)

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        self.host.unpin(keys)

    # -- stores --------------------------------------------------------------------------
    def quota_account(self, tenant: str) -> str:
        """The account ``tenant`` is charged to: its own when ``tenant_quotas``
        lists it, else the one ``"*"`` account every unlisted tenant shares (so
        rotating salts neither adds up shares nor grows the accounting: one
        account per listed tenant, plus one)."""
        return tenant if tenant in self.tenant_quotas else "*"

    def quota_slots(self, tenant: str) -> int | None:
        """Host slots ``tenant``'s account may hold, or None (no limit)."""
        share = self.tenant_quotas.get(self.quota_account(tenant))
        return None if share is None else max(1, int(share * self.host.num_slots))

    def admit(
        self, keys: Sequence[ChunkKey], tails: Sequence[ChunkKey] = (), prompts: int = 0
    ) -> tuple[list[ChunkKey], list[ChunkKey]]:
        """Of a step's offer (``keys``, and prompt ``tails``, with the first chunks of
        ``prompts`` requests among them), the ones to give to :meth:`prepare_store`:
        all of them, or under ``second_sight`` the ones not held that it admits.
        Once per step: an offer seen twice would count as coming back."""
        sight = self.second_sight
        if sight is None:
            return list(keys), list(tails)
        out = []
        for part, n in ((keys, prompts), (tails, 0)):
            new = self.host.absent(part) if part else []
            out.append(sight.admit(len(part) - len(new), new, n))
        return out[0], out[1]

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        tenant: str = "",
        tails: Sequence[ChunkKey] = (),
    ) -> StorePlan | None:
        """``tenant``'s account is charged for the new entries (see ``tenant_quotas``).
        ``tails`` (prompt tails, apart from ``keys``) share ``tail_slots`` among
        themselves, the least recently used making room: the ones that get no slot are left
        out of the plan; None only when ``keys`` do not fit."""
        tenant = self.quota_account(tenant) if self.tenant_quotas else ""
        new = self.host.absent(keys)
        new_tails = self.host.absent(tails) if tails else []
        if self.min_lookups:
            counts = self._lookup_counts
            new = [k for k in new if counts.get(k, 0) >= self.min_lookups]
            new_tails = [k for k in new_tails if counts.get(k, 0) >= self.min_lookups]
        new_tails = new_tails[-self.tail_slots :]  # more than their share at once: the last
        if not new and not new_tails:
            return StorePlan((), ())
        reserved = (
            self.host.reserve(new, owner=tenant, limit=self.quota_slots(tenant))
            if new
            else ([], [])
        )
        if reserved is None:
            self.metrics.inc("kvsdk_allocation_failures_total")
            return None
        slots, evicted = reserved
        if new_tails:
            got = self.host.reserve(new_tails, owner=TAIL_OWNER, limit=self.tail_slots)
            if got is not None:
                new, slots, evicted = [*new, *new_tails], [*slots, *got[0]], [*evicted, *got[1]]
        if evicted:
            self.metrics.inc("kvsdk_evictions_total", len(evicted), tier=0)
            self._record(EventKind.REMOVED, evicted, 0)
        if not new:
            return StorePlan((), ())
        if self._remote:
            for key in new:
                self._remote.pop(key, None)
        if self.tenant_quotas:
            self._store_tenant.update(dict.fromkeys(new, tenant))
        return StorePlan(tuple(new), tuple(slots))

    def complete_store(self, keys: Sequence[ChunkKey], ok: bool = True) -> None:
        stored = self.host.commit(keys, ok)
        tenants = [self._store_tenant.pop(k, "") for k in keys] if self._store_tenant else []
        if not stored:
            return
        self.metrics.inc("kvsdk_stored_bytes_total", len(stored) * self._slot_bytes, tier=0)
        self._record(EventKind.STORED, stored, 0)
        if self.lower:
            if tenants:
                of = dict(zip(keys, tenants, strict=True))
                for tenant in set(tenants):
                    self._write_through([k for k in stored if of[k] == tenant], tenant)
            else:
                self._write_through(stored)

    def discard(self, keys: Sequence[ChunkKey]) -> None:
        """Drop host entries that must not be served again (e.g. a load from them failed)."""
        present = [k for k in keys if self.host.slot_of(k) is not None]
        if present and self.host.delete(present):
            self._record(EventKind.REMOVED, present, 0)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self.host.touch(keys)

    # -- slow tiers -----------------------------------------------------------------------
    def settle_promotions(self) -> bool:
        """Wait for the promotions in flight, up to what is left of this step's
        ``promotion_wait_s`` and at most the engine's median step (a deferred
        request loses about a step: waiting longer than that is the worse
        choice); then book what finished. True if every promotion landed."""
        if self._promotion_wait_left <= 0 or not self._steps_s or self._shut_down:
            return False
        budget = min(self._promotion_wait_left, sorted(self._steps_s)[len(self._steps_s) // 2])
        pending = [io.future for io in self._io if io.kind is IOKind.PROMOTE]
        if not pending:
            return False
        start = time.perf_counter()
        _, not_done = wait(pending, timeout=budget)
        self._promotion_wait_left -= time.perf_counter() - start
        if not_done:
            self._promotion_wait_left = 0.0
        self._reap()
        self._waited_promotions += 1
        self._settled_now = True  # the lookups asked again are not counted twice
        return not not_done

    def step(self) -> None:
        """Once per scheduler step: apply finished I/O, then send this step's lookups."""
        now = time.perf_counter()
        if self._last_step is not None:
            self._steps_s.append(now - self._last_step)
        self._last_step = now
        self.flush_metrics()
        self._wait_left = self.lookup_wait_s
        self._promotion_wait_left = self.promotion_wait_s
        if self.lower:
            self._reap()
            if self._to_query:
                keys, self._to_query = self._to_query, []
                self._submit(IOKind.QUERY, keys, self._locate, keys)
        self.events.publish()

    def flush_metrics(self) -> None:
        """Move the per-lookup tallies (kept as plain ints on the hot path) into metrics."""
        if self._hits:
            self.metrics.inc("kvsdk_lookup_hits_total", self._hits, tier=0)
        if self._misses:
            self.metrics.inc("kvsdk_lookup_misses_total", self._misses)
        if self._deferred:
            self.metrics.inc("kvsdk_lookup_deferred_total", self._deferred)
        if self.second_sight is not None and self.second_sight.skipped:
            self.metrics.inc("kvsdk_admission_skipped_total", self.second_sight.take_skipped())
        if self._index_misses:
            self.metrics.inc("kvsdk_lookup_index_misses_total", self._index_misses)
        if self._settled:
            self.metrics.inc("kvsdk_lookup_waits_total", self._settled, outcome="answered")
        if self._unsettled:
            self.metrics.inc("kvsdk_lookup_waits_total", self._unsettled, outcome="timed_out")
        if self._waited_promotions:
            self.metrics.inc("kvsdk_promotion_waits_total", self._waited_promotions)
        self._hits = self._misses = self._deferred = 0
        self._index_misses = self._settled = self._unsettled = 0
        self._waited_promotions = 0

    def _charge_lower(self, t: int, tenant: str, keys: list[ChunkKey]) -> None:
        """A tenant over its share of slower tier ``t`` loses its own oldest chunks there
        (shares count what this instance wrote; the tier's capacity as it declares it)."""
        share = self.tenant_quotas.get(tenant)  # (an account: see quota_account)
        if share is None:
            return
        if t not in self._lower_capacity:
            cap = self.chain.tier(t).capacity_bytes()
            # entries, allowing for each entry's frame and file overhead
            self._lower_capacity[t] = cap // (self._slot_bytes + 256) if cap else 0
        capacity = self._lower_capacity[t]
        if not capacity:
            return  # a tier without a byte capacity (e.g. Redis): nothing to share
        owned = self._lower_owned.setdefault((t, tenant), OrderedDict())
        for k in keys:
            owned[k] = None
            owned.move_to_end(k)
        excess = len(owned) - max(1, int(share * capacity))
        if excess > 0:
            victims = [owned.popitem(last=False)[0] for _ in range(excess)]
            self._submit(IOKind.DELETE, victims, self.chain.delete, t, victims)
            self.chain.removed(t, victims)

    def has_pending_work(self) -> bool:
        return bool(self._io or self._to_query)

    def wait_io(self, timeout: float) -> bool:
        """Block until some tier I/O in flight finishes, at most ``timeout`` s.
        For an engine whose only work is that I/O (a request waiting on a
        promotion, writes draining): it sleeps on the I/O instead of spinning
        through empty steps that take the CPU the I/O threads need. False if
        nothing was in flight."""
        pending = [io.future for io in self._io if not io.future.done()]
        if not pending:
            return False
        wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        return True

    def _submit(
        self, kind: IOKind, keys: list[ChunkKey], fn: Callable[..., Any], *args: Any, **extra: Any
    ) -> None:
        assert self._pool is not None
        if self._shut_down:  # a result reaped at shutdown starts no more I/O
            return
        fut: Future[Any] = self._pool.submit(fn, *args)
        self._io.append(_IO(kind, keys, fut, self._generation, dict(extra)))

    def _promote(self, t: int, keys: list[ChunkKey], slots: list[int]) -> list[bool]:
        """I/O thread: copy keys from slower tier ``t`` straight into reserved host slots."""
        slab = self.host.slab.numpy()
        return self.chain.read_into(t, keys, [memoryview(slab[s]) for s in slots])

    def _write(self, keys: list[ChunkKey], slots: list[int]) -> dict[int, list[ChunkKey]]:
        """I/O thread: write pinned host entries through to every slower tier;
        returns the keys each tier stored."""
        slab = self.host.slab.numpy()
        return self.chain.write(keys, [memoryview(slab[s]) for s in slots])

    def _write_through(self, keys: list[ChunkKey], tenant: str = "") -> None:
        if not keys:
            return
        if not self.chain.accepts_stores():  # every slower tier refuses writes for now
            self.chain.skip_stores(len(keys))
            return
        writes = sum(1 for io in self._io if io.kind is IOKind.WRITE)
        if writes >= self.MAX_WRITES_IN_FLIGHT:
            self.metrics.inc("kvsdk_dropped_writes_total", len(keys), tier=1)
            return
        slots = [self.host.slot_of(k) for k in keys]
        self.host.pin(keys)
        self._submit(IOKind.WRITE, keys, self._write, keys, slots, tenant=tenant)

    def _reap(self) -> None:
        """Scheduler thread: apply every finished I/O job."""
        pending: list[_IO] = []
        for io in self._io:
            if not io.future.done():
                pending.append(io)
                continue
            try:
                result = io.future.result()
            except Exception as exc:  # a bug in a backend: never crash serving
                log.exception("kvsdk I/O job failed: %s", exc)
                result = None
            if io.generation != self._generation and io.kind in _HOLDS_SLOTS:
                # issued before a reset: its host entries were kept only for it
                if io.kind is IOKind.WRITE:
                    self.host.unpin(io.keys)
                    self.host.delete(io.keys)
                else:
                    self.host.commit(io.keys, False)
                continue
            if io.kind is IOKind.WRITE:
                if io.generation == self._generation:
                    self.host.unpin(io.keys)
                    for t, stored in (result or {}).items():
                        if stored and self.tenant_quotas:
                            self._charge_lower(t, str(io.extra.get("tenant", "")), stored)
                        self.chain.stored(t, stored)
                continue
            if io.generation != self._generation:
                continue  # issued before a reset: its answers are stale
            if io.kind is IOKind.QUERY:
                self._apply_query(io.keys, self._timed(result))
            elif io.kind is IOKind.PROMOTE:
                self._apply_promote(io, result)
        self._io = pending

    def _apply_query(self, keys: list[ChunkKey], where: list[int] | None) -> None:
        now = time.monotonic()
        by_tier: dict[tuple[int, str], list[ChunkKey]] = {}
        accounts = self._query_account
        for i, key in enumerate(keys):
            t = where[i] if where else -1
            account = accounts.pop(key, "") if accounts else ""
            if self.host.contains(key):
                self._remote.pop(key, None)  # stored locally meanwhile
            elif t < 0:
                self._remote[key] = _Remote(RemoteState.ABSENT, now)
            else:
                by_tier.setdefault((t, account), []).append(key)
        for (t, account), tkeys in by_tier.items():
            # the requesting tenant's account pays for the promoted entries, as for a store
            limit = self.quota_slots(account) if self.tenant_quotas else None
            if limit is not None and len(tkeys) > limit:  # the first ones its share holds
                for key in tkeys[limit:]:
                    self._remote[key] = _Remote(RemoteState.ABSENT, now)
                tkeys = tkeys[:limit]
            reserved = self.host.reserve(tkeys, owner=account, limit=limit)
            if reserved is None:
                self.metrics.inc("kvsdk_allocation_failures_total")
                for key in tkeys:
                    self._remote[key] = _Remote(RemoteState.ABSENT, now)
                continue
            slots, evicted = reserved
            if evicted:
                self.metrics.inc("kvsdk_evictions_total", len(evicted), tier=0)
                self._record(EventKind.REMOVED, evicted, 0)
            for key in tkeys:  # ``since``: when a lookup first asked (the promotion's start)
                asked = self._remote.get(key)
                self._remote[key] = _Remote(RemoteState.PROMOTING, asked.since if asked else now, t)
            self._submit(IOKind.PROMOTE, tkeys, self._promote, t, tkeys, slots, tier=t)

    def _apply_promote(self, io: _IO, ok: list[bool] | None) -> None:
        ok = ok or [False] * len(io.keys)
        good = [k for k, g in zip(io.keys, ok) if g]
        bad = [k for k, g in zip(io.keys, ok) if not g]
        self.host.commit(good, True)
        self.host.commit(bad, False)
        t = int(io.extra["tier"])  # type: ignore[call-overload]
        now = time.monotonic()
        waited = []
        for key in good:
            remote = self._remote.pop(key, None)
            if remote is not None:
                waited.append(now - remote.since)
        if waited:  # from the lookup that asked the slower tiers to the chunk readable here
            self.metrics.histogram("kvsdk_promotion_seconds", tier=t).observe_many(waited)
        for key in bad:
            self._remote[key] = _Remote(RemoteState.ABSENT, now)
        if good:
            self.metrics.inc("kvsdk_loaded_bytes_total", len(good) * self._slot_bytes, tier=t)
            self._record(EventKind.STORED, good, 0)

    # -- reset / shutdown -------------------------------------------------------------------
    def reset(self, held: Sequence[ChunkKey] = ()) -> None:
        """Drop this instance's view without waiting for any I/O: every host
        entry, lookup, promotion and query in flight, and what admission learnt
        of the traffic (it decides afresh, as at startup).

        ``held``: keys of the engine workers' jobs still in flight (a store
        copying into its reserved slots, a load copying out of pinned ones;
        a key once per job). Their entries keep their slots, never readable
        again, until :meth:`release` of each job's keys when its workers
        reported it: a slot is never handed to a new store or promotion while
        a worker may still write or read it.

        The slower tiers are shared with other instances and are not touched:
        their entries stay for everyone else (a full wipe is ``kvsdk clear``).
        The adapter's keys move to a new epoch at a reset
        (:meth:`kvsdk.scheduler.OffloadScheduler.reset`), so this instance is
        served none of them. Host entries that in-flight I/O still reads or
        writes keep their slots (never readable again) until that I/O
        finishes. What each tenant wrote to a slower tier stays charged to it."""
        self._reap()
        self._generation += 1
        busy = [io for io in self._io if io.kind in _HOLDS_SLOTS]
        self._remote.clear()
        self._to_query.clear()
        self._query_account.clear()
        self._lookup_counts.clear()
        if self.second_sight is not None:
            self.second_sight.reset()
        self._store_tenant.clear()
        held = [k for k in held if self.host.contains(k)]
        self.host.pin(held)  # one hold per job, dropped by release()
        self.host.clear(keep=[*(k for io in busy for k in io.keys), *held])
        self.events.reset()
        for t in range(len(self.tiers)):  # this instance's view of every tier is empty now
            self._record(EventKind.CLEARED, [], t)

    def release(self, keys: Sequence[ChunkKey]) -> None:
        """A job held at :meth:`reset` (``held``) was reported by its workers:
        its hold goes, and its entries with it once nothing else holds them
        (a load's own pin goes first, through :meth:`complete_load`)."""
        self.host.unpin(keys)
        self.host.delete(keys)

    def shutdown(self) -> None:
        """Finish the I/O in flight, then close every tier. (The lifecycle hooks
        belong to the store's owner, :class:`kvsdk.store.factory.StoreHandle`.)"""
        self.metrics.remove_gauge_source(self.tier_stats)
        self.metrics.remove_gauge_source(self.tier_info)
        if self._published is not None:
            self._published.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._shut_down = True
            self._reap()
        try:
            self.host.close()
        except Exception as exc:
            log.warning("closing %s failed: %s", type(self.host).__name__, exc)
        self.chain.close()

    def _record(self, kind: EventKind, keys: Sequence[ChunkKey], tier: int) -> None:
        if not self.events.enabled:
            return  # (what EventTracker.record does, without reading the tier)
        b = self.tiers[tier]
        self.events.record(kind, keys, tier=tier, medium=b.medium, locality=b.locality)
