"""A slower tier that goes down and comes back is one WARNING line each way,
through a real tiered store: a real ``redis-server`` killed and restarted on
its port, and a real disk tier whose directory is replaced by a file (every
write refused, reads of what it indexed still answered) and then restored.

The down line names the tier and the failing operation; the up line counts
the failures in between (the same number ``kvsdk_backend_errors_total``
counted) and how long it was down. Lookups during the outage, while the Redis
circuit breaker skips the server, do not bring the tier back; on the disk
tier, reads that work do not either, only a write that lands."""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis_server import RedisServer, redis_server_fixture  # noqa: F401  (fixture)

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult

pytestmark = pytest.mark.integration

SLOT = 64
NS = Namespace("m", "uint8", (GroupLayout((1,), "uint8"),), 16)
LOGGER = "kvsdk.store.chain"


def store_with(tier: dict[str, Any]) -> TieredStore:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 64 * SLOT}, tier]})
    return build_store(cfg, NS, SLOT)


def pump(store: TieredStore) -> None:
    deadline = time.monotonic() + 20
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.002)
    store.step()


def look_up(store: TieredStore, key: bytes) -> None:
    """A lookup of a chunk the host tier lacks: the slower tier is asked."""
    assert store.lookup(key) is LookupResult.RETRY
    pump(store)
    store.lookup(key)


def save(store: TieredStore, key: bytes) -> None:
    """Store a chunk in host RAM; it is written through to the slower tier."""
    plan = store.prepare_store([key])
    assert plan is not None and plan.slots
    store.host.slab.numpy()[plan.slots[0]] = np.frombuffer(key * (SLOT // 16), dtype=np.uint8)
    store.complete_store(list(plan.keys))
    pump(store)


def key(i: int) -> bytes:
    return f"{i:016d}".encode()


def lines(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and word in r.getMessage()
    ]


def test_redis_killed_and_restarted_logs_one_down_and_one_up_line(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_with(
        {
            "backend": "redis",
            "url": redis_server.url,
            "connect_timeout": 0.2,
            "socket_timeout": 0.2,
            "backoff_initial": 0.05,
            "backoff_max": 0.2,
            # every lookup below must reach the server (the index would answer
            # these never-stored keys itself; it is tested at its default in
            # test_redis_index.py and test_vllm_lookup_wait.py)
            "local_index": False,
        }
    )

    def errors() -> float:
        return store.metrics.counter("kvsdk_backend_errors_total", tier=1)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        save(store, key(0))
        look_up(store, key(1))
        assert lines(caplog, "kvsdk: tier") == []  # up all along: nothing said

        redis_server.kill()
        start = time.monotonic()
        i = 2
        while errors() < 3 or time.monotonic() - start < 1.0:  # retried after each backoff
            look_up(store, key(i))
            i += 1
            time.sleep(0.02)
        assert time.monotonic() - start < 20
        down = lines(caplog, "down")
        assert down == [down[0]] and re.fullmatch(r"kvsdk: tier 1 \(redis\) down: \w+: .+", down[0])
        assert lines(caplog, "back up") == []  # skipped calls (breaker open) prove nothing
        outage_errors = errors()

        redis_server.start()  # same port
        deadline = time.monotonic() + 20
        while not lines(caplog, "back up") and time.monotonic() < deadline:
            look_up(store, key(i))
            i += 1
            time.sleep(0.02)
        for j in range(i, i + 5):  # and it stays up: no more lines
            look_up(store, key(j))
            save(store, key(j + 100))
    up = lines(caplog, "back up")
    assert len(lines(caplog, "down")) == 1 and len(up) == 1, caplog.text
    m = re.fullmatch(
        r"kvsdk: tier 1 \(redis\) back up after (\d+) failures: failing for ([\d.]+) s, "
        r"answering ([\d.]+) s after the first failure",
        up[0],
    )
    assert m is not None, up
    assert int(m.group(1)) == outage_errors == errors()  # every failure it counted, no other
    failing, answering = float(m.group(2)), float(m.group(3))
    # failing: while the server was dead (killed, probed for at least 1 s), not the
    # restart and the breaker's backoff after it, which only "answering" includes
    assert 0.9 <= failing <= time.monotonic() - start and failing <= answering < 40
    assert redis_server.cli("DBSIZE") != "0"  # writes land again
    store.shutdown()


def test_disk_that_refuses_writes_is_down_until_a_write_lands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    store = store_with({"backend": "disk", "path": str(root)})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        save(store, key(0))
        assert any(p.is_file() for p in root.rglob("*"))

        moved = tmp_path / "moved"
        root.rename(moved)
        root.write_text("not a directory")  # every write below it is refused by the OS
        for i in range(1, 4):
            save(store, key(i))
            look_up(store, key(100 + i))  # reads answer (misses): the tier is not back
        assert store.metrics.counter("kvsdk_backend_errors_total", tier=1) >= 3
        down = lines(caplog, "down")
        assert len(down) == 1 and down[0].startswith("kvsdk: tier 1 (disk) down: put: "), down
        assert lines(caplog, "back up") == []

        root.unlink()
        shutil.move(moved, root)
        time.sleep(1.05)  # 3 refused writes paused its stores (store_backoff.initial_s: 1 s)
        save(store, key(10))
        save(store, key(11))
    up = lines(caplog, "back up")
    assert len(up) == 1 and up[0].startswith("kvsdk: tier 1 (disk) back up after 3 failures: ")
    assert len(lines(caplog, "down")) == 1
    store.shutdown()
