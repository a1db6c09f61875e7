"""Every failure docs/troubleshooting.md sends users to a counter for moves that
counter, in the Metrics object and on the Prometheus exporter: a Redis server
that is down and a disk path that cannot be created (``kvsdk_backend_errors_total``,
though both tiers absorb the failure as misses instead of raising), a tier
that raises, and a corrupt entry (``kvsdk_corrupt_chunks_total``)."""

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


def store_with(tier: dict[str, Any]) -> TieredStore:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 16 * SLOT}, tier]})
    return build_store(cfg, NS, SLOT)


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


def scraped(store: TieredStore, name: str) -> float:
    """The counter ``name{tier="1"}`` as Prometheus scrapes it."""
    port = free_port()
    server = start_prometheus_exporter(store.metrics, port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        if isinstance(server, tuple):  # prometheus-client >= 0.17: (server, thread)
            server[0].shutdown()
    m = re.search(rf'^{name}\{{tier="1"\}} (\S+)$', text, re.MULTILINE)
    assert m is not None, f"{name}{{tier=1}} not exported"
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
