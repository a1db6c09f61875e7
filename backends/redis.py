"""``redis``: chunks in Redis or Valkey, standalone or Cluster, shared by every instance.

Needs the ``[redis]`` extra (the ``redis`` client). Keys are
``kvsdk:<namespace_hex>:<key_hex>``, so two models or two tenants never see
each other's entries; each value is a :mod:`kvsdk.chunk_format` frame.

Contract with the tiered store (bytes in, bytes out; framing is ours):

- ``put([(key, payload)])`` frames the raw payload and ``SET``s it (``EX`` when
  ``ttl_seconds`` is set), pipelined ``max_batch`` keys per round trip, the
  frame's header and the payload sent as they are (no copy; ``put_parts``
  likewise with a payload in parts). Returns per item whether the server
  acknowledged it.
- ``may_contain(keys)`` answers from a local index of the namespace's keys
  (:mod:`kvsdk.backends.redis_index`; ``local_index``), kept current across
  processes: False where the server surely lacks a key.
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
connection, a timeout, a restarting server or a reply the client cannot use
gives misses (``None`` / ``False``), and opens a circuit breaker: the server
is skipped for a backoff period (``backoff_initial`` doubling up to
``backoff_max``), then tried again; the first success closes it. Each round
trip has a deadline as a whole, ``connect_timeout + socket_timeout`` plus
its bytes at 8 MiB/s, which is also its socket timeout (a busy server's late
reply is no failure; a server dripping its reply a byte at a time holds no
thread longer): past it, the round trip is such a failure (``timeouts``). A
broken connection is retried once; writes yield to reads and a write past
its deadline stalls writes only (:mod:`kvsdk.backends.redis_routing`).
In Cluster mode each node has its own breaker, so a dead node costs misses
for its slots only. (Run the cluster with
``cluster-require-full-coverage no`` so the other nodes keep serving.)

Nothing queues: every call is synchronous and bounded by its batch, and the
connection pool is bounded (``max_connections``; callers wait for a free
connection up to ``connect_timeout``). Thread-safe: the tiered store calls it
from several I/O threads.

The password (option or URL) never appears in ``repr``, logs or error text.

This module holds the tier's operations; beside it: the options and connection
settings (:mod:`kvsdk.backends.redis_options`), the routing and pipelines
(:mod:`kvsdk.backends.redis_routing`), the breakers and counters
(:mod:`kvsdk.backends.redis_health`), and ``inventory``/``wipe``
(:mod:`kvsdk.backends.redis_admin`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from redis.exceptions import InvalidResponse

from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.backends import redis_admin
from kvsdk.backends.redis_health import Health
from kvsdk.backends.redis_index import RedisIndex
from kvsdk.backends.redis_options import RedisOptions, mask_url
from kvsdk.backends.redis_routing import (
    PAUSED,
    REFUSALS,
    SKIPPED,
    RoundTripFailed,
    Router,
    bulk,
)
from kvsdk.chunk_format import (
    FP_BYTES,
    HEADER_SIZE,
    CorruptChunk,
    UnverifiableChunk,
    as_payload,
    decode_chunk,
    encode_header,
)
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

__all__ = ["RedisBackend", "RedisOptions", "kvsdk_backends", "mask_url"]

log = logging.getLogger(__name__)


class RedisBackend(Backend):
    name = "redis"
    Options = RedisOptions
    medium = Medium.REMOTE
    locality = Locality.CLUSTER
    supports_listing = True
    supports_local_index = True
    """With ``local_index`` (the default); without it ``may_contain`` says True."""

    def __init__(self, options: RedisOptions, context: TierContext) -> None:
        if len(context.namespace_fp) != FP_BYTES:
            raise ValueError("redis tier: the namespace fingerprint must be 16 bytes")
        self.options = options
        self._ns = context.namespace_fp
        self._mac = context.frame_key
        self._max_frame = HEADER_SIZE + context.chunk_bytes if context.chunk_bytes > 0 else None
        self._prefix = f"kvsdk:{context.namespace_fp.hex()}:".encode()
        self._health = Health(options, log)
        self._where = self._health.where
        self._router = Router(options, self._health)
        self._index = RedisIndex(options, self._prefix) if options.local_index else None

    def may_contain(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """From the local index (:mod:`kvsdk.backends.redis_index`): False where
        the tier surely lacks the key; True for every key until the index is
        seeded (or with ``local_index: false``)."""
        if self._index is None:
            return [True] * len(keys)
        return self._index.may_contain(keys)

    def _rkey(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    # -- Backend -------------------------------------------------------------------------
    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        rkeys = [self._rkey(k) for k in keys]
        limit = self._max_frame
        standalone = self._router.client is not None
        refresh = self.options.ttl_seconds if self.options.ttl_refresh_on_hit else None

        def add(pipe: Any, part: list[int]) -> None:
            if limit is not None:
                for i in part:  # at most limit + 1 bytes: more is not one of our frames
                    pipe.exists(rkeys[i])  # (GETRANGE answers b"" for no key and an empty one)
                    pipe.getrange(rkeys[i], 0, limit)
                    if refresh is not None:  # a hit's entry lives another ttl_seconds
                        pipe.expire(rkeys[i], refresh)
            elif standalone:
                pipe.mget([rkeys[i] for i in part])
            else:
                for i in part:
                    pipe.get(rkeys[i])

        if limit is not None:
            pairs = self._router.execute(rkeys, add, per_key=True,
                                         commands_per_key=2 if refresh is None else 3,
                                         valid=_exists_and_range, key_bytes=lambda _i: limit + 1)  # fmt: skip
            replies = [r if not isinstance(r, tuple) else r[1] if r[0] else None for r in pairs]
        else:
            replies = self._router.execute(rkeys, add, per_key=not standalone, valid=_value)
        out: list[Buffer | None] = []
        bad: list[ChunkKey] = []
        absent: list[ChunkKey] = []
        hits = 0
        for key, reply in zip(keys, replies):
            if reply is SKIPPED or reply is None:
                if reply is None:
                    absent.append(key)  # the server answered: not there (evicted, expired)
                out.append(None)
                continue
            if isinstance(reply, Exception):
                self._health.command_error("get", reply)
                out.append(None)
                continue
            if limit is not None and len(reply) > limit:
                self._health.count("oversized")
                self._health.burst.warning(
                    "oversized",
                    "redis tier: dropping %s: larger than a frame",
                    self._rkey(key).decode(),
                )
                bad.append(key)
                out.append(None)
                continue
            try:
                out.append(decode_chunk(reply, namespace_fp=self._ns, key=key, mac_key=self._mac))
                hits += 1
            except UnverifiableChunk as exc:
                self._health.count("unverifiable")
                self._health.burst.warning("unverifiable", "redis tier: %s", exc.reason)
                out.append(None)
            except CorruptChunk as exc:
                self._health.count("corrupt")
                self._health.burst.warning(
                    "corrupt", "redis tier: dropping %s: %s", self._rkey(key).decode(), exc.reason
                )
                bad.append(key)
                out.append(None)
        self._health.count("hits", hits)
        self._health.count("misses", len(keys) - hits)
        if self._index is not None:
            if absent:
                self._index.gone(absent)
            if hits:
                self._index.seen([k for k, v in zip(keys, out) if v is not None])
        if bad:
            self.delete(bad)
        return out

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._put([(key, [flat], dtype, shape)
                          for key, (flat, dtype, shape) in ((k, as_payload(v)) for k, v in items)])  # fmt: skip

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        """Like ``put``, each payload in parts: sent as they are (no join)."""
        flat = [(key, [p.cast("B") for p in parts]) for key, parts in items]
        return self._put([(key, parts, "|u1", (sum(p.nbytes for p in parts),))
                          for key, parts in flat])  # fmt: skip

    def _put(
        self, items: Sequence[tuple[ChunkKey, list[memoryview], str, tuple[int, ...]]]
    ) -> list[bool]:
        """Each frame sent as its header and the payload's parts, without a copy
        (a ``SET`` in the protocol, built here: redis-py would join them)."""
        rkeys = [self._rkey(k) for k, *_ in items]
        ttl = self.options.ttl_seconds
        limit = self._max_frame
        headers = [encode_header(self._ns, key, parts, dtype, shape, mac_key=self._mac)
                   for key, parts, dtype, shape in items]  # fmt: skip
        sizes = [len(h) + sum(p.nbytes for p in it[1]) for h, it in zip(headers, items)]
        fits = [limit is None or n <= limit for n in sizes]  # else a reader drops it
        expire = b"" if ttl is None else bulk(b"EX") + bulk(str(ttl).encode())
        head = b"*3\r\n$3\r\nSET\r\n" if ttl is None else b"*5\r\n$3\r\nSET\r\n"

        def packed(part: list[int]) -> tuple[list[Any], int]:
            out: list[Any] = []
            pending = b""  # small pieces sent together
            for i in part:
                if not fits[i]:  # (a reply per key; counted as not stored)
                    pending += b"*2\r\n$6\r\nEXISTS\r\n" + bulk(rkeys[i])
                    continue
                pending += head + bulk(rkeys[i]) + b"$%d\r\n" % sizes[i] + headers[i]
                for p in items[i][1]:
                    if p.nbytes < SMALL_PART:
                        pending += p
                    else:
                        out += [pending, p]
                        pending = b""
                pending += b"\r\n" + expire
            return [*out, pending], len(part)

        replies = self._router.execute(
            rkeys,
            _no_commands,
            per_key=True,
            key_bytes=lambda i: sizes[i] if fits[i] else 0,
            writes=True,
            packed=packed,
        )
        replies = [r if fits[i] else False for i, r in enumerate(replies)]
        ok = [r == b"OK" for r in replies]
        refused = 0
        for i, r in enumerate(replies):
            if r is PAUSED or isinstance(r, REFUSALS):
                refused += sizes[i]
            if isinstance(r, Exception):
                self._health.command_error("set", r)
        self._health.count("refused_bytes", refused)
        self._health.count("puts", sum(ok))
        self._health.count("put_failures", len(ok) - sum(ok))
        if self._index is not None and any(ok):
            self._index.stored([it[0] for it, stored in zip(items, ok) if stored])
        return ok

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]

        def add(pipe: Any, part: list[int]) -> None:
            for i in part:
                pipe.exists(rkeys[i])

        replies = self._router.execute(rkeys, add, per_key=True)
        found = [r is not SKIPPED and not isinstance(r, Exception) and r == 1 for r in replies]
        if self._index is not None:
            self._index.gone([k for k, r in zip(keys, replies) if r is not SKIPPED and r == 0])
            self._index.seen([k for k, f in zip(keys, found) if f])
        return found

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        rkeys = [self._rkey(k) for k in keys]

        def add(pipe: Any, part: list[int]) -> None:
            for i in part:
                pipe.unlink(rkeys[i])

        replies = self._router.execute(rkeys, add, per_key=True)
        n = sum(r for r in replies if isinstance(r, int))
        self._health.count("deletes", n)
        if self._index is not None:  # (gone from the server, deleted here or before)
            self._index.deleted([k for k, r in zip(keys, replies) if isinstance(r, int)])
        return n

    def _scan(self, name: str, client: Any) -> Iterator[bytes]:
        """This namespace's keys on server ``name``, a SCAN page per round trip."""
        cursor = 0
        while True:

            def page(cursor: int = cursor) -> tuple[int, list[bytes]]:
                nxt, found = client.scan(cursor, match=self._prefix + b"*", count=1000)
                if not isinstance(nxt, int) or not isinstance(found, list):
                    raise InvalidResponse("SCAN answered with another shape than a page")
                return nxt, [k for k in found if isinstance(k, bytes)]

            try:
                cursor, found = self._router.call(name, client, page)
            except RoundTripFailed as exc:
                raise BackendError(
                    f"redis tier {self._where}: {name} failed during SCAN: {exc.reason}"
                ) from None
            yield from found
            if cursor == 0:
                return

    def clear(self) -> None:
        """Unlink every key of this namespace (all instances sharing it lose them)."""
        for name, client in self._router.scan_clients():
            batch: list[bytes] = []
            for rkey in self._scan(name, client):
                batch.append(rkey)
                if len(batch) >= 1000:
                    self._unlink_on(name, client, batch)
                    batch = []
            self._unlink_on(name, client, batch)
        if self._index is not None:
            self._index.cleared()

    def _unlink_on(self, name: str, client: Any, rkeys: list[bytes]) -> None:
        if not rkeys:
            return

        def unlink() -> None:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:  # one key per command: a cluster node refuses cross-slot UNLINK
                pipe.unlink(rkey)
            pipe.execute(raise_on_error=False)

        try:
            self._router.call(name, client, unlink)
        except RoundTripFailed as exc:
            raise BackendError(
                f"redis tier {self._where}: {name} failed during clear: {exc.reason}"
            ) from None

    def iter_keys(self) -> Iterator[ChunkKey]:
        for name, client in self._router.scan_clients():
            for rkey in self._scan(name, client):
                try:
                    yield bytes.fromhex(rkey[len(self._prefix) :].decode())
                except ValueError:
                    continue

    def capacity_bytes(self) -> None:
        return None  # Redis evicts by its own policy; kvsdk sees no byte budget

    def corrupt_count(self) -> int:
        return self._health.counter("corrupt")

    def stats(self) -> dict[str, float]:
        out = self._health.stats()
        if self._index is not None:
            out.update(self._index.stats())
        return out

    @classmethod
    def inventory(cls, options: Any) -> redis_admin.Inventory:
        """Entries and bytes per namespace (a SCAN of ``kvsdk:*``; STRLEN per key,
        a batch at a time); keys under ``kvsdk:`` that are not kvsdk's entries
        are skipped and counted (``foreign_entries``). Connects as the tier
        does: TLS and AUTH options honoured in both modes."""
        return redis_admin.inventory(options)

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        """UNLINK every ``kvsdk:*`` key (or ``kvsdk:<namespace>:*``, the namespace
        matched literally), one key per command (a cluster node refuses
        cross-slot UNLINK), a batch at a time. Connects as ``inventory`` does."""
        return redis_admin.wipe(options, namespace)

    def error_count(self) -> int:
        """Outages (a server not answering, each one pausing it) and commands
        the server refused."""
        return self._health.counter("errors")

    def available(self) -> bool:
        """False while a server is skipped for its backoff (a circuit breaker open)."""
        return self._health.available()

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
        try:
            self._router.close()
        except Exception as exc:  # closing a dead connection
            log.debug("redis tier %s: close: %s", self._where, self._health.redact(str(exc)))

    def __repr__(self) -> str:
        return f"RedisBackend({self._where!r}, cluster={self.options.cluster})"


SMALL_PART = 64 << 10
"""Payload parts smaller than this are copied into the round trip's other bytes
(one send); larger ones are sent as they are."""


def _no_commands(_pipe: Any, _part: list[int]) -> None:
    """(``put`` sends its commands packed: see ``Router.execute``.)"""


def _exists_and_range(reply: Any) -> bool:
    """An ``EXISTS`` and ``GETRANGE`` pair of replies (and an ``EXPIRE``'s, when
    hits refresh their TTL), as a server gives them."""
    return (
        isinstance(reply, tuple)
        and isinstance(reply[0], int)
        and isinstance(reply[1], bytes)
        and all(isinstance(r, int) for r in reply[2:])
    )


def _value(reply: Any) -> bool:
    """A ``GET`` reply (or one value of ``MGET``)."""
    return reply is None or isinstance(reply, bytes)


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"redis": RedisBackend}
