"""The redis tier's local index: which of the namespace's chunks the server
(standalone, Sentinel or Cluster) holds, kept in this process's memory so that
``may_contain`` answers a chunk stored nowhere at once (the lookup misses
without waiting a step for an ``EXISTS``).

How it stays current:

- **This process.** Every put the server acknowledged adds its keys, and
  publishes them to the other processes: one ``PUBLISH`` per put call on the
  namespace's channel ``kvsdk:<namespace>:index`` (a channel, not a key:
  nothing is added to the keyspace; on a Cluster a ``PUBLISH`` reaches every
  node). A delete (an integrity failure) removes its keys and publishes the
  removal; a ``clear`` publishes that everything went.
- **Other processes.** A background thread, subscribed to the channel on a
  connection of the index's own, applies what the others published (its own
  messages it skips). Pub/Sub loses nothing while the subscriber is
  connected: a subscriber too slow for its output buffer is disconnected by
  the server, which this thread sees.
- **What the server dropped by itself** (``maxmemory`` eviction, a TTL): a
  ``get`` or ``exists`` that finds a key absent removes it.
- **Seeding.** At start, and whenever the reader may have missed something
  (its connection lost: an outage, a restarted server, a failover, a
  subscriber dropped by the server; or a ``FLUSHALL``/``FLUSHDB``, seen in
  the servers' command counts, which the reader checks every
  :meth:`RedisIndex.check_s` seconds, also a check that the server answers),
  it subscribes first and then scans ``kvsdk:<namespace>:*`` (every
  master of a Cluster) into a fresh index, applying what it hears meanwhile.
  Until that scan is complete, ``may_contain`` says True for every key (ask
  the server): an incomplete index never says False.

Bounded: at most ``local_index_max_entries`` keys; beyond it the least recently
stored or seen key is forgotten (counted ``index_dropped``), so its lookups
miss. That costs a hit, never correctness, and the forgotten keys are the ones
Redis's own LRU evicts first; answering True for everything once full would
give the whole index up instead.

A stale index only ever costs a miss (a key it does not know yet) or a round
trip (a key it still lists): reads verify every frame as before. The index's
failures are its own (``index_errors``, ``index_publish_errors``): they
neither count as the tier's errors nor open its breakers. An ACL user needs
the channel (``&kvsdk:*``) besides the keys; without it the index never
completes and every lookup asks, as without an index.

Thread-safety: one lock guards the index's memory and is never held across
I/O, so ``may_contain`` (the scheduler thread) waits for no server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis as redis_py
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from kvsdk.backends.redis_options import RedisOptions, connection_kwargs, effective_url, redact
from kvsdk.burst_log import BurstLog
from kvsdk.types import ChunkKey

log = logging.getLogger(__name__)

CHANNEL_SUFFIX = b"index"
"""The channel's name after the namespace prefix."""
SCAN_COUNT = 1000
PUBLISH_MAX_KEYS = 1024
"""Keys in one message (a larger put is published in several)."""
UNSENT_MAX = 65536
"""Keys waiting to be published at most (the server does not take them); beyond
it the oldest are dropped (counted ``index_unpublished``)."""
READER_TIMEOUT_MIN_S = 5.0
"""The reader's socket timeout at least: a busy server answering its checks late
costs no rescan."""
KIND_ADDED, KIND_DELETED, KIND_CLEARED = b"a", b"d", b"c"
"""A message's first byte; then the publisher's 8-byte id, then its keys."""


def pack(keys: Iterable[ChunkKey]) -> bytes:
    """Keys as one message: each a length byte, then its bytes."""
    return b"".join(bytes((len(k),)) + k for k in keys if 0 < len(k) < 256)


def unpack(data: bytes) -> list[ChunkKey]:
    out = []
    i = 0
    while i < len(data):
        n = data[i]
        out.append(bytes(data[i + 1 : i + 1 + n]))
        i += 1 + n
    return out


class RedisIndex:
    """The local index of one redis tier (see the module's docstring)."""

    def __init__(self, options: RedisOptions, prefix: bytes) -> None:
        self.options = options
        self._prefix = prefix
        self.channel = prefix + CHANNEL_SUFFIX
        self._writer = os.urandom(8)
        self._pid = os.getpid()
        self._cap = options.local_index_max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[ChunkKey, None] = OrderedDict()
        self._fresh: OrderedDict[ChunkKey, None] | None = None
        """While a seed runs: what it found, plus what happened meanwhile."""
        self._complete = False
        self._outbox: list[tuple[bytes, list[ChunkKey]]] = []
        """What to publish, in order (a kind and its keys)."""
        self._outbox_cond = threading.Condition()
        self._pub_failing = False
        self._in_flight = False
        self._counts = dict.fromkeys(
            ("index_resyncs", "index_dropped", "index_errors", "index_publish_errors",
             "index_unpublished", "index_applied"), 0,
        )  # fmt: skip
        self._burst = BurstLog(log)
        self._closing = threading.Event()
        self._client_lock = threading.Lock()
        self._pub: Any = None
        self._sub: Any = None
        self._flushed = 0
        self._info_allowed = True
        """FLUSHALL and FLUSHDB calls the servers had served at the last seed."""
        self._thread = threading.Thread(target=self._run, name="kvsdk-redis-index", daemon=True)
        self._thread.start()
        self._pub_thread = threading.Thread(
            target=self._publisher, name="kvsdk-redis-index-pub", daemon=True
        )
        self._pub_thread.start()

    # -- what the tier asks (memory only) -------------------------------------------------
    @property
    def complete(self) -> bool:
        """Seeded and read up to now: ``may_contain`` may say False."""
        return self._complete

    def may_contain(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not self._complete or os.getpid() != self._pid:  # (a forked child: no reader)
            return [True] * len(keys)
        with self._lock:
            entries = self._entries
            return [k in entries for k in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            out["index_entries"] = float(len(self._entries))
        out["index_seeded"] = float(self._complete)
        return out

    # -- what the tier tells it ------------------------------------------------------------
    def seen(self, keys: Iterable[ChunkKey]) -> None:
        """The server holds ``keys`` (read or stored here, or published elsewhere)."""
        with self._lock:
            for d in (self._entries, self._fresh):
                if d is None:
                    continue
                for k in keys:
                    if k in d:
                        d.move_to_end(k)
                    else:
                        d[k] = None
                dropped = 0
                while len(d) > self._cap:
                    d.popitem(last=False)
                    dropped += 1
                if d is self._entries:
                    self._counts["index_dropped"] += dropped

    def gone(self, keys: Iterable[ChunkKey]) -> None:
        """The server no longer holds ``keys``."""
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)
                if self._fresh is not None:
                    self._fresh.pop(k, None)

    def stored(self, keys: Sequence[ChunkKey]) -> None:
        """This process stored ``keys``: add them, and publish them to the others."""
        if keys:
            self.seen(keys)
            self._publish(KIND_ADDED, keys)

    def deleted(self, keys: Sequence[ChunkKey]) -> None:
        """This process deleted ``keys``: remove them here and everywhere."""
        if keys:
            self.gone(keys)
            self._publish(KIND_DELETED, keys)

    def cleared(self) -> None:
        """This process cleared the namespace: forget everything, everywhere."""
        with self._lock:
            self._entries = OrderedDict()
            if self._fresh is not None:
                self._fresh = OrderedDict()
        self._publish(KIND_CLEARED, ())

    # -- publishing (a thread of its own: a put never waits for it) ------------------------
    def _publish(self, kind: bytes, keys: Sequence[ChunkKey]) -> None:
        with self._outbox_cond:
            if kind == KIND_CLEARED:
                self._outbox = [(KIND_CLEARED, [])]  # what was queued before is gone too
            elif self._outbox and self._outbox[-1][0] == kind:
                self._outbox[-1][1].extend(keys)
            else:
                self._outbox.append((kind, list(keys)))
            queued = sum(len(k) for _, k in self._outbox)
            if queued > UNSENT_MAX:  # the server has not taken them for a while
                dropped = queued - UNSENT_MAX
                oldest = self._outbox[0][1]
                del oldest[: min(dropped, len(oldest))]
                with self._lock:
                    self._counts["index_unpublished"] += dropped
            self._outbox_cond.notify()

    def _publisher(self) -> None:
        backoff = self.options.backoff_initial
        while not self._closing.is_set():
            with self._outbox_cond:
                while not self._outbox and not self._closing.is_set():
                    self._outbox_cond.wait(1.0)
                if self._closing.is_set():
                    return
                kind, keys = self._outbox.pop(0)
                self._in_flight = True
            try:
                client = self._client("pub")
                for i in range(0, max(1, len(keys)), PUBLISH_MAX_KEYS):
                    packed = pack(keys[i : i + PUBLISH_MAX_KEYS])
                    if packed or kind == KIND_CLEARED:
                        client.publish(self.channel, kind + self._writer + packed)
            except Exception as exc:
                with self._outbox_cond:
                    self._pub_failing = True
                    self._in_flight = False
                    self._outbox_cond.notify_all()
                with self._lock:
                    self._counts["index_publish_errors"] += 1
                self._burst.warning(
                    "publish", "redis tier index: publishing keys failed (%s: %s); trying "
                    "again in %.1fs", type(exc).__name__, redact(self.options, str(exc)),
                    backoff,
                )  # fmt: skip
                self._drop_client("pub")
                with self._outbox_cond:  # again first, unless a clear came meanwhile
                    if not (self._outbox and self._outbox[0][0] == KIND_CLEARED):
                        self._outbox.insert(0, (kind, keys))
                self._closing.wait(backoff)
                backoff = min(self.options.backoff_max, backoff * 2)
                continue
            backoff = self.options.backoff_initial
            with self._outbox_cond:
                self._pub_failing = self._in_flight = False
                self._outbox_cond.notify_all()

    # -- connections (the index's own) ----------------------------------------------------
    def _client(self, which: str) -> Any:
        with self._client_lock:
            client = self._pub if which == "pub" else self._sub
            if client is None:
                client = self._connect(which)
                if which == "pub":
                    self._pub = client
                else:
                    self._sub = client
            return client

    def _connect(self, which: str) -> Any:
        from kvsdk.backends.redis_routing import seed_nodes, sentinel_master

        o = self.options
        url = effective_url(o)
        kwargs = connection_kwargs(o, url)
        kwargs["max_connections"] = 4
        if which == "sub":
            kwargs["socket_timeout"] = max(READER_TIMEOUT_MIN_S, 5 * o.socket_timeout)
        if o.sentinels:
            return sentinel_master(o, url, kwargs)
        if o.cluster:
            return RedisCluster.from_url(
                url, startup_nodes=seed_nodes(o), require_full_coverage=False,
                retry=Retry(NoBackoff(), 0), connection_pool_class=BlockingConnectionPool,
                timeout=o.connect_timeout, **kwargs,
            )  # fmt: skip
        pool = BlockingConnectionPool.from_url(
            url, retry=Retry(NoBackoff(), 0), timeout=o.connect_timeout, **kwargs
        )
        return redis_py.Redis(connection_pool=pool)

    def _drop_client(self, which: str) -> None:
        with self._client_lock:
            client = self._pub if which == "pub" else self._sub
            if which == "pub":
                self._pub = None
            else:
                self._sub = None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
            with contextlib.suppress(Exception):
                if not isinstance(client, RedisCluster):
                    client.connection_pool.disconnect()

    # -- the reader ---------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.options.backoff_initial
        while not self._closing.is_set():
            pubsub: Any = None
            try:
                pubsub = self._subscribe()
                self._seed(pubsub)
                self._complete = True
                backoff = self.options.backoff_initial
                next_check = time.monotonic() + self.check_s()
                while not self._closing.is_set():
                    self._drain(pubsub, self.check_s())
                    if time.monotonic() >= next_check:
                        if self._flushes() != self._flushed:  # a FLUSHALL / FLUSHDB
                            break
                        next_check = time.monotonic() + self.check_s()
            except Exception as exc:
                if self._closing.is_set():
                    return
                self._complete = False
                with self._lock:
                    self._counts["index_errors"] += 1
                self._burst.warning(
                    "reader", "redis tier index: %s: %s; every lookup asks the server until it "
                    "has rescanned (in %.1fs)", type(exc).__name__,
                    redact(self.options, str(exc)), backoff,
                )  # fmt: skip
                self._drop_client("sub")
                self._closing.wait(backoff)
                backoff = min(self.options.backoff_max, backoff * 2)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
        self._complete = False

    def check_s(self) -> float:
        """How often the reader checks for a flush (and that the server answers)."""
        return max(0.05, min(1.0, self.options.socket_timeout / 2))

    def _masters(self) -> list[Any]:
        client = self._client("sub")
        if isinstance(client, RedisCluster):
            rc: Any = client  # (untyped upstream)
            return [rc.get_redis_connection(n) for n in rc.get_primaries()]
        return [client]

    def _subscribe(self) -> Any:
        """A subscription to the namespace's channel, confirmed by the server."""
        client = self._client("sub")
        if isinstance(client, RedisCluster):  # (a PUBLISH reaches every node)
            rc: Any = client  # (untyped upstream)
            client = rc.get_redis_connection(rc.get_node_from_key(self.channel))
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            deadline = time.monotonic() + self.options.connect_timeout + self.options.socket_timeout
            while time.monotonic() < deadline:
                msg = pubsub.get_message(timeout=0.05)
                if msg is not None and msg.get("type") == "subscribe":
                    return pubsub
            raise TimeoutError("no confirmation of the subscription")
        except BaseException:
            with contextlib.suppress(Exception):
                pubsub.close()
            raise

    def _flushes(self) -> int:
        """FLUSHALL and FLUSHDB calls the servers (every master) have served (0
        where an ACL refuses this user ``INFO``: then only a ``PING`` checks
        that they answer, and a flush is found out key by key, as reads miss)."""
        n = 0
        for node in self._masters():
            if not self._info_allowed:
                node.ping()
                continue
            try:
                stats = node.info("commandstats")
            except NoPermissionError:
                self._info_allowed = False
                log.info("redis tier index: INFO refused to this user; a FLUSHALL is not noticed")
                continue
            for name in ("cmdstat_flushall", "cmdstat_flushdb"):
                entry = stats.get(name)
                if isinstance(entry, dict):
                    n += int(entry.get("calls", 0))
        return n

    def _seed(self, pubsub: Any) -> None:
        """Rebuild the index from a SCAN of the namespace (subscribed first, so what
        is stored meanwhile is heard of; heard of between the SCAN's pages)."""
        self._complete = False
        with self._lock:
            self._counts["index_resyncs"] += 1
            self._fresh = OrderedDict()
        self._flushed = self._flushes()
        for batch in self._scan():
            self._found(batch)
            self._drain(pubsub, 0.0)
        with self._lock:
            assert self._fresh is not None
            self._entries, self._fresh = self._fresh, None

    def _found(self, keys: list[ChunkKey]) -> None:
        with self._lock:
            fresh = self._fresh
            if fresh is None:
                return
            for k in keys:
                fresh[k] = None
            while len(fresh) > self._cap:
                fresh.popitem(last=False)
                self._counts["index_dropped"] += 1

    def _scan(self) -> Iterator[list[ChunkKey]]:
        n = len(self._prefix)
        for node in self._masters():
            cursor = 0
            while not self._closing.is_set():
                cursor, found = node.scan(cursor, match=self._prefix + b"*", count=SCAN_COUNT)
                keys = []
                for rkey in found:
                    try:
                        keys.append(bytes.fromhex(rkey[n:].decode()))
                    except (ValueError, UnicodeDecodeError):
                        continue  # not one of this namespace's chunks
                yield keys
                if not cursor:
                    break

    def _drain(self, pubsub: Any, wait: float) -> None:
        """Apply the messages heard (waiting up to ``wait`` s for the first)."""
        got = 0
        msg = pubsub.get_message(timeout=wait)
        while msg is not None:
            if msg.get("type") == "message" and isinstance(msg.get("data"), bytes):
                got += self._apply(msg["data"])
            msg = pubsub.get_message(timeout=0.0)
        if got:
            with self._lock:
                self._counts["index_applied"] += got

    def _apply(self, data: bytes) -> int:
        """Apply one message of another process (1), or skip one of this one's (0)."""
        kind, writer, keys = data[:1], data[1:9], data[9:]
        if writer == self._writer:
            return 0
        if kind == KIND_CLEARED:
            with self._lock:
                self._entries = OrderedDict()
                if self._fresh is not None:
                    self._fresh = OrderedDict()
        elif kind == KIND_ADDED:
            self.seen(unpack(keys))
        elif kind == KIND_DELETED:
            self.gone(unpack(keys))
        return 1

    def close(self) -> None:
        with self._outbox_cond:  # what this process stored last reaches the others
            self._outbox_cond.wait_for(
                lambda: not (self._outbox or self._in_flight) or self._pub_failing,
                timeout=self.options.connect_timeout + self.options.socket_timeout,
            )
        self._closing.set()
        with self._outbox_cond:
            self._outbox_cond.notify_all()
        self._drop_client("sub")
        self._drop_client("pub")
        self._thread.join(timeout=2.0)
        self._pub_thread.join(timeout=2.0)
