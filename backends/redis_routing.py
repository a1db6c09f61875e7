"""Where the redis tier's commands go and how: the standalone client, or the
Cluster client with keys grouped by the node that owns their slot, and
pipelines of ``max_batch`` keys per round trip behind each server's breaker.

The slot map is refreshed (at most once per :data:`TOPOLOGY_REFRESH_S`) after
a MOVED, ASK, TRYAGAIN or CLUSTERDOWN reply, and while a node fails or is
skipped behind its open breaker: when a master dies and the cluster promotes
its replica, the refresh finds the new master and its slots are served again
(a node that stops answering sends no MOVED to say so). The seed nodes are
``url`` and ``urls``: the client connects through any one that answers.

Every round trip has a deadline as a whole (``socket_timeout`` bounds each
read, not a reply a server drips a byte at a time): it runs on a thread of
the tier's own (:class:`~kvsdk.backends.disk_reader.DeadlineReader`) and the
caller waits at most ``connect_timeout + socket_timeout``, plus the time the
bytes of the round trip take at :data:`MIN_BYTES_PER_S`. A round trip past
its deadline, or failing in any way (a server that does not answer, a reply
the client cannot parse), is a failure of its server: counted, its breaker
opened and its sockets closed (which frees the thread still blocked in it),
and its keys are misses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis as redis_py
from redis import connection as redis_connection
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import (
    AskError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    TryAgainError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from kvsdk.backend import BackendError
from kvsdk.backends.disk_reader import DeadlineReader, Handoff
from kvsdk.backends.redis_health import OUTAGE, Health
from kvsdk.backends.redis_options import RedisOptions, connection_kwargs, effective_url

SKIPPED = object()
"""The reply of a key whose server was skipped (breaker open, slot uncovered)."""
PAUSED = object()
"""The reply of a write not sent: its server refused writes a moment ago."""
REFUSALS = (OutOfMemoryError, ReadOnlyError, NoPermissionError)
"""Replies that refuse writes for a while (a full server with ``noeviction``, a
replica, an ACL user without write access): back-pressure, not an outage."""
TOPOLOGY = (AskError, ClusterDownError, TryAgainError)  # AskError covers MovedError
"""Replies that mean the slot map is stale: refresh it."""
TOPOLOGY_REFRESH_S = 1.0
"""Seconds at least between two slot map refreshes."""

MIN_BYTES_PER_S = 64 << 20
"""The slowest transfer a round trip's deadline allows for its bytes (sent and
at most received), on top of ``connect_timeout + socket_timeout``."""
ROUND_TRIP_BYTES = 8 << 20
"""The most payload bytes one pipelined round trip moves (beyond its first key):
a batch of large chunks is split, so no call holds a busy server (or its
deadline) for a long transfer, and reads and writes of other threads interleave."""
CALL_THREADS_MAX = 32
"""Threads a tier runs its round trips on: ``max_connections``, at most this."""

Route = tuple[str, Any, list[int]]  # (server name, client, positions in the batch)
AddCommands = Callable[[Any, list[int]], None]
_T = TypeVar("_T")


def within(reader: DeadlineReader, fn: Callable[[], _T], seconds: float) -> list[_T]:
    """``fn()`` on one of ``reader``'s threads: ``[its result]``, or ``[]`` when
    it missed its deadline of ``seconds`` (or was not made: every thread of
    ``reader`` is blocked past its deadline). Raises what ``fn`` raised."""
    box: list[_T] = []

    def run(handoff: Handoff) -> None:
        if handoff.abandoned:
            return  # queued past its deadline: not made at all
        out = fn()
        handoff.deliver(lambda _target: box.append(out))

    reader.run(run, timeout=seconds)
    return box


def seed_nodes(o: RedisOptions) -> list[ClusterNode]:
    """The Cluster seed nodes of ``urls`` (``url``'s node is added by the client)."""
    node: Any = ClusterNode  # (untyped upstream)
    return [node(p.hostname or "127.0.0.1", p.port or 6379) for p in map(urlsplit, o.urls)]


def sentinel_master(o: RedisOptions, url: str, kwargs: dict[str, Any]) -> redis_py.Redis:
    """A client of the master the sentinels name for ``sentinel_master``: each new
    connection asks them, so after a failover (the breaker drops the sockets of
    a master that stopped answering) the next ones reach the promoted replica."""
    sentinel = Sentinel(
        [(p.hostname or "127.0.0.1", p.port or 26379) for p in map(urlsplit, o.sentinels)],
        socket_timeout=o.socket_timeout,
        socket_connect_timeout=o.connect_timeout,
    )
    db = int(urlsplit(url).path.strip("/") or 0)
    if o.sentinel_master is None:  # (RedisOptions refuses sentinels without it)
        raise ValueError("sentinels: set without sentinel_master")
    client: redis_py.Redis = sentinel.master_for(
        o.sentinel_master, db=db, retry=Retry(NoBackoff(), 0), **kwargs
    )
    return client


class RoundTripFailed(Exception):
    """A round trip failed or missed its deadline; already counted and reported
    (its server's breaker opened). ``reason``: what happened, password kept out."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Router:
    """The tier's connections (a bounded pool per server) and the pipelined
    round trips over them. Thread-safe."""

    def __init__(self, options: RedisOptions, health: Health) -> None:
        self._options = options
        self._health = health
        url = self._url = effective_url(options)
        parse_url: Any = redis_connection.parse_url  # (untyped upstream)
        parse_url(url)  # a malformed URL fails at start-up
        self._kwargs = connection_kwargs(options, url)
        self._connect_lock = threading.Lock()
        """Held while the Cluster client connects (one thread at a time)."""
        self._refresh_lock = threading.Lock()
        self._refresh_topology = False
        self._last_refresh = 0.0
        self.client: redis_py.Redis | None = None
        """The standalone server's client (None in Cluster mode)."""
        self.cluster: RedisCluster | None = None
        """The Cluster client, once connected."""
        self._calls = DeadlineReader(
            min(options.max_connections, CALL_THREADS_MAX),
            options.connect_timeout + options.socket_timeout,
            name="kvsdk-redis",
        )
        if options.sentinels:
            self.client = sentinel_master(options, url, self._kwargs)
        elif not options.cluster:
            pool = BlockingConnectionPool.from_url(
                url, retry=Retry(NoBackoff(), 0), timeout=options.connect_timeout, **self._kwargs
            )
            self.client = redis_py.Redis(connection_pool=pool)

    def deadline(self, nbytes: int = 0) -> float:
        """Seconds a round trip moving ``nbytes`` may take as a whole."""
        o = self._options
        return o.connect_timeout + o.socket_timeout + nbytes / MIN_BYTES_PER_S

    def _node_out(self, name: str) -> None:
        """Cluster node ``name`` failed or is skipped: its slots may have moved
        (a replica promoted), so the slot map is refreshed soon."""
        if self.cluster is not None and name != "cluster":
            self._refresh_topology = True

    def call(self, name: str, client: Any, fn: Callable[[], _T], nbytes: int = 0) -> _T:
        """``fn()`` (one round trip to server ``name``) within its deadline.

        Raises :class:`RoundTripFailed` when it fails in any way or misses its
        deadline, after counting it, opening the server's breaker and closing
        ``client``'s sockets (a thread still blocked in ``fn`` gets an error
        and returns)."""
        seconds = self.deadline(nbytes)
        try:
            box = within(self._calls, fn, seconds)
        except Exception as exc:  # any failure: the server's (or its reply's), never raised
            self._health.outage(name, client, exc)
            self._node_out(name)
            raise RoundTripFailed(
                f"{type(exc).__name__}: {self._health.redact(str(exc))}"
            ) from None
        if not box:
            self._node_out(name)
            late, workers = self._calls.late, self._calls.workers
            raise RoundTripFailed(
                self._health.missed_deadline(name, client, seconds, late, workers)
            )
        return box[0]

    def cluster_client(self) -> RedisCluster | None:
        """The Cluster client, connecting it on first use; None while the
        cluster's breaker is open or the connection failed."""
        if self.cluster is not None:
            return self.cluster
        breaker = self._health.breaker("cluster")
        if not breaker.allow():
            return None
        with self._connect_lock:
            if self.cluster is None:
                try:
                    self.cluster = self.call("cluster", None, self._connect_cluster)
                except RoundTripFailed:
                    return None
        breaker.succeeded()
        return self.cluster

    def _connect_cluster(self) -> RedisCluster:
        return RedisCluster.from_url(
            self._url,
            startup_nodes=seed_nodes(self._options),
            require_full_coverage=False,
            retry=Retry(NoBackoff(), 0),
            connection_pool_class=BlockingConnectionPool,
            timeout=self._options.connect_timeout,
            **self._kwargs,
        )

    def routes(self, rkeys: Sequence[bytes]) -> list[Route]:
        """``rkeys`` grouped by server; a key whose slot no node covers is left out."""
        if self.client is not None:
            return [("server", self.client, list(range(len(rkeys))))]
        rc: Any = self.cluster_client()  # (untyped upstream)
        if rc is None:
            return []
        self._maybe_refresh(rc)
        groups: dict[str, Route] = {}
        for i, rkey in enumerate(rkeys):
            try:
                node = rc.get_node_from_key(rkey)
            except OUTAGE:
                continue  # slot not covered right now: a miss
            route = groups.get(node.name)
            if route is None:
                route = groups[node.name] = (node.name, rc.get_redis_connection(node), [])
            route[2].append(i)
        return list(groups.values())

    def _maybe_refresh(self, rc: RedisCluster) -> None:
        now = time.monotonic()
        if not self._refresh_topology or now - self._last_refresh < TOPOLOGY_REFRESH_S:
            return
        with self._refresh_lock:
            if not self._refresh_topology:
                return
            self._refresh_topology = False
            self._last_refresh = now
        self._health.count("topology_refreshes")
        try:
            self.call("cluster", None, rc.nodes_manager.initialize)
        except RoundTripFailed as exc:
            self._health.burst.warning(
                "topology", "redis tier %s: topology refresh failed: %s", self._health.where,
                exc.reason,
            )  # fmt: skip

    def execute(
        self,
        rkeys: Sequence[bytes],
        add: AddCommands,
        per_key: bool,
        commands_per_key: int = 1,
        *,
        valid: Callable[[Any], bool] | None = None,
        key_bytes: Callable[[int], int] | None = None,
        writes: bool = False,
    ) -> list[Any]:
        """Pipelined commands for ``rkeys``, ``max_batch`` keys per round trip,
        each within its deadline (see the module's docstring).

        Returns one reply per key: the server's answer, an exception for a
        command the server refused, or ``SKIPPED`` when its server is out
        (its breaker open, or this round trip failed). ``add(pipe, positions)``
        queues the commands; with ``per_key=False`` it queues one multi-key
        command whose reply is a list. With ``commands_per_key`` > 1 it queues
        that many per key, and each key's reply is the tuple of their replies
        (an exception if one failed). A reply (not an exception) that
        ``valid`` refuses makes the round trip a failure of its server.
        ``key_bytes(position)``: the bytes key ``position`` may move (sent and
        received), for the deadline. With ``writes``, a server that refused
        writes (:data:`REFUSALS`) is sent none for a backoff: those keys'
        replies are ``PAUSED``.
        """
        out: list[Any] = [SKIPPED] * len(rkeys)
        for name, client, positions in self.routes(rkeys):
            breaker = self._health.breaker(name)
            pause = self._health.write_pause(name) if writes else None
            for part in self._round_trips(positions, key_bytes):
                if pause is not None and not pause.allow():
                    for i in part:
                        out[i] = PAUSED
                    self._health.count("writes_paused", len(part))
                    continue
                if not breaker.allow():
                    self._node_out(name)
                    continue
                nbytes = sum(map(key_bytes, part)) if key_bytes is not None else 0
                self._health.count("round_trips")

                def round_trip(client: Any = client, part: list[int] = part) -> list[Any]:
                    pipe = client.pipeline(transaction=False)
                    add(pipe, part)
                    replies = pipe.execute(raise_on_error=False)
                    return self._per_key(replies, len(part), per_key, commands_per_key, valid)

                try:
                    replies = self.call(name, client, round_trip, nbytes)
                except RoundTripFailed:
                    continue
                breaker.succeeded()
                for i, reply in zip(part, replies, strict=True):
                    if isinstance(reply, TOPOLOGY):
                        self._refresh_topology = True
                    out[i] = reply
                if pause is not None:
                    refused = next((r for r in replies if isinstance(r, REFUSALS)), None)
                    if refused is None:
                        pause.succeeded()
                    else:
                        self._health.writes_refused(name, refused, pause.failed())
        skipped = sum(1 for r in out if r is SKIPPED)
        if skipped:
            self._health.count("skipped", skipped)
        return out

    def _round_trips(
        self, positions: list[int], key_bytes: Callable[[int], int] | None
    ) -> list[list[int]]:
        """``positions`` in round trips of at most ``max_batch`` keys and
        :data:`ROUND_TRIP_BYTES` bytes (at least one key each)."""
        step = self._options.max_batch
        if key_bytes is None:
            return [positions[i : i + step] for i in range(0, len(positions), step)]
        out: list[list[int]] = []
        part: list[int] = []
        size = 0
        for i in positions:
            n = key_bytes(i)
            if part and (len(part) >= step or size + n > ROUND_TRIP_BYTES):
                out.append(part)
                part, size = [], 0
            part.append(i)
            size += n
        if part:
            out.append(part)
        return out

    @staticmethod
    def _per_key(
        replies: Any, n: int, per_key: bool, c: int, valid: Callable[[Any], bool] | None
    ) -> list[Any]:
        """A pipeline's ``replies`` as one per key (see :meth:`execute`); raises
        ``InvalidResponse`` for replies of another shape than the commands'."""
        if not isinstance(replies, list) or len(replies) != (1 if not per_key else n * c):
            raise InvalidResponse("a pipeline answered with another number of replies")
        if not per_key:
            replies = replies[0]
            if isinstance(replies, Exception):
                return [replies] * n
            if not isinstance(replies, list) or len(replies) != n:
                raise InvalidResponse("a multi-key command answered with another number of values")
        elif c > 1:
            grouped = [tuple(replies[j : j + c]) for j in range(0, len(replies), c)]
            replies = [next((r for r in g if isinstance(r, Exception)), g) for g in grouped]
        if valid is not None and not all(isinstance(r, Exception) or valid(r) for r in replies):
            raise InvalidResponse("a reply of another type than its command's")
        return list(replies)

    def scan_clients(self) -> list[tuple[str, Any]]:
        """A client per server that holds keys (every primary in Cluster mode)."""
        if self.client is not None:
            return [("server", self.client)]
        rc: Any = self.cluster_client()
        if rc is None:
            raise BackendError(f"redis tier {self._health.where}: cluster not reachable")
        return [(n.name, rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def close(self) -> None:
        self._calls.close()
        if self.client is not None:
            self.client.close()
            self.client.connection_pool.disconnect()
        if self.cluster is not None:
            self.cluster.close()
