"""The redis tier keeps its hits on a busy server at its default settings.

A real ``redis-server`` is loaded by other clients (processes, each several
threads, writing and reading 4 MiB values continuously, two per round trip,
as other engines' tiers do; and now and then a slow command of another
client that holds the server for 1.2 s) while the tier, with nothing but
``url`` set, puts, checks and gets batches of 4 MiB chunks from several
threads at once (as the tiered store's I/O pool does). Every get must return
the bytes of the last put of its key, and the tier must absorb no error and
never open its breaker.

Before payload-scaled timeouts (a fixed one-second socket timeout per read,
and a timeout closing every connection of the server, in use or not), the
same load cost the tier timeouts, broken connections and misses.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import redis
from redis_server import (  # noqa: F401  (fixtures)
    RedisServer,
    needs_redis,
    redis_server_fixture,
    redis_tools_fixture,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = [pytest.mark.integration, needs_redis]

NS = hashlib.blake2b(b"load", digest_size=16).digest()
MIB = 1 << 20
CHUNK = 4 * MIB
LOAD_PROCESSES = 2
LOAD_THREADS = 3
"""Other clients: processes x threads, each moving two 4 MiB values per round trip."""
TIER_THREADS = 4
"""The tier's callers (the tiered store's I/O pool has 4 by default)."""
BATCH = 4
"""Chunks per put and per get (16 MiB: two round trips of at most 8 MiB)."""
SECONDS = 8.0


def _load(url: str, stop: Any, n: int) -> None:
    """``n`` threads writing and reading 4 MiB values until ``stop`` is set."""
    value = np.random.default_rng(n).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()

    def run(t: int) -> None:
        client = redis.Redis.from_url(url, socket_timeout=None)
        keys = [f"load:{n}:{t}:{j}" for j in range(4)]
        i = 0
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            for k in keys[i % 2 * 2 : i % 2 * 2 + 2]:
                pipe.set(k, value)
            pipe.execute()
            pipe = client.pipeline(transaction=False)
            for k in keys[(i + 1) % 2 * 2 : (i + 1) % 2 * 2 + 2]:
                pipe.get(k)
            pipe.execute()
            i += 1
        client.close()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(LOAD_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


STALL_S = 1.2
STALL_EVERY_S = 2.5
"""Every so often the server is busy with one slow command of another client for
:data:`STALL_S` (a script here; in production a large DEL or KEYS, a fork for
a snapshot, a CPU shared with busy engines): it answers nobody meanwhile."""
BUSY_SCRIPT = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
while true do
  local n = redis.call('TIME')
  if n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) then return 1 end
end
"""


def _stall(url: str, stop: Any) -> None:
    client = redis.Redis.from_url(url, socket_timeout=None)
    while not stop.wait(STALL_EVERY_S):
        client.eval(BUSY_SCRIPT, 0, int(STALL_S * 1e6))
    client.close()


def run_tier_under_load(url: str, seconds: float = SECONDS, **options: Any) -> dict[str, Any]:
    """The tier (``options`` beside ``url``) putting and getting batches of 4 MiB
    chunks from :data:`TIER_THREADS` threads for ``seconds`` while other
    processes load the server: what it saw."""
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    tier = RedisBackend(RedisOptions(url=url, **options), ctx)
    values = [np.random.default_rng(100 + i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
              for i in range(5)]  # fmt: skip
    ctx_fork = mp.get_context("fork")
    stop = ctx_fork.Event()
    loaders = [ctx_fork.Process(target=_load, args=(url, stop, n)) for n in range(LOAD_PROCESSES)]
    loaders.append(ctx_fork.Process(target=_stall, args=(url, stop)))
    out: dict[str, Any] = {"rounds": 0, "misses": 0, "wrong": 0, "not_stored": 0,
                           "breaker_seen_open": 0, "get_s": [], "put_s": []}  # fmt: skip
    lock = threading.Lock()

    def caller(t: int) -> None:
        keys = [hashlib.blake2b(f"{t}:{j}".encode(), digest_size=16).digest()
                for j in range(BATCH)]  # fmt: skip
        end = time.monotonic() + seconds
        r = 0
        while time.monotonic() < end:
            chosen = [values[(t + r + j) % len(values)] for j in range(BATCH)]
            t0 = time.monotonic()
            stored = tier.put(list(zip(keys, chosen)))
            t1 = time.monotonic()
            found = tier.exists(keys)
            got = tier.get(keys)
            t2 = time.monotonic()
            with lock:
                out["rounds"] += 1
                out["put_s"].append(t1 - t0)
                out["get_s"].append(t2 - t1)
                out["breaker_seen_open"] += not tier.available()
                for ok, there, value, want in zip(stored, found, got, chosen, strict=True):
                    if not ok:
                        out["not_stored"] += 1
                    elif value is None or not there:
                        out["misses"] += 1
                    elif bytes(value) != want:
                        out["wrong"] += 1
            r += 1

    try:
        for p in loaders:
            p.start()
        time.sleep(1.0)  # the load is on
        callers = [threading.Thread(target=caller, args=(t,)) for t in range(TIER_THREADS)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
    finally:
        stop.set()
        for p in loaders:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        out["errors"] = tier.error_count()
        out["stats"] = tier.stats()
        tier.close()
    return out


def summary(out: dict[str, Any]) -> str:
    s = out["stats"]
    get_ms = 1e3 * float(np.mean(out["get_s"])) if out["get_s"] else 0.0
    put_ms = 1e3 * float(np.mean(out["put_s"])) if out["put_s"] else 0.0
    return (
        f"{out['rounds']} rounds of {BATCH} x 4 MiB from {TIER_THREADS} threads: "
        f"errors {out['errors']}, timeouts {s.get('timeouts', 0):.0f}, outages {s.get('outages', 0):.0f}, "
        f"write_timeouts {s.get('write_timeouts', 0):.0f}, retries {s.get('retries', 0):.0f}, "
        f"not stored {out['not_stored']}, misses {out['misses']}, wrong {out['wrong']}, "
        f"breaker seen open {out['breaker_seen_open']}; mean get {get_ms:.0f} ms, "
        f"put {put_ms:.0f} ms (max get {1e3 * max(out['get_s'], default=0):.0f} ms)"
    )


def test_a_busy_server_costs_the_tier_no_error_and_no_hit_at_default_settings(
    redis_server: RedisServer,
) -> None:
    out = run_tier_under_load(redis_server.url)
    print(summary(out))
    assert out["rounds"] >= TIER_THREADS, summary(out)
    assert out["wrong"] == 0, summary(out)  # never wrong bytes
    assert out["errors"] == 0 and out["breaker_seen_open"] == 0, summary(out)
    assert out["stats"]["outages"] == 0 and out["stats"]["timeouts"] == 0, summary(out)
    assert out["not_stored"] == 0 and out["misses"] == 0, summary(out)


# -- the pieces: a retry on a broken connection, a write timeout that stalls writes only ------


class _CuttingProxy:
    """A TCP proxy to a real server that cuts the connections named in ``cut``
    (0: the first one accepted, ...) after forwarding ``after`` bytes of a
    reply: a server closing a client mid-round trip."""

    def __init__(self, port: int, cut: set[int], after: int = 1) -> None:
        self._upstream = port
        self._cut, self._after = cut, after
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._sock.getsockname()[1]}/0"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._sock.accept()
            except OSError:
                return
            n, self.accepted = self.accepted, self.accepted + 1
            up = socket.create_connection(("127.0.0.1", self._upstream))
            cut = self._after if n in self._cut else None
            threading.Thread(target=self._pipe, args=(down, up, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, cut), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, cut: int | None) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if cut is not None and sent + len(data) > cut and sent > 0:
                    break  # mid-reply (the handshake's first reply went through)
                dst.sendall(data)
                sent += len(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._sock.close()


def test_a_connection_closed_mid_round_trip_is_sent_again_on_a_fresh_one(
    redis_server: RedisServer,
) -> None:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    direct = RedisBackend(RedisOptions(url=redis_server.url, local_index=False), ctx)
    value = np.random.default_rng(7).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    assert direct.put([(b"k" * 16, value)]) == [True]
    proxy = _CuttingProxy(redis_server.port, cut={0}, after=64 << 10)
    tier = RedisBackend(RedisOptions(url=proxy.url, local_index=False), ctx)
    try:
        got = tier.get([b"k" * 16])  # the first connection is cut 64 KiB into the reply
        assert got[0] is not None and bytes(got[0]) == value
        s = tier.stats()
        assert s["retries"] == 1 and tier.error_count() == 0 and tier.available(), s
        assert proxy.accepted == 2
    finally:
        tier.close()
        direct.close()
        proxy.close()


def test_a_write_timeout_stalls_writes_while_reads_go_on(redis_server: RedisServer) -> None:
    options = {"socket_timeout": 0.3, "connect_timeout": 0.3, "backoff_initial": 2.0,
               "backoff_max": 2.0, "local_index": False}  # fmt: skip
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=1 << 20)
    tier = RedisBackend(RedisOptions(url=redis_server.url, **options), ctx)
    small = [(bytes([i]) * 16, bytes([i]) * 1024) for i in range(4)]
    assert tier.put(small[:2]) == [True, True]
    stall = threading.Thread(
        target=lambda: redis.Redis.from_url(redis_server.url).eval(BUSY_SCRIPT, 0, 1_500_000)
    )
    stall.start()
    time.sleep(0.2)  # the server is busy for 1.5 s: longer than a small write's deadline
    assert tier.put(small[2:3]) == [False]
    s = tier.stats()
    assert s["write_timeouts"] == 1 and s["outages"] == 0 and s["breakers_open"] == 0, s
    stall.join()
    assert tier.put(small[3:]) == [False]  # writes stall for their backoff...
    assert tier.stats()["writes_paused"] == 1
    got = tier.get([k for k, _ in small[:2]])  # ...reads go on
    assert [bytes(v) for v in got if v is not None] == [v for _, v in small[:2]]
    time.sleep(2.1)
    assert tier.put(small[3:]) == [True]  # and writes resume
    tier.close()
