"""Where the redis tier's commands go and how: the standalone client, or the
Cluster client with keys grouped by the node that owns their slot, and
pipelines of ``max_batch`` keys per round trip behind each server's breaker.

The slot map is refreshed (at most once per :data:`TOPOLOGY_REFRESH_S`) after
a MOVED, ASK, TRYAGAIN or CLUSTERDOWN reply, and while a node fails or is
skipped behind its open breaker: when a master dies and the cluster promotes
its replica, the refresh finds the new master and its slots are served again
(a node that stops answering sends no MOVED to say so). The seed nodes are
``url`` and ``urls``: the client connects through any one that answers.

Every round trip has a deadline as a whole, ``connect_timeout +
socket_timeout`` plus the time its bytes take at :data:`MIN_BYTES_PER_S` (a
conservative floor: a healthy server busy with other clients' large values
still makes it): it runs on a thread of the tier's own
(:class:`~kvsdk.backends.disk_reader.DeadlineReader`), the caller waits at
most that long, and its connection's socket timeout is set to it for the
round trip (so a busy server's late reply to a large batch is no timeout,
while ``socket_timeout`` alone bounds nothing a server drips a byte at a
time). A round trip that fails on a broken connection (``Connection closed
by server``, ``Broken pipe``: a server closing idle or overloaded clients)
is sent once more on a fresh connection (every command the tier pipelines
is idempotent: EXISTS, GET, GETRANGE, SET of a framed value, EXPIRE,
UNLINK). A read past its deadline, or failing in any way (a server that does
not answer, a reply the client cannot parse), is a failure of its server:
counted, its breaker opened, its own connection closed (which frees the
thread still blocked in it; a connection error closes the server's idle
ones too), and its keys are misses.

Reads go before writes: while reads are in flight on a server, its writes
(``put``, a write-through) go one at a time (a write waits for the one before,
at most :data:`WRITE_YIELD_S`: ``writes_yielded``), and a
write past its deadline stalls that server's writes for a backoff
(``write_timeouts``; the keys not sent meanwhile count as ``writes_paused``)
instead of opening the breaker its reads go through."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis as redis_py
from redis import connection as redis_connection
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
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

MIN_BYTES_PER_S = 8 << 20
"""The slowest transfer a round trip's deadline (and its socket timeout) allows
for its bytes (sent and at most received), on top of ``connect_timeout +
socket_timeout``: a server shared by many engines' I/O threads moving 4 MiB
values gives each a share of its bandwidth (two vLLM engines measured 8 MiB
round trips at about 22 MB/s), and stalls now and then (a slow command of
another client, a fork, a congested link). An 8 MiB round trip gets 3 s at
the defaults; a server that answers nothing is still found within the
deadline of the first round trip it fails."""
WRITE_YIELD_S = 1.0
"""The longest a write waits for its turn while reads are in flight on its server
(at most ``socket_timeout``)."""
ROUND_TRIP_BYTES = 8 << 20
"""The most payload bytes one pipelined round trip moves (beyond its first key):
a batch of large chunks is split, so no call holds a busy server (or its
deadline) for a long transfer, and reads and writes of other threads interleave."""
ROUND_TRIPS_IN_FLIGHT = 2
"""A call's round trips to one server in flight at once (each on a connection of
its own): the client reads one reply while the server works on the next."""
NODE_THREADS = 8
"""Cluster nodes one call's round trips go to at once (each node's one after another)."""
CALL_THREADS_MAX = 32
"""Threads a tier runs its round trips on: ``max_connections``, at most this."""

Route = tuple[str, Any, list[int]]  # (server name, client, positions in the batch)
Packed = Callable[[list[int]], tuple[list[Any], int]]
"""positions -> (the commands in the protocol, as buffers; how many replies)."""
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


def set_timeout(conn: Any, seconds: float) -> None:
    """``conn``'s socket timeout (each read and write on it) for one round trip:
    the socket's now, and the one it gets when it reconnects."""
    conn.socket_timeout = seconds
    sock = getattr(conn, "_sock", None)
    if sock is not None:
        sock.settimeout(seconds)
    buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
    if buffer is not None and hasattr(buffer, "socket_timeout"):
        buffer.socket_timeout = seconds  # (restored after a can_read() probe)


def send_packed(conn: Any, buffers: list[Any], replies: int) -> list[Any]:
    """Send ``buffers`` (commands in the protocol) on ``conn`` and read their
    ``replies``; a reply that is an error is its exception. Any other failure
    leaves ``conn`` closed (redis-py closes it), never out of step."""
    conn.send_packed_command(buffers, check_health=False)
    out: list[Any] = []
    for _ in range(replies):
        try:
            out.append(conn.read_response())
        except ResponseError as exc:  # (read whole: the connection is in step)
            out.append(exc)
    return out


def bulk(data: bytes) -> bytes:
    """``data`` as a bulk string of the protocol."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


def retryable(exc: BaseException) -> bool:
    """A broken connection (closed by the server, a broken pipe, reset): worth one
    more try on a fresh connection. Not a timeout, nor refused credentials."""
    return isinstance(exc, RedisConnectionError) and not isinstance(exc, AuthenticationError)


class Lease:
    """The connection one round trip holds, so that a caller giving up on it
    (its deadline passed) closes that connection, and only it: the thread
    still blocked in it gets an error and returns."""

    __slots__ = ("_conn", "_lock", "abandoned")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Any = None
        self.abandoned = False

    def hold(self, conn: Any) -> bool:
        """The round trip uses ``conn`` now; False when its caller gave up."""
        with self._lock:
            self._conn = conn
            return not self.abandoned

    def done(self) -> None:
        with self._lock:
            self._conn = None

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort on a broken connection
                conn.disconnect()


class Gate:
    """Reads first, per server: while reads are in flight, one write at a time
    goes (the others wait, at most a bound), so writes never crowd out reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reads = 0
        self._writes = 0

    def reading(self, delta: int) -> None:
        with self._cond:
            self._reads += delta
            if not self._reads:
                self._cond.notify_all()

    def write_start(self, limit: float) -> bool:
        """A write begins, after waiting (at most ``limit`` s) until no read is in
        flight or no other write is; False when it waited."""
        with self._cond:
            waited = False
            if self._reads and self._writes:
                waited = True
                self._cond.wait_for(lambda: not (self._reads and self._writes), timeout=limit)
            self._writes += 1
            return not waited

    def write_end(self) -> None:
        with self._cond:
            self._writes -= 1
            self._cond.notify_all()


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
        self._gates: dict[str, Gate] = {}
        self._nodes: ThreadPoolExecutor | None = None
        self._parts: ThreadPoolExecutor | None = None
        """Threads sending a call's further round trips to one server beside its first."""
        """Threads sending one call's round trips to several Cluster nodes at once."""
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

    def call(
        self,
        name: str,
        client: Any,
        fn: Callable[[], _T],
        nbytes: int = 0,
        *,
        lease: Lease | None = None,
        writes: bool = False,
    ) -> _T:
        """``fn()`` (one round trip to server ``name``) within its deadline.

        Raises :class:`RoundTripFailed` when it fails in any way or misses its
        deadline, after counting it and opening the server's breaker (for
        ``writes`` that timed out: stalling its writes instead). The thread
        still blocked in ``fn`` is freed by closing the connection ``lease``
        holds (without one, every socket of ``client``)."""
        seconds = self.deadline(nbytes)
        try:
            box = within(self._calls, fn, seconds)
        except Exception as exc:  # any failure: the server's (or its reply's), never raised
            if writes and isinstance(exc, RedisTimeoutError | TimeoutError):
                raise RoundTripFailed(self._health.write_timed_out(name, seconds)) from None
            # a timed-out connection is closed already; a broken one may have idle siblings
            timed_out = isinstance(exc, RedisTimeoutError | TimeoutError)
            self._health.outage(name, None if timed_out and lease else client, exc)
            self._node_out(name)
            raise RoundTripFailed(
                f"{type(exc).__name__}: {self._health.redact(str(exc))}"
            ) from None
        if not box:
            if lease is not None:
                lease.abandon()
            if writes:
                raise RoundTripFailed(self._health.write_timed_out(name, seconds))
            self._node_out(name)
            late, workers = self._calls.late, self._calls.workers
            raise RoundTripFailed(
                self._health.missed_deadline(
                    name, None if lease else client, seconds, late, workers
                )
            )
        return box[0]

    def round_trip(
        self, client: Any, seconds: float, lease: Lease, send: Callable[[Any], _T]
    ) -> _T:
        """``send(pipeline)`` on a connection of ``client``'s pool leased for it,
        its socket timeout ``seconds``; once more when the first connection
        breaks (the broken one is closed; the pool checks an idle one for a
        close by the server before it hands it out, else connects anew)."""
        pool = client.connection_pool
        for attempt in (0, 1):
            conn = pool.get_connection()
            if not lease.hold(conn):
                pool.release(conn)
                raise RedisTimeoutError("the round trip's deadline passed before its retry")
            set_timeout(conn, seconds)
            pipe = client.pipeline(transaction=False)
            pipe.connection = conn  # released to the pool by the pipeline's reset
            try:
                return send(pipe)
            except Exception as exc:
                if attempt or lease.abandoned or not retryable(exc):
                    raise
                self._health.count("retries")
            finally:
                lease.done()
                pipe.reset()
        raise AssertionError("unreachable")

    def gate(self, name: str) -> Gate:
        g = self._gates.get(name)
        if g is None:
            with self._refresh_lock:
                g = self._gates.setdefault(name, Gate())
        return g

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
        packed: Packed | None = None,
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
        replies are ``PAUSED``. With ``packed``, ``add`` is not called:
        ``packed(positions)`` gives the round trip's commands already in the
        protocol, as buffers sent as they are (a large value's parts without
        a join), and how many replies they get (one per key, as read: a
        simple string is ``bytes``).
        """
        out: list[Any] = [SKIPPED] * len(rkeys)
        routes = self.routes(rkeys)

        def one(route: Route) -> None:
            name, client, positions = route
            self._execute_on(name, client, positions, out, add, per_key, commands_per_key,
                             valid, key_bytes, writes, packed)  # fmt: skip

        if len(routes) > 1:  # Cluster nodes in parallel, as a Cluster pipeline does
            for future in [self._nodes_pool().submit(one, r) for r in routes]:
                future.result()
        elif routes:
            one(routes[0])
        skipped = sum(1 for r in out if r is SKIPPED)
        if skipped:
            self._health.count("skipped", skipped)
        return out

    def _parts_pool(self) -> ThreadPoolExecutor:
        with self._refresh_lock:
            if self._parts is None:
                self._parts = ThreadPoolExecutor(
                    min(self._options.max_connections, CALL_THREADS_MAX),
                    thread_name_prefix="kvsdk-redis-trip",
                )
            return self._parts

    def _nodes_pool(self) -> ThreadPoolExecutor:
        with self._refresh_lock:
            if self._nodes is None:
                self._nodes = ThreadPoolExecutor(
                    NODE_THREADS, thread_name_prefix="kvsdk-redis-node"
                )
            return self._nodes

    def _execute_on(
        self,
        name: str,
        client: Any,
        positions: list[int],
        out: list[Any],
        add: AddCommands,
        per_key: bool,
        commands_per_key: int,
        valid: Callable[[Any], bool] | None,
        key_bytes: Callable[[int], int] | None,
        writes: bool,
        packed: Packed | None,
        split: bool = True,
    ) -> None:
        """:meth:`execute`'s round trips to server ``name`` (``positions`` split
        into them, unless not ``split``: one), :data:`ROUND_TRIPS_IN_FLIGHT` at
        a time, their replies into ``out``."""
        breaker = self._health.breaker(name)
        pause = self._health.write_pause(name) if writes else None
        stall = self._health.write_stall(name) if writes else None
        gate = self.gate(name)
        parts = self._round_trips(positions, key_bytes) if split else [positions]
        if len(parts) > 1:  # a few round trips in flight at once, each on its own connection
            depth = min(ROUND_TRIPS_IN_FLIGHT, len(parts))
            todo = iter(parts)
            lock = threading.Lock()

            def worker() -> None:
                while True:
                    with lock:
                        part = next(todo, None)
                    if part is None:
                        return
                    self._execute_on(name, client, part, out, add, per_key, commands_per_key,
                                     valid, key_bytes, writes, packed, split=False)  # fmt: skip

            helpers = [self._parts_pool().submit(worker) for _ in range(depth - 1)]
            worker()
            for helper in helpers:
                helper.result()
            return
        for part in parts:
            if pause is not None and stall is not None and not (pause.allow() and stall.allow()):
                for i in part:
                    out[i] = PAUSED
                self._health.count("writes_paused", len(part))
                continue
            if not breaker.allow():
                self._node_out(name)
                continue
            nbytes = sum(map(key_bytes, part)) if key_bytes is not None else 0
            lease = Lease()

            def send(pipe: Any, part: list[int] = part) -> list[Any]:
                if packed is None:
                    add(pipe, part)
                    replies = pipe.execute(raise_on_error=False)
                else:
                    replies = send_packed(pipe.connection, *packed(part))
                return self._per_key(replies, len(part), per_key, commands_per_key, valid)

            def round_trip(
                client: Any = client,
                lease: Lease = lease,
                seconds: float = self.deadline(nbytes),
            ) -> list[Any]:
                return self.round_trip(client, seconds, lease, send)

            if writes:
                if not gate.write_start(min(WRITE_YIELD_S, self._options.socket_timeout)):
                    self._health.count("writes_yielded")
            else:
                gate.reading(1)
            self._health.count("round_trips")
            try:
                replies = self.call(name, client, round_trip, nbytes, lease=lease,
                                    writes=writes)  # fmt: skip
            except RoundTripFailed:
                continue
            finally:
                if writes:
                    gate.write_end()
                else:
                    gate.reading(-1)
            breaker.succeeded()
            for i, reply in zip(part, replies, strict=True):
                if isinstance(reply, TOPOLOGY):
                    self._refresh_topology = True
                out[i] = reply
            if pause is not None and stall is not None:
                stall.succeeded()
                refused = next((r for r in replies if isinstance(r, REFUSALS)), None)
                if refused is None:
                    pause.succeeded()
                else:
                    self._health.writes_refused(name, refused, pause.failed())

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
        for pool in (self._nodes, self._parts):
            if pool is not None:
                pool.shutdown(wait=False)
        self._calls.close()
        if self.client is not None:
            self.client.close()
            self.client.connection_pool.disconnect()
        if self.cluster is not None:
            self.cluster.close()
