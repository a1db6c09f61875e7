"""Metrics (counters, histograms, snapshot, Prometheus), the event tracker,
event sinks as pluggy plugins, and the plugin listing."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvsdk import plugins_manager
from kvsdk.backend import TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.events import EventKind, EventOrigin, EventTracker, KVEvent
from kvsdk.hooks import hookimpl
from kvsdk.metrics import SECONDS_BUCKETS, Metrics, start_prometheus_exporter
from kvsdk.store.factory import plugin_event_sink
from kvsdk.store.tiered import TieredStore
from kvsdk.types import Locality, Medium


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def record(tracker: EventTracker, kind: EventKind, keys: Sequence[bytes], tier: int = 0) -> None:
    tracker.record(kind, keys, tier=tier, medium=Medium.CPU, locality=Locality.PROCESS)


# -- counters, histograms, snapshot -----------------------------------------------------------


def test_counters_add_per_label_set_and_sum_without_labels() -> None:
    m = Metrics()
    m.inc("kvsdk_lookup_hits_total", tier=0)
    m.inc("kvsdk_lookup_hits_total", 2, tier=0)
    m.inc("kvsdk_lookup_hits_total", tier=1)
    assert m.counter("kvsdk_lookup_hits_total", tier=0) == 3
    assert m.counter("kvsdk_lookup_hits_total", tier=1) == 1
    assert m.counter("kvsdk_lookup_hits_total") == 4
    assert m.counter("kvsdk_lookup_misses_total") == 0


def test_histogram_buckets_are_upper_inclusive_with_an_overflow_bucket() -> None:
    m = Metrics()
    for value in (SECONDS_BUCKETS[0], SECONDS_BUCKETS[0] * 1.5, 1e9):
        m.observe("kvsdk_transfer_seconds", value, direction="load")
    h = m.snapshot()["histograms"]["kvsdk_transfer_seconds{direction=load}"]
    assert h["count"] == 3
    assert h["sum"] == pytest.approx(SECONDS_BUCKETS[0] * 2.5 + 1e9)
    assert h["buckets"] == list(SECONDS_BUCKETS)
    assert len(h["counts"]) == len(SECONDS_BUCKETS) + 1
    assert (h["counts"][0], h["counts"][1], h["counts"][-1]) == (1, 1, 1)


def test_snapshot_is_plain_data_keyed_by_name_and_labels() -> None:
    m = Metrics()
    m.inc("kvsdk_stored_bytes_total", 4096, tier=1)
    m.inc("kvsdk_lookup_misses_total")
    m.observe("kvsdk_backend_seconds", 0.002, tier=1, op="get")
    snap = m.snapshot()
    assert snap["counters"] == {
        "kvsdk_lookup_misses_total": 1.0,
        "kvsdk_stored_bytes_total{tier=1}": 4096.0,
    }
    assert list(snap["histograms"]) == ["kvsdk_backend_seconds{op=get,tier=1}"]
    snap["counters"]["kvsdk_lookup_misses_total"] = 99  # a copy, not a view
    assert m.counter("kvsdk_lookup_misses_total") == 1


def test_counters_are_exact_under_concurrent_increments() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(5_000):
            m.inc("kvsdk_evictions_total", tier=0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.counter("kvsdk_evictions_total", tier=0) == 20_000


# -- Prometheus exporter ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def exporter() -> Iterator[tuple[Metrics, str]]:
    m = Metrics()
    port = _free_port()
    server, thread = start_prometheus_exporter(m, port)
    try:
        yield m, f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _scrape(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode().splitlines()


def test_prometheus_exporter_serves_counters_and_histograms(
    exporter: tuple[Metrics, str],
) -> None:
    m, url = exporter
    m.inc("kvsdk_lookup_hits_total", 3, tier=0)
    m.inc("kvsdk_lookup_misses_total", 2)
    m.observe("kvsdk_backend_seconds", 0.002, tier=1, op="get")
    lines = _scrape(url)
    assert 'kvsdk_lookup_hits_total{tier="0"} 3.0' in lines
    assert "kvsdk_lookup_misses_total 2.0" in lines
    # (older prometheus-client versions name the family without "_total")
    assert any(
        line.startswith("# TYPE kvsdk_lookup_hits") and line.endswith(" counter") for line in lines
    )
    assert "# TYPE kvsdk_backend_seconds histogram" in lines
    assert 'kvsdk_backend_seconds_count{op="get",tier="1"} 1.0' in lines
    assert 'kvsdk_backend_seconds_bucket{le="+Inf",op="get",tier="1"} 1.0' in lines


def test_prometheus_exporter_reads_live_values(exporter: tuple[Metrics, str]) -> None:
    m, url = exporter
    m.inc("kvsdk_evictions_total", tier=0)
    assert 'kvsdk_evictions_total{tier="0"} 1.0' in _scrape(url)
    m.inc("kvsdk_evictions_total", 4, tier=0)
    assert 'kvsdk_evictions_total{tier="0"} 5.0' in _scrape(url)


# -- event tracker ----------------------------------------------------------------------------


def test_take_events_drains_in_order() -> None:
    t = EventTracker()
    record(t, EventKind.STORED, [k(1), k(2)])
    record(t, EventKind.REMOVED, [k(1)], tier=1)
    got = t.take_events()
    assert [(e.kind, e.keys, e.tier) for e in got] == [
        (EventKind.STORED, (k(1), k(2)), 0),
        (EventKind.REMOVED, (k(1),), 1),
    ]
    assert (got[0].medium, got[0].locality) == (Medium.CPU, Locality.PROCESS)
    assert t.take_events() == []


def test_bounded_queue_drops_the_oldest_and_counts_them() -> None:
    t = EventTracker(max_pending=3)
    for i in range(5):
        record(t, EventKind.STORED, [k(i)])
        t.publish()  # as the store does every step: only the adapter's queue backs up
    assert [e.keys for e in t.take_events()] == [(k(2),), (k(3),), (k(4),)]
    assert t.dropped == 2


def test_empty_events_are_skipped_except_cleared() -> None:
    t = EventTracker()
    record(t, EventKind.STORED, [])
    record(t, EventKind.REMOVED, [])
    record(t, EventKind.CLEARED, [])
    assert [e.kind for e in t.take_events()] == [EventKind.CLEARED]


def test_disabled_tracker_records_nothing() -> None:
    t = EventTracker(enabled=False)
    t.annotate(k(1), "block-1")
    record(t, EventKind.STORED, [k(1)])
    assert t.take_events() == []


def test_annotations_travel_with_their_keys() -> None:
    t = EventTracker()
    t.annotate(k(1), {"block_hash": "aa"})
    record(t, EventKind.STORED, [k(1), k(2)])
    (event,) = t.take_events()
    assert event.info == ({"block_hash": "aa"}, None)


def test_token_ids_are_kept_until_the_deepest_tier_stored_the_chunk() -> None:
    t = EventTracker()
    t.last_tier = 1
    origin = EventOrigin(0, 0, b"h1", (b"h0", b"h1"), None, [7, 8, 9, 10])
    t.annotate(k(1), origin)
    record(t, EventKind.STORED, [k(1)], tier=0)
    record(t, EventKind.STORED, [k(1)], tier=1)
    host, deepest = t.take_events()
    assert host.info == deepest.info == (origin,)  # each store event carries the tokens
    record(t, EventKind.REMOVED, [k(1)], tier=0)
    (removed,) = t.take_events()
    assert removed.info == (origin._replace(token_ids=None),)  # the hashes stay


def test_a_key_annotated_again_keeps_its_new_token_ids() -> None:
    t = EventTracker()
    first = EventOrigin(0, 0, b"h", (b"h",), None, [1])
    t.annotate(k(1), first)
    info = (first,)
    again = first._replace(token_ids=[2])
    t.annotate(k(1), again)  # another request derived the key meanwhile
    t._drop_tokens([k(1)], info)
    record(t, EventKind.REMOVED, [k(1)])
    assert t.take_events()[0].info == (again,)


def test_reset_drops_undrained_events() -> None:
    t = EventTracker()
    record(t, EventKind.STORED, [k(1)])
    t.reset()
    assert t.take_events() == []


# -- event sinks through pluggy ---------------------------------------------------------------


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    @hookimpl
    def kvsdk_publish_events(self, events: Sequence[KVEvent]) -> None:
        self.batches.append(list(events))


class BrokenSink:
    @hookimpl
    def kvsdk_publish_events(self, events: Sequence[KVEvent]) -> None:
        raise RuntimeError("sink down")


@pytest.fixture
def register() -> Iterator[Any]:
    """Register plugin objects for one test; always unregistered afterwards."""
    pm = plugins_manager.plugin_manager()
    added: list[object] = []

    def add(plugin: object, name: str) -> object:
        pm.register(plugin, name=name)
        added.append(plugin)
        return plugin

    yield add
    for plugin in added:
        pm.unregister(plugin)


def test_registered_sink_receives_each_batch_once(register: Any) -> None:
    sink = register(RecordingSink(), "kvsdk-test-sink")
    t = EventTracker(sink=plugin_event_sink())
    record(t, EventKind.STORED, [k(1)])
    record(t, EventKind.REMOVED, [k(1)])
    t.publish()
    t.publish()  # nothing new: no call
    record(t, EventKind.CLEARED, [])
    t.publish()
    assert [[e.kind for e in batch] for batch in sink.batches] == [
        [EventKind.STORED, EventKind.REMOVED],
        [EventKind.CLEARED],
    ]
    assert len(t.take_events()) == 3  # the adapter's queue is independent of the sinks'


def test_a_failing_sink_does_not_break_publishing(register: Any) -> None:
    register(BrokenSink(), "kvsdk-test-broken-sink")
    t = EventTracker(sink=plugin_event_sink())
    record(t, EventKind.STORED, [k(1)])
    t.publish()  # logged, not raised
    assert len(t.take_events()) == 1


def test_store_step_publishes_to_registered_sinks(register: Any) -> None:
    sink = register(RecordingSink(), "kvsdk-test-sink")
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=16)
    store = TieredStore(
        CPUBackend(CPUOptions(capacity=64, pin_memory="never"), ctx),
        events=EventTracker(sink=plugin_event_sink()),
    )
    plan = store.prepare_store([k(1)])
    assert plan is not None
    store.complete_store(plan.keys)
    assert sink.batches == []  # published on the step, not inline
    store.step()
    ((event,),) = sink.batches
    assert (event.kind, event.keys, event.medium) == (EventKind.STORED, (k(1),), Medium.CPU)


def test_unregistered_sink_receives_nothing() -> None:
    pm = plugins_manager.plugin_manager()
    sink = RecordingSink()
    pm.register(sink, name="kvsdk-test-sink")
    pm.unregister(sink)
    t = EventTracker(sink=plugin_event_sink())
    record(t, EventKind.STORED, [k(1)])
    t.publish()
    assert sink.batches == []


# -- the plugin listing -----------------------------------------------------------------------


def test_list_plugins_shows_built_ins_with_their_hooks() -> None:
    plugins = {p.name: p for p in plugins_manager.list_plugins()}
    assert plugins["kvsdk.backends.cpu"].hooks == ("kvsdk_backends",)
    assert plugins["kvsdk.eviction"].hooks == ("kvsdk_eviction_policies",)
    assert plugins["kvsdk.transfer.cpu"].hooks == ("kvsdk_transfer_workers",)
    for name in plugins_manager.DEFAULT_PLUGINS:
        assert plugins[name].source == "builtin"


def test_list_plugins_includes_a_registered_plugin(register: Any) -> None:
    register(RecordingSink(), "kvsdk-test-sink")
    plugins = {p.name: p for p in plugins_manager.list_plugins()}
    assert plugins["kvsdk-test-sink"].hooks == ("kvsdk_publish_events",)


def test_built_in_registries_resolve_through_the_hooks() -> None:
    assert "cpu" in plugins_manager.backends()
    assert {"lru", "arc"} <= set(plugins_manager.eviction_policies())
    assert "cpu" in plugins_manager.transfer_workers()


def test_a_tracker_without_a_sink_publishes_nowhere(register: Any) -> None:
    sink = register(RecordingSink(), "kvsdk-test-sink")
    t = EventTracker()  # no sink injected: the plugins are not called behind its back
    record(t, EventKind.STORED, [k(1)])
    t.publish()
    assert sink.batches == [] and len(t.take_events()) == 1
