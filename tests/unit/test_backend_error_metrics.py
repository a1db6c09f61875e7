"""Every failure docs/troubleshooting.md sends users to a counter for moves that
counter, in the Metrics object and on the Prometheus exporter: a Redis server
that is down, a disk path that cannot be created and a write the OS refuses
(``kvsdk_backend_errors_total``, though the tiers absorb them as misses and
refused writes instead of raising), a tier that raises, a corrupt entry
(``kvsdk_corrupt_chunks_total``), a host tier too small for the working set
(``kvsdk_evictions_total``), every slot pinned (``kvsdk_allocation_failures_total``)
and write-throughs beyond the in-flight bound (``kvsdk_dropped_writes_total``).
The last test reads the guide and docs/monitoring.md: every ``kvsdk_*`` name
they give exists, and every failure counter the guide names is checked here."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.metrics import start_prometheus_exporter
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult

SLOT = 64
NS = Namespace("m", "uint8", (GroupLayout((1,), "uint8"),), 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store_with(tier: dict[str, Any] | None, host_slots: int = 16) -> TieredStore:
    tiers = [{"backend": "cpu", "capacity": host_slots * SLOT}, *([tier] if tier else [])]
    return build_store(load_config({"tiers": tiers}), NS, SLOT)


def save(store: TieredStore, key: bytes) -> None:
    plan = store.prepare_store([key])
    assert plan is not None and plan.slots
    store.host.slab.numpy()[plan.slots[0]] = 5
    store.complete_store(list(plan.keys))


def pump(store: TieredStore) -> None:
    deadline = time.monotonic() + 20
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.002)
    store.step()


def look_and_save(store: TieredStore) -> None:
    """What an engine does: look a chunk up in the slower tier, then store one."""
    assert store.lookup(b"a" * 16) is LookupResult.RETRY
    pump(store)
    assert store.lookup(b"a" * 16) is LookupResult.MISS  # a failure is a miss, never raised
    plan = store.prepare_store([b"b" * 16])
    assert plan is not None
    store.host.slab.numpy()[plan.slots[0]] = np.arange(SLOT, dtype=np.uint8)
    store.complete_store(list(plan.keys))
    pump(store)


def scraped(store: TieredStore, name: str, labels: str = '{tier="1"}') -> float:
    """The counter ``name`` with ``labels`` (their text) as Prometheus scrapes it."""
    port = free_port()
    server = start_prometheus_exporter(store.metrics, port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        if isinstance(server, tuple):  # prometheus-client >= 0.17: (server, thread)
            server[0].shutdown()
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name}{labels} not exported"
    return float(m.group(1))


def test_redis_down_moves_backend_errors() -> None:
    store = store_with(
        {
            "backend": "redis",
            "url": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
            "connect_timeout": 0.2,
            "socket_timeout": 0.2,
            "backoff_initial": 0.01,
        }
    )
    look_and_save(store)
    n = store.metrics.counter("kvsdk_backend_errors_total", tier=1)
    assert n >= 1
    assert scraped(store, "kvsdk_backend_errors_total") == n
    store.shutdown()


def test_a_disk_path_that_cannot_be_created_moves_backend_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = store_with({"backend": "disk", "path": str(tmp_path / "file" / "cache")})
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1  # at start
    look_and_save(store)
    n = store.metrics.counter("kvsdk_backend_errors_total", tier=1)
    assert n >= 2  # and the write-through it refused
    assert scraped(store, "kvsdk_backend_errors_total") == n
    store.shutdown()


def test_a_tier_that_raises_moves_backend_errors_once_per_failure(tmp_path: Path) -> None:
    store = store_with(
        {
            "backend": "faulty",
            "error_rate": 1.0,
            "wraps": {"backend": "disk", "path": str(tmp_path)},
        }
    )
    look_and_save(store)
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 2  # exists, put
    store.shutdown()


def test_a_corrupt_entry_moves_corrupt_chunks(tmp_path: Path) -> None:
    writer = store_with({"backend": "disk", "path": str(tmp_path)})
    plan = writer.prepare_store([b"c" * 16])
    assert plan is not None
    writer.host.slab.numpy()[plan.slots[0]] = 7
    writer.complete_store(list(plan.keys))
    pump(writer)
    writer.shutdown()
    (frame,) = tmp_path.rglob("*.kvc")
    data = bytearray(frame.read_bytes())
    data[-1] ^= 0xFF  # one payload bit rots
    frame.write_bytes(bytes(data))

    reader = store_with({"backend": "disk", "path": str(tmp_path)})
    reader.lookup(b"c" * 16)
    for _ in range(100):
        pump(reader)
        if reader.lookup(b"c" * 16) is LookupResult.MISS:
            break
    assert reader.metrics.counter("kvsdk_corrupt_chunks_total", tier=1) == 1
    assert reader.metrics.counter("kvsdk_backend_errors_total", tier=1) == 0  # not an I/O error
    assert scraped(reader, "kvsdk_corrupt_chunks_total") == 1
    reader.shutdown()


def test_a_write_the_os_refuses_moves_backend_errors(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store = store_with({"backend": "disk", "path": str(root)})
    save(store, b"a" * 16)
    pump(store)
    root.rename(tmp_path / "moved")
    root.write_text("not a directory")  # the OS refuses every write below it
    save(store, b"b" * 16)
    pump(store)
    assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) == 1
    assert scraped(store, "kvsdk_backend_errors_total") == 1
    store.shutdown()


def test_a_redis_outage_shows_skipped_operations_and_open_breakers_per_tier() -> None:
    """What an operator sees on kvsdk's exporter during an outage: the tier's own
    numbers as ``kvsdk_backend_stat`` gauges (every key operation skipped behind
    an open breaker, not only the breaker openings the error counter shows)."""
    store = store_with(
        {
            "backend": "redis",
            "url": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
            "connect_timeout": 0.2,
            "socket_timeout": 0.2,
            "backoff_initial": 5.0,  # the breaker stays open for the rest of the test
        }
    )
    look_and_save(store)
    for i in range(10):  # ten more lookups while the breaker is open: skipped, not sent
        assert store.lookup(bytes([i]) * 16) is LookupResult.RETRY
    pump(store)
    labels = '{backend="RedisBackend",stat="%s",tier="1"}'
    assert scraped(store, "kvsdk_backend_stat", labels % "breakers_open") == 1
    assert scraped(store, "kvsdk_backend_stat", labels % "outages") == 1
    assert scraped(store, "kvsdk_backend_stat", labels % "skipped") >= 10
    store.shutdown()
    assert list(store.metrics.iter_gauges()) == []  # a closed store is read no more


def test_a_host_tier_too_small_moves_evictions() -> None:
    store = store_with(None, host_slots=2)
    for i in range(5):
        save(store, bytes([65 + i]) * 16)
    assert store.metrics.counter("kvsdk_evictions_total", tier=0) == 3
    assert scraped(store, "kvsdk_evictions_total", '{tier="0"}') == 3
    store.shutdown()


def test_every_slot_pinned_moves_allocation_failures() -> None:
    store = store_with(None, host_slots=2)
    assert store.prepare_store([b"a" * 16, b"b" * 16]) is not None  # being written: pinned
    assert store.prepare_store([b"c" * 16]) is None  # no slot to evict
    assert store.metrics.counter("kvsdk_allocation_failures_total") == 1
    assert scraped(store, "kvsdk_allocation_failures_total", "") == 1
    store.shutdown()


def test_write_throughs_beyond_the_bound_move_dropped_writes(tmp_path: Path) -> None:
    slow = {
        "backend": "faulty",
        "latency_ms": 300,
        "wraps": {"backend": "disk", "path": str(tmp_path)},
    }
    store = store_with(slow)
    store.MAX_WRITES_IN_FLIGHT = 2  # the bound, lowered so that three slow writes reach it
    for i in range(3):
        save(store, bytes([65 + i]) * 16)
    assert store.metrics.counter("kvsdk_dropped_writes_total", tier=1) == 1
    assert scraped(store, "kvsdk_dropped_writes_total") == 1
    pump(store)
    store.shutdown()


DOCS = Path(__file__).resolve().parents[2] / "docs"
FAILURE_COUNTERS_CHECKED_HERE = {
    "kvsdk_backend_errors_total",
    "kvsdk_corrupt_chunks_total",
    "kvsdk_evictions_total",
    "kvsdk_allocation_failures_total",
    "kvsdk_dropped_writes_total",
}


def test_the_docs_name_only_metrics_that_exist_and_each_failure_counter_is_checked() -> None:
    from kvsdk.metrics import COUNTERS, GAUGES, HISTOGRAMS

    suffixes = ("", "_bucket", "_count", "_sum")
    known = set(COUNTERS) | set(GAUGES) | {h + s for h in HISTOGRAMS for s in suffixes}
    for doc in ("troubleshooting.md", "monitoring.md"):
        text = (DOCS / doc).read_text()
        named = set(re.findall(r"\bkvsdk_[a-z_]+[a-z]", text))
        # monitoring.md shortens a row of counters: `_failed_jobs_total`
        named |= {"kvsdk" + n for n in re.findall(r"`(_[a-z_]+_total)`", text)}
        assert named - known == set(), f"{doc} names metrics that do not exist"
    guide = set(re.findall(r"\bkvsdk_[a-z_]+_total", (DOCS / "troubleshooting.md").read_text()))
    failures = guide - {
        "kvsdk_stored_bytes_total",
        "kvsdk_loaded_bytes_total",
        "kvsdk_hit_tokens_total",
        "kvsdk_lookup_hits_total",
        "kvsdk_lookup_misses_total",
        "kvsdk_admission_skipped_total",
    }  # not failures
    assert failures <= FAILURE_COUNTERS_CHECKED_HERE, failures - FAILURE_COUNTERS_CHECKED_HERE
