"""A Redis that refuses writes (full under ``noeviction``, a read-only replica)
is back-pressure, not an outage: the tier stops sending it writes for a
backoff (counted: refusals, writes not sent, bytes refused) while reads go on
serving what it holds, and writes resume once it takes them again."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer, key, payload, redis_tools_fixture  # noqa: F401  (fixtures)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"backpressure", digest_size=16).digest()
SIZE = 64 << 10


def backend(url: str, **extra: Any) -> RedisBackend:
    options = RedisOptions(url=url, socket_timeout=0.5, connect_timeout=0.5,
                           backoff_initial=0.5, backoff_max=2.0, **extra)  # fmt: skip
    return RedisBackend(options, TierContext(NS, NS.hex(), chunk_bytes=1 << 20))


def set_calls(server: RedisServer) -> int:
    """SET commands the server has been sent (refused ones included)."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_set:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_a_full_server_pauses_writes_reads_go_on_and_writes_resume(
    redis_tools: None, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path, args=["--maxmemory", "4mb",
                                         "--maxmemory-policy", "noeviction"]).start()  # fmt: skip
    try:
        b = backend(server.url)
        stored = []
        for i in range(200):  # fill it: ~4 MiB of 64 KiB frames, then OOM refusals
            if not b.put([(key(i), payload(i, SIZE))])[0]:
                break
            stored.append(i)
        assert 0 < len(stored) < 200
        s = b.stats()
        assert s["write_refusals"] == 1 and s["refused_bytes"] > SIZE
        before = set_calls(server)
        batch = [(key(i), payload(i, SIZE)) for i in range(1000, 1016)]
        assert b.put(batch) == [False] * 16  # paused: nothing sent to a full server
        assert set_calls(server) == before
        s = b.stats()
        assert s["writes_paused"] == 16 and s["writes_paused_servers"] == 1
        assert s["refused_bytes"] > 16 * SIZE and s["outages"] == 0
        got = b.get([key(i) for i in stored])  # reads go on
        assert all(v is not None and bytes(v) == payload(i, SIZE) for i, v in zip(stored, got))
        assert b.available()  # a refusal is no outage: the tier's misses still mean misses

        server.cli("CONFIG", "SET", "maxmemory", "0")  # room again
        deadline = time.monotonic() + 10
        while not all(b.put(batch)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(b.put(batch)) and b.stats()["writes_paused_servers"] == 0
        b.close()
    finally:
        server.kill()


def test_a_read_only_replica_refuses_writes_and_serves_reads(
    redis_tools: None, tmp_path: Path
) -> None:
    master = RedisServer(tmp_path / "m").start()
    replica = RedisServer(tmp_path / "r", args=["--replicaof", "127.0.0.1", str(master.port)])
    replica.start()
    try:
        deadline = time.monotonic() + 20
        while "master_link_status:up" not in replica.cli("INFO", "replication"):
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)
        writer = backend(master.url)
        assert all(writer.put([(key(i), payload(i, SIZE)) for i in range(8)]))
        assert int(master.cli("WAIT", "1", "5000")) == 1
        b = backend(replica.url)  # e.g. a url pointing at a node that became a replica
        assert b.put([(key(100), payload(100, SIZE))]) == [False]
        assert b.put([(key(101), payload(101, SIZE))]) == [False]
        s = b.stats()
        assert s["write_refusals"] == 1 and s["writes_paused"] == 1 and s["outages"] == 0
        got = b.get([key(i) for i in range(8)])
        assert all(v is not None and bytes(v) == payload(i, SIZE) for i, v in enumerate(got))
        writer.close()
        b.close()
    finally:
        master.kill()
        replica.kill()
