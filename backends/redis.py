"""``redis``: chunks in Redis or Valkey, standalone or Cluster, shared by every instance.

Needs the ``[redis]`` extra (the ``redis`` client). Keys are
``kvsdk:<namespace_hex>:<key_hex>``, so two models or two tenants never see
each other's entries; each value is a :mod:`kvsdk.chunk_format` frame.

Contract with the tiered store (bytes in, bytes out; framing is ours):

- ``put([(key, payload)])`` frames the raw payload and ``SET``s it (``EX`` when
  ``ttl_seconds`` is set), pipelined ``max_batch`` keys per round trip.
  Returns per item whether the server acknowledged it.
- ``get(keys)`` returns the verified payload (``memoryview``, flat bytes) or
  ``None``. A value that fails verification is a miss: counted, and deleted.
  Values are untrusted (``docs/security.md``): each is read with ``GETRANGE
  0 <largest frame>`` (pipelined, per node in Cluster mode), so a planted
  huge value costs at most one frame's bytes on the wire and in memory
  (``oversized``, dropped); ``MGET`` only when the context gives no chunk size.
  With a deployment secret (``TierContext.frame_key``) frames carry a MAC.
- ``exists``/``delete`` likewise pipelined; ``clear`` scans this namespace's
  keys and unlinks them.

Failures never raise out of ``exists``/``get``/``put``/``delete``: a lost
connection, a timeout or a restarting server gives misses (``None`` /
``False``), and opens a circuit breaker: the server is skipped for a backoff
period (``backoff_initial`` doubling up to ``backoff_max``), then tried again;
the first success closes it. In Cluster mode each node has its own breaker,
so a dead node costs misses for its slots only. (Run the cluster with
``cluster-require-full-coverage no`` so the other nodes keep serving.)

Nothing queues: every call is synchronous and bounded by its batch, and the
connection pool is bounded (``max_connections``; callers wait for a free
connection up to ``connect_timeout``). Thread-safe: the tiered store calls it
from several I/O threads.

The password (option or URL) never appears in ``repr``, logs or error text.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis as redis_py
from redis import connection as redis_connection
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvsdk import trust
from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.burst_log import BurstLog
from kvsdk.chunk_format import (
    FP_BYTES,
    HEADER_SIZE,
    CorruptChunk,
    UnverifiableChunk,
    decode_chunk,
    encode_chunk,
)
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

log = logging.getLogger(__name__)

_OUTAGE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    OSError,
)
"""Errors that mean "the server (node) is not answering": open its breaker."""
_TOPOLOGY = (AskError, ClusterDownError, TryAgainError)  # AskError covers MovedError
_SKIPPED = object()
_TOPOLOGY_REFRESH_S = 1.0
mask_url = trust.mask_url
"""``redis://user:secret@host`` → ``redis://user:***@host`` (any password)."""


@dataclass(frozen=True, repr=False)
class RedisOptions:
    url: str = "redis://127.0.0.1:6379/0"
    """``redis://`` or ``rediss://`` (TLS); in Cluster mode, any one node."""
    cluster: bool = False
    """Redis Cluster: keys spread over the nodes by slot."""
    ttl_seconds: int | None = None
    """Expire entries this long after they are stored (None: never; rely on maxmemory)."""
    username: str | None = None
    """AUTH (ACL) user; overrides one in the URL."""
    password: str | None = None
    """AUTH password (never logged); overrides one in the URL."""
    tls: bool = False
    """Use TLS even with a ``redis://`` URL."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    """Verify the server certificate and host name."""
    socket_timeout: float = 1.0
    """Seconds a command may wait for the server before it counts as a failure."""
    connect_timeout: float = 1.0
    max_batch: int = 64
    """Keys per pipelined round trip."""
    max_connections: int = 16
    """Connections per server (per node in Cluster mode)."""
    backoff_initial: float = 0.5
    """Seconds the server is skipped after a failure; doubles per failure."""
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss"):
            raise ValueError(f"url: got {mask_url(self.url)!r}; expected redis:// or rediss://")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds: got {self.ttl_seconds}; expected a positive integer")
        for name in ("socket_timeout", "connect_timeout", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected a positive number")
        for name in ("max_batch", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected at least 1")

    def __repr__(self) -> str:
        shown = {k: getattr(self, k) for k in self.__dataclass_fields__}
        shown["url"] = mask_url(self.url)
        if self.password is not None:
            shown["password"] = "***"
        return "RedisOptions(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


class _Breaker:
    """Skip a server for a growing backoff after each failure."""

    def __init__(self, initial: float, cap: float) -> None:
        self._initial = initial
        self._cap = cap
        self._backoff = initial
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    def failed(self) -> float:
        with self._lock:
            pause = self._backoff
            self._open_until = time.monotonic() + pause
            self._backoff = min(self._cap, self._backoff * 2)
            return pause

    def succeeded(self) -> None:
        if self._backoff != self._initial:
            with self._lock:
                self._backoff = self._initial


_Route = tuple[str, Any, list[int]]  # (server name, client, positions in the batch)
_AddCommands = Callable[[Any, list[int]], None]


class RedisBackend(Backend):
    name = "redis"
    Options = RedisOptions
    medium = Medium.REMOTE
    locality = Locality.CLUSTER
    supports_listing = True

    def __init__(self, options: RedisOptions, context: TierContext) -> None:
        if len(context.namespace_fp) != FP_BYTES:
            raise ValueError("redis tier: the namespace fingerprint must be 16 bytes")
        self.options = options
        self._ns = context.namespace_fp
        self._mac = context.frame_key
        self._max_frame = HEADER_SIZE + context.chunk_bytes if context.chunk_bytes > 0 else None
        self._prefix = f"kvsdk:{context.namespace_fp.hex()}:".encode()
        self._where = mask_url(options.url)
        url = self._url = _effective_url(options)
        parse_url: Any = redis_connection.parse_url  # (untyped upstream)
        parse_url(url)  # a malformed URL fails at start-up
        self._kwargs = _connection_kwargs(options, url)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        """Held while the Cluster client connects (one thread at a time); never
        while holding ``_lock``."""
        self._breakers: dict[str, _Breaker] = {}
        self._burst = BurstLog(log)
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "corrupt", "unverifiable", "oversized", "puts", "put_failures", "deletes",
             "skipped", "outages", "command_errors", "topology_refreshes", "errors"), 0
        )  # fmt: skip
        self._client: redis_py.Redis | None = None
        self._cluster: RedisCluster | None = None
        self._refresh_topology = False
        self._last_refresh = 0.0
        if not options.cluster:
            pool = BlockingConnectionPool.from_url(
                url, retry=Retry(NoBackoff(), 0), timeout=options.connect_timeout, **self._kwargs
            )
            self._client = redis_py.Redis(connection_pool=pool)

    # -- failure handling ------------------------------------------------------------
    def _redact(self, text: str) -> str:
        return _redact(self.options, text)

    def _breaker(self, name: str) -> _Breaker:
        b = self._breakers.get(name)
        if b is None:
            with self._lock:
                b = self._breakers.setdefault(
                    name, _Breaker(self.options.backoff_initial, self.options.backoff_max)
                )
        return b

    def _outage(self, name: str, client: Any, exc: BaseException) -> None:
        pause = self._breaker(name).failed()
        self._count("outages")
        self._count("errors")
        if client is not None:
            with contextlib.suppress(Exception):  # best effort on a broken pool
                client.connection_pool.disconnect()  # stale sockets: reconnect after the pause
        self._burst.warning(
            f"outage:{name}",
            "redis tier %s: %s %s (%s: %s); serving misses, retry in %.1fs",
            self._where, name, _what_failed(exc), type(exc).__name__, self._redact(str(exc)),
            pause,
        )  # fmt: skip

    # -- routing -------------------------------------------------------------------------
    def _cluster_client(self) -> RedisCluster | None:
        if self._cluster is not None:
            return self._cluster
        breaker = self._breaker("cluster")
        if not breaker.allow():
            return None
        failure: BaseException | None = None
        with self._connect_lock:  # (not self._lock: _outage counts under it)
            if self._cluster is None:
                try:
                    self._cluster = RedisCluster.from_url(
                        self._url,
                        require_full_coverage=False,
                        retry=Retry(NoBackoff(), 0),
                        connection_pool_class=BlockingConnectionPool,
                        timeout=self.options.connect_timeout,
                        **self._kwargs,
                    )
                except _OUTAGE as exc:
                    failure = exc
        if failure is not None:
            self._outage("cluster", None, failure)
            return None
        breaker.succeeded()
        return self._cluster

    def _routes(self, rkeys: Sequence[bytes]) -> list[_Route]:
        if self._client is not None:
            return [("server", self._client, list(range(len(rkeys))))]
        rc: Any = self._cluster_client()  # (untyped upstream)
        if rc is None:
            return []
        self._maybe_refresh(rc)
        groups: dict[str, _Route] = {}
        for i, rkey in enumerate(rkeys):
            try:
                node = rc.get_node_from_key(rkey)
            except _OUTAGE:
                continue  # slot not covered right now: a miss
            route = groups.get(node.name)
            if route is None:
                route = groups[node.name] = (node.name, rc.get_redis_connection(node), [])
            route[2].append(i)
        return list(groups.values())

    def _maybe_refresh(self, rc: RedisCluster) -> None:
        now = time.monotonic()
        if not self._refresh_topology or now - self._last_refresh < _TOPOLOGY_REFRESH_S:
            return
        with self._lock:
            if not self._refresh_topology:
                return
            self._refresh_topology = False
            self._last_refresh = now
        self._count("topology_refreshes")
        try:
            rc.nodes_manager.initialize()
        except _OUTAGE as exc:
            self._burst.warning("topology", "redis tier %s: topology refresh failed: %s",
                                self._where, self._redact(str(exc)))  # fmt: skip

    def _execute(
        self, rkeys: Sequence[bytes], add: _AddCommands, per_key: bool, commands_per_key: int = 1
    ) -> list[Any]:
        """Pipelined commands for ``rkeys``, ``max_batch`` keys per round trip.

        Returns one reply per key: the server's answer, an exception for a
        command the server refused, or ``_SKIPPED`` when its server is out.
        ``add(pipe, positions)`` queues the commands; with ``per_key=False`` it
        queues one multi-key command whose reply is a list. With
        ``commands_per_key`` > 1 it queues that many per key, and each key's
        reply is the tuple of their replies (an exception if one failed).
        """
        out: list[Any] = [_SKIPPED] * len(rkeys)
        step = self.options.max_batch
        for name, client, positions in self._routes(rkeys):
            breaker = self._breaker(name)
            for start in range(0, len(positions), step):
                part = positions[start : start + step]
                if not breaker.allow():
                    continue
                try:
                    pipe = client.pipeline(transaction=False)
                    add(pipe, part)
                    replies = pipe.execute(raise_on_error=False)
                except _OUTAGE as exc:
                    self._outage(name, client, exc)
                    continue
                breaker.succeeded()
                if not per_key:
                    replies = replies[0]
                    if isinstance(replies, Exception):
                        replies = [replies] * len(part)
                elif commands_per_key > 1:
                    c = commands_per_key
                    grouped = [tuple(replies[j : j + c]) for j in range(0, len(replies), c)]
                    replies = [next((r for r in g if isinstance(r, Exception)), g) for g in grouped]
                for i, reply in zip(part, replies):
                    if isinstance(reply, _TOPOLOGY):
                        self._refresh_topology = True
                    out[i] = reply
        skipped = sum(1 for r in out if r is _SKIPPED)
        if skipped:
            self._count("skipped", skipped)
        return out

    def _rkey(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    # -- Backend -------------------------------------------------------------------------
    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        rkeys = [self._rkey(k) for k in keys]
        limit = self._max_frame

        def add(pipe: Any, part: list[int]) -> None:
            if limit is not None:
                for i in part:  # at most limit + 1 bytes: more is not one of our frames
                    pipe.exists(rkeys[i])  # (GETRANGE answers b"" for no key and an empty one)
                    pipe.getrange(rkeys[i], 0, limit)
            elif self._client is not None:
                pipe.mget([rkeys[i] for i in part])
            else:
                for i in part:
                    pipe.get(rkeys[i])

        if limit is not None:
            replies = [
                r if not isinstance(r, tuple) else r[1] if r[0] else None
                for r in self._execute(rkeys, add, per_key=True, commands_per_key=2)
            ]
        else:
            replies = self._execute(rkeys, add, per_key=self._client is None)
        out: list[Buffer | None] = []
        bad: list[ChunkKey] = []
        hits = 0
        for key, reply in zip(keys, replies):
            if reply is _SKIPPED or reply is None:
                out.append(None)
                continue
            if isinstance(reply, Exception):
                self._command_error("get", reply)
                out.append(None)
                continue
            if limit is not None and len(reply) > limit:
                self._count("oversized")
                self._burst.warning("oversized", "redis tier: dropping %s: larger than a frame",
                                    self._rkey(key).decode())  # fmt: skip
                bad.append(key)
                out.append(None)
                continue
            try:
                out.append(decode_chunk(reply, namespace_fp=self._ns, key=key, mac_key=self._mac))
                hits += 1
            except UnverifiableChunk as exc:
                self._count("unverifiable")
                self._burst.warning("unverifiable", "redis tier: %s", exc.reason)
                out.append(None)
            except CorruptChunk as exc:
                self._count("corrupt")
                self._burst.warning("corrupt", "redis tier: dropping %s: %s",
                                    self._rkey(key).decode(), exc.reason)  # fmt: skip
                bad.append(key)
                out.append(None)
        self._count("hits", hits)
        self._count("misses", len(keys) - hits)
        if bad:
            self.delete(bad)
        return out

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        rkeys = [self._rkey(k) for k, _ in items]
        ttl = self.options.ttl_seconds
        limit = self._max_frame
        frames = [encode_chunk(self._ns, key, value, mac_key=self._mac) for key, value in items]
        fits = [limit is None or len(f) <= limit for f in frames]  # else a reader drops it

        def add(pipe: Any, part: list[int]) -> None:
            for i in part:
                if fits[i]:
                    pipe.set(rkeys[i], frames[i], ex=ttl)
                else:
                    pipe.exists(rkeys[i])  # (a reply per key; counted as not stored)

        replies = [r if fits[i] else False
                   for i, r in enumerate(self._execute(rkeys, add, per_key=True))]  # fmt: skip
        ok = [r is True for r in replies]
        for r in replies:
            if isinstance(r, Exception):
                self._command_error("set", r)
        self._count("puts", sum(ok))
        self._count("put_failures", len(ok) - sum(ok))
        return ok

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]

        def add(pipe: Any, part: list[int]) -> None:
            for i in part:
                pipe.exists(rkeys[i])

        return [r is not _SKIPPED and not isinstance(r, Exception) and r == 1
                for r in self._execute(rkeys, add, per_key=True)]  # fmt: skip

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        rkeys = [self._rkey(k) for k in keys]

        def add(pipe: Any, part: list[int]) -> None:
            for i in part:
                pipe.unlink(rkeys[i])

        n = sum(r for r in self._execute(rkeys, add, per_key=True) if isinstance(r, int))
        self._count("deletes", n)
        return n

    def _scan_clients(self) -> list[tuple[str, Any]]:
        if self._client is not None:
            return [("server", self._client)]
        rc: Any = self._cluster_client()
        if rc is None:
            raise BackendError(f"redis tier {self._where}: cluster not reachable")
        return [(n.name, rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def _scan(self, name: str, client: Any) -> Iterator[bytes]:
        try:
            yield from client.scan_iter(match=self._prefix + b"*", count=1000)
        except _OUTAGE as exc:
            self._outage(name, client, exc)
            raise BackendError(
                f"redis tier {self._where}: {name} failed during SCAN: {self._redact(str(exc))}"
            ) from None

    def clear(self) -> None:
        """Unlink every key of this namespace (all instances sharing it lose them)."""
        for name, client in self._scan_clients():
            batch: list[bytes] = []
            for rkey in self._scan(name, client):
                batch.append(rkey)
                if len(batch) >= 1000:
                    self._unlink_on(name, client, batch)
                    batch.clear()
            self._unlink_on(name, client, batch)

    def _unlink_on(self, name: str, client: Any, rkeys: list[bytes]) -> None:
        if not rkeys:
            return
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:  # one key per command: a cluster node refuses cross-slot UNLINK
            pipe.unlink(rkey)
        try:
            pipe.execute(raise_on_error=False)
        except _OUTAGE as exc:
            self._outage(name, client, exc)
            raise BackendError(
                f"redis tier {self._where}: {name} failed during clear: {self._redact(str(exc))}"
            ) from None

    def iter_keys(self) -> Iterator[ChunkKey]:
        for name, client in self._scan_clients():
            for rkey in self._scan(name, client):
                try:
                    yield bytes.fromhex(rkey[len(self._prefix) :].decode())
                except ValueError:
                    continue

    def capacity_bytes(self) -> None:
        return None  # Redis evicts by its own policy; kvsdk sees no byte budget

    def corrupt_count(self) -> int:
        with self._lock:
            return self._counters["corrupt"]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counters.items()}
            out["breakers_open"] = float(sum(b.is_open for b in self._breakers.values()))
        return out

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        """Entries and bytes per namespace (a SCAN of ``kvsdk:*``; STRLEN per key).
        Connects as the tier does: TLS and AUTH options honoured in both modes."""
        url = _effective_url(options)
        kwargs = _connection_kwargs(options, url)
        kwargs.pop("max_connections")
        client: Any = (
            RedisCluster.from_url(url, **kwargs)
            if options.cluster
            else redis_py.Redis.from_url(url, **kwargs)
        )
        per_ns: dict[str, list[int]] = {}
        try:
            pipe_keys: list[bytes] = []
            for rkey in client.scan_iter(match=b"kvsdk:*", count=1000):
                pipe_keys.append(rkey)
            for i in range(0, len(pipe_keys), 500):
                batch = pipe_keys[i : i + 500]
                pipe = client.pipeline(transaction=False)
                for rkey in batch:
                    pipe.strlen(rkey)
                for rkey, n in zip(batch, pipe.execute(), strict=True):
                    ns = rkey.split(b":")[1].decode()
                    row = per_ns.setdefault(ns, [0, 0])
                    row[0] += 1
                    row[1] += int(n)
        finally:
            client.close()
        return [
            {"namespace": ns, "entries": e, "bytes": b} for ns, (e, b) in sorted(per_ns.items())
        ]

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        """UNLINK every ``kvsdk:*`` key (or ``kvsdk:<namespace>:*``), one key per
        command (a cluster node refuses cross-slot UNLINK). Connects as
        ``inventory`` does."""
        url = _effective_url(options)
        kwargs = _connection_kwargs(options, url)
        kwargs.pop("max_connections")
        client: Any = (
            RedisCluster.from_url(url, **kwargs)
            if options.cluster
            else redis_py.Redis.from_url(url, **kwargs)
        )
        match = b"kvsdk:" + (namespace.encode() + b":*" if namespace else b"*")
        n = 0
        try:
            batch: list[bytes] = []
            for rkey in [*client.scan_iter(match=match, count=1000), None]:
                if rkey is not None:
                    batch.append(rkey)
                if batch and (rkey is None or len(batch) >= 500):
                    pipe = client.pipeline(transaction=False)
                    for b in batch:
                        pipe.unlink(b)
                    n += sum(int(r) for r in pipe.execute())
                    batch = []
        finally:
            client.close()
        return n

    def error_count(self) -> int:
        """Outages (a server not answering, each one pausing it) and commands
        the server refused."""
        with self._lock:
            return self._counters["errors"]

    def available(self) -> bool:
        """False while a server is skipped for its backoff (a circuit breaker open)."""
        with self._lock:
            return not any(b.is_open for b in self._breakers.values())

    def close(self) -> None:
        try:
            if self._client is not None:
                self._client.close()
                self._client.connection_pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
        except Exception as exc:  # closing a dead connection
            log.debug("redis tier %s: close: %s", self._where, self._redact(str(exc)))

    # -- helpers --------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters[name] += n

    def _command_error(self, op: str, exc: Exception) -> None:
        self._count("command_errors")
        self._count("errors")
        self._burst.warning(f"cmd:{op}", "redis tier %s: %s refused: %s",
                            self._where, op.upper(), self._redact(str(exc)))  # fmt: skip

    def __repr__(self) -> str:
        return f"RedisBackend({self._where!r}, cluster={self.options.cluster})"


def _what_failed(exc: BaseException) -> str:
    """What an outage was, in words: refused credentials and failed TLS
    handshakes are not a server that does not answer."""
    causes: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in causes:  # Cluster errors wrap the node's error
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(c, AuthenticationError) for c in causes):
        return "refused this client's credentials (username, password)"
    text = " ".join(str(c) for c in causes)
    if "SSL" in text or "certificate" in text:
        return "failed the TLS handshake (certificate, tls_ca_file, tls_verify)"
    return "is not answering"


def _effective_url(o: RedisOptions) -> str:
    """The URL to connect to: ``rediss://`` when ``tls`` is set on a ``redis://``
    URL, and without the user or password that ``username`` / ``password``
    override (redis-py lets a URL's credentials win over keyword arguments)."""
    url = o.url
    if o.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or (o.username is None and o.password is None):
        return url
    user, colon, password = userinfo.partition(":")
    user = "" if o.username is not None else user
    password = "" if o.password is not None else password
    userinfo = user + (":" + password if colon and password else "")
    netloc = (userinfo + "@" if userinfo else "") + host
    return parts._replace(netloc=netloc).geturl()


def _connection_kwargs(o: RedisOptions, url: str) -> dict[str, Any]:
    """Timeouts, AUTH and TLS for every connection the tier (or ``inventory``) opens."""
    kw: dict[str, Any] = {
        "socket_timeout": o.socket_timeout,
        "socket_connect_timeout": o.connect_timeout,
        "max_connections": o.max_connections,
    }
    if o.username is not None:
        kw["username"] = o.username
    if o.password is not None:
        kw["password"] = o.password
    if url.startswith("rediss://"):
        kw["ssl_cert_reqs"] = "required" if o.tls_verify else "none"
        kw["ssl_check_hostname"] = o.tls_verify
        for opt, name in (("tls_ca_file", "ssl_ca_certs"), ("tls_cert_file", "ssl_certfile"),
                          ("tls_key_file", "ssl_keyfile")):  # fmt: skip
            if getattr(o, opt) is not None:
                kw[name] = getattr(o, opt)
    return kw


def _redact(o: RedisOptions, text: str) -> str:
    """``text`` without the options' password (option or URL, raw or decoded)."""
    url = urlsplit(o.url)
    return trust.redact(text, (o.password, url.password, unquote(url.password or "")))


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"redis": RedisBackend}
