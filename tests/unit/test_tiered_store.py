"""The tiered store over the real ``cpu`` host tier, alone and above slower
tiers written here (a dict-backed one and one that always fails)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvsdk import plugins_manager
from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.config import load_config
from kvsdk.events import EventKind, EventTracker, KVEvent
from kvsdk.hooks import hookimpl
from kvsdk.keys import Namespace
from kvsdk.metrics import Metrics
from kvsdk.store.chain import TierChain
from kvsdk.store.factory import StoreHandle, build_store
from kvsdk.store.tiered import StorePlan, TieredStore
from kvsdk.types import ChunkKey, Locality, LookupResult, Medium

SLOT = 32
TIMEOUT_S = 5.0


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(SLOT))


def make_host(slots: int = 4) -> CPUBackend:
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=SLOT)
    return CPUBackend(CPUOptions(capacity=slots * SLOT, pin_memory="never"), ctx)


class DictBackend(Backend):
    """A slower tier keeping bytes in a dict; each operation can be held at a gate."""

    name = "test-dict"
    medium = Medium.DISK
    locality = Locality.NODE

    def __init__(self) -> None:
        self.data: dict[ChunkKey, bytes] = {}
        self.lock = threading.Lock()
        self.gates = {op: threading.Event() for op in ("exists", "get", "put")}
        self.entered = {op: threading.Event() for op in ("exists", "get", "put")}
        for gate in self.gates.values():
            gate.set()

    def _enter(self, op: str) -> None:
        self.entered[op].set()
        assert self.gates[op].wait(TIMEOUT_S), f"{op} gate never opened"

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._enter("exists")
        with self.lock:
            return [key in self.data for key in keys]

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._enter("get")
        with self.lock:
            return [self.data.get(key) for key in keys]

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._enter("put")
        with self.lock:
            for key, value in items:
                self.data[key] = bytes(value)
        return [True] * len(items)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        with self.lock:
            return sum(self.data.pop(key, None) is not None for key in keys)

    def clear(self) -> None:
        with self.lock:
            self.data.clear()


class FailingBackend(Backend):
    """A slower tier whose every call fails."""

    name = "test-failing"
    medium = Medium.REMOTE
    locality = Locality.CLUSTER

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self) -> None:
        self.calls += 1
        raise BackendError("tier unreachable")

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._fail()
        return []

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._fail()
        return []

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._fail()
        return []

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        self._fail()
        return 0

    def clear(self) -> None:
        self._fail()


class GetFailsBackend(DictBackend):
    """Says it holds a chunk, then fails to read it."""

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        raise OSError("read error")


@pytest.fixture
def stores() -> Iterator[list[TieredStore]]:
    """Stores built by a test; shut down (I/O threads joined) afterwards."""
    made: list[TieredStore] = []
    yield made
    for store in made:
        for lower in store.lower:
            if isinstance(lower, DictBackend):
                for gate in lower.gates.values():
                    gate.set()
        store.shutdown()


def new_store(stores: list[TieredStore], *lower: Backend, slots: int = 4, **kw: int) -> TieredStore:
    store = TieredStore(make_host(slots), lower, io_threads=2, **kw)
    stores.append(store)
    return store


def pump(store: TieredStore) -> None:
    """Step until every I/O job has been applied."""
    deadline = time.monotonic() + TIMEOUT_S
    while store.has_pending_work():
        assert time.monotonic() < deadline, "I/O did not finish"
        store.step()
        time.sleep(0.001)
    store.step()


def wait_for(event: threading.Event, store: TieredStore) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not event.is_set():
        assert time.monotonic() < deadline, "the I/O call never started"
        store.step()
        time.sleep(0.001)


def save(store: TieredStore, keys: list[bytes]) -> None:
    """Store chunks as an adapter does: reserve, copy into the slots, complete."""
    plan = store.prepare_store(keys)
    assert plan is not None
    slab = store.host.slab.numpy()
    for key, slot in zip(plan.keys, plan.slots):
        slab[slot] = np.frombuffer(payload(key[0]), dtype=np.uint8)
    store.complete_store(plan.keys)


def read(store: TieredStore, key: bytes) -> bytes:
    (slot,) = store.prepare_load([key])
    try:
        return bytes(store.host.slab.numpy()[slot])
    finally:
        store.complete_load([key])


def events(store: TieredStore, kind: EventKind) -> list[KVEvent]:
    return [e for e in store.events.take_events() if e.kind is kind]


# -- host tier only ---------------------------------------------------------------------------


def test_lookup_misses_then_hits_after_a_store(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    assert store.lookup(k(1)) is LookupResult.MISS
    save(store, [k(1)])
    assert store.lookup(k(1)) is LookupResult.HIT
    assert read(store, k(1)) == payload(1)


def test_prepare_store_skips_stored_and_repeated_keys(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    save(store, [k(1)])
    plan = store.prepare_store([k(1), k(2), k(2), k(3)])
    assert plan is not None
    assert plan.keys == (k(2), k(3))
    assert len(set(plan.slots)) == 2


def test_failed_store_leaves_a_miss(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    plan = store.prepare_store([k(1)])
    assert plan is not None
    store.complete_store(plan.keys, ok=False)
    assert store.lookup(k(1)) is LookupResult.MISS
    assert store.host.num_used == 0
    assert events(store, EventKind.STORED) == []


def test_admission_stores_only_after_enough_lookups(stores: list[TieredStore]) -> None:
    store = new_store(stores, min_lookups=2)
    assert store.lookup(k(1)) is LookupResult.MISS
    plan = store.prepare_store([k(1), k(2)])
    assert plan is not None and plan.keys == ()  # k(1) seen once, k(2) never
    assert store.lookup(k(1)) is LookupResult.MISS
    plan = store.prepare_store([k(1), k(2)])
    assert plan is not None and plan.keys == (k(1),)
    store.complete_store(plan.keys)
    assert store.lookup(k(1)) is LookupResult.HIT


def test_stored_events_carry_tier_medium_and_locality(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    save(store, [k(1), k(2)])
    (event,) = events(store, EventKind.STORED)
    assert event.keys == (k(1), k(2))
    assert (event.tier, event.medium, event.locality) == (0, Medium.CPU, Locality.PROCESS)


def test_eviction_emits_removed_events_and_counts(stores: list[TieredStore]) -> None:
    store = new_store(stores, slots=2)
    save(store, [k(1), k(2)])
    store.touch([k(1)])
    save(store, [k(3)])
    (removed,) = events(store, EventKind.REMOVED)
    assert removed.keys == (k(2),)
    assert (removed.tier, removed.medium, removed.locality) == (0, Medium.CPU, Locality.PROCESS)
    assert store.lookup(k(2)) is LookupResult.MISS
    assert store.lookup(k(1)) is LookupResult.HIT
    assert store.metrics.counter("kvsdk_evictions_total", tier=0) == 1


def test_entries_being_loaded_are_not_evicted(stores: list[TieredStore]) -> None:
    store = new_store(stores, slots=1)
    save(store, [k(1)])
    store.prepare_load([k(1)])
    assert store.prepare_store([k(2)]) is None
    assert store.metrics.counter("kvsdk_allocation_failures_total") == 1
    store.complete_load([k(1)])
    assert store.prepare_store([k(2)]) is not None


def test_reset_emits_cleared_and_drops_everything(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    save(store, [k(1), k(2)])
    store.reset()
    assert [e.kind for e in store.events.take_events()] == [EventKind.CLEARED]
    assert store.lookup(k(1)) is LookupResult.MISS
    assert store.host.num_used == 0
    assert store.prepare_store([k(i) for i in range(4)]) is not None  # every slot free again


def test_metrics_counters_move(stores: list[TieredStore]) -> None:
    store = new_store(stores)
    store.lookup(k(1))
    save(store, [k(1), k(2)])
    store.lookup(k(1))
    store.lookup(k(2))
    store.step()  # lookup tallies reach the metrics once per step
    m = store.metrics
    assert m.counter("kvsdk_lookup_misses_total") == 1
    assert m.counter("kvsdk_lookup_hits_total", tier=0) == 2
    assert m.counter("kvsdk_stored_bytes_total", tier=0) == 2 * SLOT


# -- with slower tiers ------------------------------------------------------------------------


def test_chunk_in_a_slower_tier_is_promoted_into_host_ram(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    lower.data[k(5)] = payload(5)
    store = new_store(stores, lower)
    assert store.lookup(k(5)) is LookupResult.RETRY
    pump(store)
    assert store.lookup(k(5)) is LookupResult.HIT
    assert read(store, k(5)) == payload(5)
    (stored,) = events(store, EventKind.STORED)
    assert (stored.keys, stored.tier) == ((k(5),), 0)
    assert store.metrics.counter("kvsdk_loaded_bytes_total", tier=1) == SLOT
    assert store.metrics.counter("kvsdk_lookup_deferred_total") == 1


def test_a_lookup_answered_during_shutdown_starts_no_promotion() -> None:
    """The I/O pool drains at shutdown; a lookup it answers then (the chunk
    found) is reaped but promotes nothing (it raised "cannot schedule new
    futures after shutdown" out of the engine's shutdown)."""
    lower = DictBackend()
    lower.data[k(5)] = payload(5)
    store = TieredStore(make_host(4), [lower], io_threads=2)
    lower.gates["exists"].clear()
    assert store.lookup(k(5)) is LookupResult.RETRY
    wait_for(lower.entered["exists"], store)  # the query is in flight
    threading.Timer(0.2, lower.gates["exists"].set).start()
    store.shutdown()  # waits for the query, then reaps it
    assert lower.entered["get"].is_set() is False


def test_lookup_says_hit_pending_while_a_chunk_is_promoted(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    lower.data[k(5)] = payload(5)
    store = new_store(stores, lower)
    lower.gates["get"].clear()
    assert store.lookup(k(5)) is LookupResult.RETRY
    wait_for(lower.entered["get"], store)  # the promotion's read has started
    try:
        assert store.lookup(k(5)) is LookupResult.HIT_PENDING
    finally:
        lower.gates["get"].set()
        pump(store)
    assert store.lookup(k(5)) is LookupResult.HIT


def test_a_query_or_promotion_stuck_past_the_give_up_is_a_miss_then_lands(
    stores: list[TieredStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slower tier that does not return (a read it may not abandon): once the
    chunk's query or promotion has been in flight ``PENDING_GIVE_UP_S``, lookups
    answer MISS (the request computes it) instead of deferring it further; the
    promotion still lands in its reserved slot when the tier returns, and the
    chunk is a hit then. Without the give-up the lookups kept deferring."""
    monkeypatch.setattr(TieredStore, "PENDING_GIVE_UP_S", 0.3)
    lower = DictBackend()
    lower.data[k(5)] = payload(5)
    store = new_store(stores, lower)
    lower.gates["exists"].clear()
    assert store.lookup(k(5)) is LookupResult.RETRY
    wait_for(lower.entered["exists"], store)  # the query is stuck
    assert store.lookup(k(5)) is LookupResult.RETRY
    time.sleep(0.35)
    assert store.lookup(k(5)) is LookupResult.MISS
    lower.gates["get"].clear()
    lower.gates["exists"].set()
    wait_for(lower.entered["get"], store)  # the promotion's read is stuck now
    try:
        assert store.lookup(k(5)) is LookupResult.MISS  # asked 0.35 s ago: past the give-up
        assert store.prepare_store([k(5)]) == StorePlan((), ())  # its slot stays the promotion's
    finally:
        lower.gates["get"].set()
        pump(store)
    assert store.lookup(k(5)) is LookupResult.HIT
    assert read(store, k(5)) == payload(5)


def test_chunk_absent_everywhere_is_a_miss_after_the_query(stores: list[TieredStore]) -> None:
    store = new_store(stores, DictBackend())
    assert store.lookup(k(1)) is LookupResult.RETRY
    pump(store)
    assert store.lookup(k(1)) is LookupResult.MISS
    assert not store.has_pending_work()  # the miss is remembered, not asked again at once


def test_a_remembered_miss_is_asked_again_after_its_ttl(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    store = new_store(stores, lower)
    store.ABSENT_TTL_S = 0.0
    store.lookup(k(1))
    pump(store)
    lower.data[k(1)] = payload(1)  # another instance stored it meanwhile
    time.sleep(0.01)
    assert store.lookup(k(1)) is LookupResult.RETRY
    pump(store)
    assert store.lookup(k(1)) is LookupResult.HIT


def test_failing_tier_degrades_to_misses_and_counts_errors(stores: list[TieredStore]) -> None:
    failing = FailingBackend()
    store = new_store(stores, failing)
    assert store.lookup(k(1)) is LookupResult.RETRY
    pump(store)
    assert store.lookup(k(1)) is LookupResult.MISS
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1

    save(store, [k(2)])  # the write-through fails too; host RAM still serves it
    pump(store)
    assert store.lookup(k(2)) is LookupResult.HIT
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 2
    store.reset()  # scoped to this instance: the shared tier is not asked anything
    pump(store)
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 2
    assert failing.calls == 2


def test_failed_write_through_still_unpins_the_host_entry(stores: list[TieredStore]) -> None:
    store = new_store(stores, FailingBackend(), slots=1)
    save(store, [k(1)])
    pump(store)
    plan = store.prepare_store([k(2)])  # k(1) is evictable again
    assert plan is not None and plan.keys == (k(2),)


def test_unreadable_chunk_in_a_slower_tier_frees_its_slot(stores: list[TieredStore]) -> None:
    lower = GetFailsBackend()
    lower.data[k(1)] = payload(1)
    store = new_store(stores, lower)
    store.lookup(k(1))
    pump(store)
    assert store.lookup(k(1)) is LookupResult.MISS
    assert store.host.num_used == 0
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1


def test_write_through_puts_stored_chunks_into_the_slower_tier(
    stores: list[TieredStore],
) -> None:
    lower = DictBackend()
    store = new_store(stores, lower)
    save(store, [k(1), k(2)])
    pump(store)
    assert lower.data == {k(1): payload(1), k(2): payload(2)}
    stored = events(store, EventKind.STORED)
    assert [(e.tier, e.medium, e.locality) for e in stored] == [
        (0, Medium.CPU, Locality.PROCESS),
        (1, Medium.DISK, Locality.NODE),
    ]
    assert stored[1].keys == (k(1), k(2))
    assert store.metrics.counter("kvsdk_stored_bytes_total", tier=1) == 2 * SLOT


def test_host_entry_stays_pinned_while_written_through(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    store = new_store(stores, lower, slots=1)
    lower.gates["put"].clear()
    save(store, [k(1)])
    wait_for(lower.entered["put"], store)
    assert store.prepare_store([k(2)]) is None  # the only slot is being read by the write
    lower.gates["put"].set()
    pump(store)
    assert store.prepare_store([k(2)]) is not None


def test_promoted_chunk_is_not_written_back(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    lower.data[k(1)] = payload(1)
    store = new_store(stores, lower)
    store.lookup(k(1))
    pump(store)
    assert not lower.entered["put"].is_set()


def test_reset_during_promotion_leaves_nothing_stale(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    lower.data[k(1)] = payload(1)
    store = new_store(stores, lower)
    lower.gates["get"].clear()
    store.lookup(k(1))
    wait_for(lower.entered["get"], store)  # promotion in flight, holding a host slot
    opener = threading.Timer(0.05, lower.gates["get"].set)
    opener.start()
    store.reset()  # waits for the promotion, then discards it
    opener.join()
    pump(store)

    assert store.host.num_used == 0
    assert [e.kind for e in store.events.take_events()] == [EventKind.CLEARED] * 2
    assert lower.data == {k(1): payload(1)}  # the shared tier keeps it for other instances

    # Another instance stores new bytes under the key: those, not the promoted ones, come back.
    lower.data[k(1)] = payload(99)
    assert store.lookup(k(1)) is LookupResult.RETRY  # asked afresh, not served from before
    pump(store)
    assert store.lookup(k(1)) is LookupResult.HIT
    assert read(store, k(1)) == payload(99)


def test_reset_during_a_query_ignores_its_late_answer(stores: list[TieredStore]) -> None:
    lower = DictBackend()
    lower.data[k(1)] = payload(1)
    store = new_store(stores, lower)
    lower.gates["exists"].clear()
    store.lookup(k(1))
    wait_for(lower.entered["exists"], store)
    store.reset()
    lower.data[k(1)] = payload(1)  # so a stale "tier 1 has it" would be acted on
    lower.gates["exists"].set()
    pump(store)
    assert store.host.num_used == 0  # the stale answer promoted nothing
    assert not lower.entered["get"].is_set()


def test_wait_io_returns_when_the_io_finishes_or_the_timeout_passes(
    stores: list[TieredStore],
) -> None:
    lower = DictBackend()
    lower.data[k(5)] = payload(5)
    store = new_store(stores, lower)
    assert store.wait_io(1.0) is False  # nothing in flight: no wait
    lower.gates["exists"].clear()
    assert store.lookup(k(5)) is LookupResult.RETRY
    store.step()  # the query is submitted
    start = time.perf_counter()
    assert store.wait_io(0.05) is True
    assert 0.04 < time.perf_counter() - start < 1.0  # held at the gate: the timeout
    threading.Timer(0.05, lower.gates["exists"].set).start()
    start = time.perf_counter()
    store.wait_io(5.0)
    assert time.perf_counter() - start < 2.0  # back once the query finished
    pump(store)
    assert store.lookup(k(5)) is LookupResult.HIT


# -- the tier chain on its own (SGLang's synchronous path) ---------------------------------


def new_chain(*tiers: Backend, track_keys: int = 0, copy_up: bool = False) -> TierChain:
    return TierChain(
        tiers,
        metrics=Metrics(),
        events=EventTracker(),
        item_bytes=SLOT,
        track_keys=track_keys,
        copy_up=copy_up,
    )


def test_chain_locates_each_key_in_the_first_tier_holding_it() -> None:
    upper, lower = DictBackend(), DictBackend()
    upper.data[k(1)] = lower.data[k(1)] = payload(1)
    lower.data[k(2)] = payload(2)
    chain = new_chain(FailingBackend(), upper, lower)
    assert chain.locate([k(1), k(2), k(3)]) == [2, 3, -1]
    assert chain.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1


def test_chain_read_through_reads_from_the_first_tier_serving_each_key() -> None:
    upper, lower = GetFailsBackend(), DictBackend()
    upper.data[k(1)] = payload(1)
    lower.data[k(1)] = payload(1)
    lower.data[k(2)] = payload(2)
    chain = new_chain(upper, lower)
    outs = [memoryview(bytearray(SLOT)) for _ in range(3)]

    def read(tier: Backend, t: int, todo: list[int]) -> list[bool]:
        return chain.read_into(t, [[k(1), k(2), k(3)][i] for i in todo], [outs[i] for i in todo])

    assert chain.read_through([k(1), k(2), k(3)], read) == [2, 2, -1]
    assert [bytes(o) for o in outs[:2]] == [payload(1), payload(2)]
    assert chain.metrics.counter("kvsdk_loaded_bytes_total", tier=2) == 2 * SLOT
    assert chain.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1


def test_chain_books_a_key_stored_twice_once_and_a_vanished_key_as_removed() -> None:
    tier = DictBackend()
    chain = new_chain(tier, track_keys=16)
    view = memoryview(payload(1))
    assert chain.write_through([k(1)], [view]) == [True]
    assert chain.write_through([k(1)], [view]) == [True]
    tier.data.clear()  # evicted behind kvsdk's back
    chain.note_misses([k(1)], chain.locate([k(1)]))
    kinds = [e.kind for e in chain.events.take_events()]
    assert kinds == [EventKind.STORED, EventKind.REMOVED]
    assert chain.metrics.counter("kvsdk_stored_bytes_total", tier=1) == SLOT


def test_chain_copies_what_a_lower_tier_served_up_in_the_background() -> None:
    upper, lower = DictBackend(), DictBackend()
    chain = new_chain(upper, lower, copy_up=True)
    chain.copy_up(2, [k(4)], lambda: [memoryview(payload(4))])
    chain.close()  # waits for the copy
    assert upper.data == {k(4): payload(4)} and lower.data == {}


def test_backend_defaults_copy_and_read_older_stats_keys() -> None:
    tier = DictBackend()
    tier.data[k(1)] = payload(1)
    out = bytearray(SLOT)
    assert tier.get_into([k(1), k(2)], [memoryview(out), memoryview(bytearray(SLOT))]) == [
        True,
        False,
    ]
    assert bytes(out) == payload(1)
    assert not DictBackend.supports_get_into and not DictBackend.supports_scatter_gather
    assert tier.capacity_bytes() is None and tier.corrupt_count() == 0
    tier.stats = lambda: {"capacity_bytes": 4096.0, "corrupt": 3.0}  # type: ignore[method-assign]
    assert tier.capacity_bytes() == 4096 and tier.corrupt_count() == 3


# -- one owner starts and stops a store -----------------------------------------------------


class LifecycleRecorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def kvsdk_startup(self, config: object) -> None:
        self.calls.append("startup")

    @hookimpl
    def kvsdk_shutdown(self) -> None:
        self.calls.append("shutdown")


def test_store_handle_fires_startup_once_and_shutdown_once() -> None:
    recorder = LifecycleRecorder()
    pm = plugins_manager.plugin_manager()
    pm.register(recorder, name="kvsdk-test-lifecycle")
    try:
        config = load_config(
            {"chunk_tokens": 16, "tiers": [{"backend": "cpu", "capacity": "1MiB"}]}
        )
        handle = StoreHandle(config)
        ns = Namespace(model="m", dtype="bf16", groups=(), tokens_per_chunk=16)
        store = handle.build_store(ns, SLOT)
        assert recorder.calls == ["startup"]
        store.step()
        handle.close()
        handle.close()
        assert recorder.calls == ["startup", "shutdown"]
        bare = build_store(config, ns, SLOT)  # no owner: no lifecycle hooks
        bare.shutdown()
        assert recorder.calls == ["startup", "shutdown"]
    finally:
        pm.unregister(recorder)
