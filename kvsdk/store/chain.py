"""The tier chain: the ordered storage tiers below the host tier, for every adapter.

Tier 0 is the host tier (kvsdk's slab for vLLM, SGLang's own host pool);
the chain's tiers are numbered from 1, in config order, in events and
metrics. The vLLM path (:class:`~kvsdk.store.tiered.TieredStore`) calls the
I/O primitives from its I/O pool and books their results on its scheduler
thread; SGLang's storage level calls the synchronous walks from SGLang's
own threads.

I/O primitives (any thread; a failing tier never raises: its answer is a
miss or a refused write, counted in ``kvsdk_backend_errors_total`` and
logged once per burst, like the failures a tier absorbs itself and reports
in ``error_count()``; every call is timed in ``kvsdk_backend_seconds``).
A tier's first failure logs ``kvsdk: tier N (name) down: <reason>`` once;
its first success of the same operation afterwards, while it is not
skipping calls (``Backend.available()``), logs ``kvsdk: tier N (name) back
up after F failures / S s`` once (:class:`TierHealth`):

- ``locate(keys)``                 the first tier holding each key
- ``read_into(t, keys, outs)``     tier ``t``'s payloads into caller buffers
  (``read_into_parts``: each payload into a list of buffers); a read with
  misses moves the tier's new integrity failures into ``kvsdk_corrupt_chunks_total``
- ``write(keys, payloads)``        write-through; the keys each tier took (a tier
  that keeps refusing writes is skipped for a while: :mod:`kvsdk.store.backoff`)

Batches reach a tier tail first: ``read_into`` and ``write`` take keys in
chain order (a prompt's first chunk first) and hand them to the tier
reversed, so a tier that orders eviction by use (the disk tier, Redis' LRU)
uses a chain's head last and evicts its tail first (see :mod:`kvsdk.eviction`).
- ``delete(t, keys)`` / ``clear()``

Bookkeeping (events and byte counters, under :attr:`lock`):
``stored`` / ``removed`` / ``cleared`` / ``note_misses`` / ``publish``.
With ``track_keys`` the chain remembers (boundedly) which keys each tier
holds, so a key stored twice is one STORED event and a known key a tier no
longer serves becomes a REMOVED event.

Synchronous walks (SGLang): ``lookup`` locates and books, ``read_through``
reads each key from the first tier that serves it, ``write_through`` writes
and books, ``copy_up`` copies what a lower tier served into the tiers above
it in the background, ``clear_all`` clears and books.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvsdk.backend import Backend
from kvsdk.burst_log import BurstLog
from kvsdk.config import StoreBackoffConfig
from kvsdk.events import EventKind, EventTracker
from kvsdk.metrics import Metrics
from kvsdk.store.backoff import StoreBackoff
from kvsdk.store.health import TierHealth
from kvsdk.trust import redact
from kvsdk.types import ChunkKey

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

Payload = memoryview | Sequence[memoryview]
"""A chunk's bytes: one flat view, or a list (or tuple) of the flat views of its parts."""

ReadFn = Callable[[Backend, int, list[int]], list[bool]]
"""``read(tier, t, indices)``: read the batch's keys at ``indices`` from
``tier`` (number ``t``) into their destinations; per index whether it was read."""

MAX_COPY_UPS_IN_FLIGHT = 64
"""Background copies up the chain; beyond it a copy is skipped."""


class _KnownKeys:
    """Keys a tier is believed to hold (bounded, oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()

    def add(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Adds keys; returns those that were not known."""
        new = []
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
                new.append(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return new

    def drop(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Forgets keys; returns those that were known."""
        return [k for k in keys if self._keys.pop(k, 0) is None]

    def clear(self) -> None:
        self._keys.clear()


class TierChain:
    """The ordered tiers below the host tier (see the module docstring)."""

    def __init__(
        self,
        tiers: Sequence[Backend],
        *,
        metrics: Metrics,
        events: EventTracker,
        item_bytes: int,
        track_keys: int = 0,
        copy_up: bool = False,
        store_backoff: StoreBackoffConfig | None = None,
    ) -> None:
        """``item_bytes``: bytes of one chunk (for byte counters);
        ``track_keys``: keys remembered per tier (0: none); ``copy_up``: run
        a background thread for :meth:`copy_up`; ``store_backoff``: when to
        pause a tier's stores (defaults: ``StoreBackoffConfig()``)."""
        self.tiers = tuple(tiers)
        self.metrics = metrics
        self.events = events
        self.item_bytes = item_bytes
        self.lock = threading.Lock()
        """Guards the events and the known keys (take it to annotate or drain events)."""
        self._burst = BurstLog(log)
        self._known = [_KnownKeys(track_keys) for _ in self.tiers] if track_keys else []
        self._corrupt_seen = [self._corrupt_count(t) for t in self.numbers]
        self._errors_seen = [0] * len(self.tiers)
        self._health = TierHealth(log)
        self.backoff = StoreBackoff(
            {t: self._name(t) for t in self.numbers}, store_backoff or StoreBackoffConfig(), metrics
        )
        if self.tiers:
            metrics.add_gauge_source(self.backoff.gauges)
        for t in self.numbers:  # e.g. a directory the tier could not create at start
            if n := self._count_errors(t):
                # down until a write succeeds (what such a failure stops)
                reason = f"start: {n} failure(s) absorbed by the tier (its warning names the cause)"
                self._health.failed(t, self._name(t), "put", n, reason)
        self._copier = (
            ThreadPoolExecutor(1, thread_name_prefix="kvsdk-copy-up")
            if copy_up and len(self.tiers) > 1
            else None
        )
        self._copies = 0

    @property
    def numbers(self) -> range:
        """The tiers' numbers (1, 2, ...)."""
        return range(1, len(self.tiers) + 1)

    def tier(self, t: int) -> Backend:
        return self.tiers[t - 1]

    def __len__(self) -> int:
        return len(self.tiers)

    @property
    def all_indexed(self) -> bool:
        """Whether every tier answers ``may_contain`` from a local index."""
        return bool(self.tiers) and all(t.supports_local_index for t in self.tiers)

    def may_contain(self, key: ChunkKey) -> bool:
        """Whether any tier's local index holds ``key`` possibly (no I/O; a tier
        whose index fails to answer says yes: it is asked)."""
        for tier in self.tiers:
            try:
                if tier.may_contain((key,))[0]:
                    return True
            except Exception:
                return True
        return False

    # -- I/O primitives ------------------------------------------------------------------
    def locate(self, keys: Sequence[ChunkKey]) -> list[int]:
        """The number of the first tier holding each key (-1: none)."""
        where = [-1] * len(keys)
        todo = list(range(len(keys)))
        for t in self.numbers:
            if not todo:
                break
            found = self._call(t, "exists", self.tier(t).exists, [keys[i] for i in todo])
            if found is None:
                continue
            rest = []
            for i, ok in zip(todo, found):
                if ok:
                    where[i] = t
                else:
                    rest.append(i)
            todo = rest
        return where

    def read_into(self, t: int, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Tier ``t``'s payloads into ``outs`` (each filled exactly); per key whether read."""
        return self._read(t, self.tier(t).get_into, keys, outs)

    def read_into_parts(
        self, t: int, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """Like :meth:`read_into`, each payload into the buffers ``outs[i]`` in order."""
        return self._read(t, self.tier(t).get_into_parts, keys, outs)

    def _read(
        self, t: int, fn: Callable[..., list[bool]], keys: Sequence[ChunkKey], outs: Sequence[_T]
    ) -> list[bool]:
        got = self._call(t, "get", lambda k: fn(k[::-1], outs[::-1]), keys)  # tail first
        ok = [False] * len(keys) if got is None else [bool(x) for x in reversed(got)]
        if not all(ok):
            self._count_corrupt(t)
        return ok

    def write(
        self,
        keys: Sequence[ChunkKey],
        payloads: Sequence[Payload],
        tiers: Sequence[int] | None = None,
    ) -> dict[int, list[ChunkKey]]:
        """Write through to every tier (or the tiers numbered ``tiers``): the keys
        each tier took (none where it failed). Payloads given as lists of parts
        go to ``put_parts``."""
        items = list(zip(keys, payloads))[::-1]  # tail first (the module's docstring)
        in_parts = bool(payloads) and isinstance(payloads[0], (list, tuple))
        stored: dict[int, list[ChunkKey]] = {}
        backoff = self.backoff
        for t in self.numbers if tiers is None else tiers:
            if not backoff.accepts(t):
                backoff.skipped(t, len(items))
                stored[t] = []
                continue
            tier = self.tier(t)
            put: Callable[[list[Any]], list[bool]] = tier.put_parts if in_parts else tier.put
            ok = self._call(t, "put", put, items)
            stored[t] = [] if ok is None else [k for k, good in zip(keys, reversed(ok)) if good]
            if items:
                backoff.written(t, bool(stored[t]))
        return stored

    def accepts_stores(self) -> bool:
        """Whether some tier is offered stores now (none: a write-through is skipped)."""
        return any(self.backoff.accepts(t) for t in self.numbers)

    def skip_stores(self, n: int) -> None:
        """``n`` chunks were not written through: every tier's stores are paused."""
        for t in self.numbers:
            self.backoff.skipped(t, n)

    def delete(self, t: int, keys: Sequence[ChunkKey]) -> int:
        """Drop ``keys`` from tier ``t``; how many it held."""
        return self._call(t, "delete", self.tier(t).delete, keys) or 0

    def clear(self) -> list[int]:
        """Clear every tier; the numbers of those that were cleared."""
        done = []
        for t in self.numbers:
            if self._call(t, "clear", _clear, self.tier(t)):
                done.append(t)
        return done

    def close(self) -> None:
        """Finish background copies, then close every tier (errors logged)."""
        self.metrics.remove_gauge_source(self.backoff.gauges)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:
                log.warning("closing %s failed: %s", type(tier).__name__, exc)

    def _call(self, t: int, op: str, fn: Callable[[_T], _R], arg: _T) -> _R | None:
        """``fn(arg)`` on tier ``t``, timed; None if the tier failed."""
        start = time.perf_counter()
        try:
            out = fn(arg)
        except Exception as exc:
            self._failed(t, op, exc)
            return None
        finally:
            self.metrics.observe(
                "kvsdk_backend_seconds", time.perf_counter() - start, tier=t, op=op
            )
        absorbed = self._count_errors(t)
        if absorbed:
            reason = (
                f"{op}: {absorbed} failure(s) absorbed by the tier (its warning names the cause)"
            )
            self._health.failed(t, self._name(t), op, absorbed, reason)
        else:
            self._health.succeeded(t, self._name(t), op, self._available(t))
        return out

    def _name(self, t: int) -> str:
        return str(getattr(self.tier(t), "name", type(self.tier(t)).__name__))

    def _available(self, t: int) -> bool:
        try:
            return bool(self.tier(t).available())
        except Exception:
            return False

    def _failed(self, t: int, op: str, exc: BaseException) -> None:
        n = self._count_errors(t, raised=True)
        reason = f"{op}: {type(exc).__name__}: {redact(str(exc))}"
        self._health.failed(t, self._name(t), op, n, reason)
        self._burst.warning(
            f"tier{t}-{op}",
            "tier %d (%s) %s failed, serving misses: %s",
            t,
            type(self.tier(t)).__name__,
            op,
            redact(str(exc)),
        )

    def _corrupt_count(self, t: int) -> int:
        try:
            return self.tier(t).corrupt_count()
        except Exception:
            return 0

    def _count_errors(self, t: int, raised: bool = False) -> int:
        """Failures tier ``t`` absorbed since last asked (its ``error_count()``)
        → ``kvsdk_backend_errors_total``; a call that raised counts at least one
        (a backend may count the failure it then raised: not twice). Returns
        how many were counted."""
        try:
            seen = self.tier(t).error_count()
        except Exception:
            seen = 0
        with self.lock:
            new = seen - self._errors_seen[t - 1]
            if new > 0:
                self._errors_seen[t - 1] = seen
        n = max(new, 1) if raised else max(new, 0)
        if n > 0:
            self.metrics.inc("kvsdk_backend_errors_total", n, tier=t)
        return n

    def _count_corrupt(self, t: int) -> None:
        """Integrity failures tier ``t`` counted since last asked → metrics."""
        seen = self._corrupt_count(t)
        with self.lock:
            new = seen - self._corrupt_seen[t - 1]
            if new > 0:
                self._corrupt_seen[t - 1] = seen
        if new > 0:
            self.metrics.inc("kvsdk_corrupt_chunks_total", new, tier=t)

    # -- bookkeeping ---------------------------------------------------------------------
    def stored(self, t: int, keys: Sequence[ChunkKey]) -> None:
        """Tier ``t`` took ``keys``: bytes counted, STORED event (once per known key)."""
        if not keys:
            return
        with self.lock:
            new = self._known[t - 1].add(keys) if self._known else keys
            self._record(EventKind.STORED, new, t)
        if new:
            self.metrics.inc("kvsdk_stored_bytes_total", len(new) * self.item_bytes, tier=t)

    def removed(self, t: int, keys: Sequence[ChunkKey]) -> None:
        """Tier ``t`` dropped ``keys`` (e.g. deleted for a tenant over its share)."""
        with self.lock:
            if self._known:
                self._known[t - 1].drop(keys)
            self._record(EventKind.REMOVED, keys, t)

    def cleared(self, t: int) -> None:
        with self.lock:
            if self._known:
                self._known[t - 1].clear()
            self._record(EventKind.CLEARED, [], t)

    def note_misses(self, keys: Sequence[ChunkKey], where: Sequence[int]) -> None:
        """After a walk that found each key at tier ``where[i]`` (-1: nowhere):
        known keys the tiers before it no longer serve are REMOVED events, and
        the tiers' new integrity failures are counted."""
        for t in self.numbers:
            missed = [k for k, w in zip(keys, where) if w < 0 or w > t]
            if not missed:
                break
            if self._known:
                with self.lock:
                    gone = self._known[t - 1].drop(missed)
                    self._record(EventKind.REMOVED, gone, t)
            self._count_corrupt(t)

    def publish(self) -> None:
        with self.lock:
            self.events.publish()

    def _record(self, kind: EventKind, keys: Sequence[ChunkKey], t: int) -> None:
        tier = self.tier(t)
        self.events.record(kind, keys, tier=t, medium=tier.medium, locality=tier.locality)

    # -- synchronous walks ---------------------------------------------------------------
    def read_through(self, keys: Sequence[ChunkKey], read: ReadFn) -> list[int]:
        """Read each key from the first tier that serves it (``read`` moves the
        bytes); per key the tier's number, or -1. Counts loaded bytes, books misses."""
        where = [-1] * len(keys)
        todo = list(range(len(keys)))
        for t in self.numbers:
            if not todo:
                break
            ok = read(self.tier(t), t, todo)
            hits = [i for i, good in zip(todo, ok) if good]
            for i in hits:
                where[i] = t
            if hits:
                self.metrics.inc("kvsdk_loaded_bytes_total", len(hits) * self.item_bytes, tier=t)
            todo = [i for i, good in zip(todo, ok) if not good]
        self.note_misses(keys, where)
        self.publish()
        return where

    def lookup(self, keys: Sequence[ChunkKey]) -> list[int]:
        """:meth:`locate` and book it: lookup hits per tier and misses counted,
        misses noted (see :meth:`note_misses`)."""
        where = self.locate(keys)
        for t in self.numbers:
            hits = sum(1 for w in where if w == t)
            if hits:
                self.metrics.inc("kvsdk_lookup_hits_total", hits, tier=t)
        misses = sum(1 for w in where if w < 0)
        if misses:
            self.metrics.inc("kvsdk_lookup_misses_total", misses)
        self.note_misses(keys, where)
        self.publish()
        return where

    def write_through(
        self,
        keys: Sequence[ChunkKey],
        payloads: Sequence[Payload],
        tiers: Sequence[int] | None = None,
    ) -> list[bool]:
        """:meth:`write` and book it; per key whether some tier took it (a
        refused write counts in ``kvsdk_allocation_failures_total``)."""
        stored = self.write(keys, payloads, tiers)
        took: set[ChunkKey] = set()
        for t, tkeys in stored.items():
            if len(tkeys) < len(keys):
                self.metrics.inc("kvsdk_allocation_failures_total", len(keys) - len(tkeys))
            self.stored(t, tkeys)
            took.update(tkeys)
        self.publish()
        return [k in took for k in keys]

    def copy_up(
        self, t: int, keys: Sequence[ChunkKey], payloads: Callable[[], Sequence[Payload]]
    ) -> None:
        """In the background, write what tier ``t`` served into the tiers above
        it. ``payloads()`` is called now, and must return bytes that stay valid
        until then (copies). Skipped when the chain has no copier or too many
        copies are in flight."""
        if self._copier is None or t <= 1:
            return
        with self.lock:
            if self._copies >= MAX_COPY_UPS_IN_FLIGHT:
                return
            self._copies += 1
        try:
            data = payloads()
        except BaseException:
            with self.lock:
                self._copies -= 1
            raise

        def run() -> None:
            try:
                self.write_through(keys, data, range(1, t))
            finally:
                with self.lock:
                    self._copies -= 1

        try:
            self._copier.submit(run)
        except RuntimeError:  # shut down
            with self.lock:
                self._copies -= 1

    def clear_all(self) -> None:
        """Clear every tier and book it (a CLEARED event per tier cleared)."""
        for t in self.clear():
            self.cleared(t)
        self.publish()


def _clear(tier: Backend) -> bool:
    tier.clear()
    return True
