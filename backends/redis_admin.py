"""The redis tier seen from outside a running engine: what ``kvsdk inspect``
lists (entries and bytes per namespace) and what ``kvsdk clear --yes``
unlinks. Connects as the tier does: TLS and AUTH options honoured, standalone
or Cluster.

Both act on each batch of keys as the scan finds it (memory bounded by a
batch, whatever the keyspace). A namespace is matched literally: the glob
metacharacters of ``SCAN MATCH`` are escaped, and every key found is compared
with the exact prefix. Keys under ``kvsdk:`` that are not kvsdk's entries
(another type, a name not of the form ``kvsdk:<namespace hex>:<key hex>``)
are skipped and counted (``Inventory.foreign_entries``).

Every round trip (the connection, each SCAN page, each batch) has the tier's
deadline as a whole, ``connect_timeout + socket_timeout``: past it the command
gives up with a ``TimeoutError`` naming the server; a reply the client cannot
use is an ``InvalidResponse``, never another exception."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import redis as redis_py
from redis.cluster import RedisCluster
from redis.exceptions import InvalidResponse, RedisError

from kvsdk.backends.disk_reader import DeadlineReader
from kvsdk.backends.redis_options import connection_kwargs, effective_url, mask_url, redact
from kvsdk.backends.redis_routing import seed_nodes, sentinel_master, within

_T = TypeVar("_T")

PREFIX = b"kvsdk:"
ENTRY = re.compile(rb"kvsdk:(?P<ns>[0-9a-f]{32}):(?:[0-9a-f]{2})+")
"""The name of one of kvsdk's entries: its namespace and key in lowercase hex."""
BATCH = 500
"""Keys per pipelined round trip (and the most held in memory at once)."""
SCAN_COUNT = 1000
_GLOB = re.compile(rb"([*?\[\]\\])")


class Inventory(list[dict[str, Any]]):
    """``inventory``'s rows, one per namespace, and the keys it skipped."""

    foreign_entries: int = 0
    """Keys under ``kvsdk:`` that are not kvsdk's entries: another type than a
    string, or a name not of the form ``kvsdk:<namespace hex>:<key hex>``."""


def inventory(options: Any) -> Inventory:
    """Entries and bytes per namespace (a SCAN of ``kvsdk:*``; STRLEN per key)."""
    per_ns: dict[str, list[int]] = {}
    foreign = 0
    with _Session(options) as session:
        for batch in _batches(session.keys(PREFIX + b"*")):
            entries: list[tuple[bytes, str]] = []
            for rkey in batch:
                m = ENTRY.fullmatch(rkey)
                if m is None:
                    foreign += 1
                else:
                    entries.append((rkey, m.group("ns").decode()))
            if not entries:
                continue
            lengths = session.pipeline([("STRLEN", rkey) for rkey, _ns in entries])
            for (_rkey, ns), n in zip(entries, lengths, strict=True):
                if isinstance(n, Exception):
                    if not str(n).startswith("WRONGTYPE"):
                        raise n
                    foreign += 1  # a list, a hash...: not one of kvsdk's frames
                    continue
                row = per_ns.setdefault(ns, [0, 0])
                row[0] += 1
                row[1] += int(n)
    out = Inventory(
        {"namespace": ns, "entries": e, "bytes": b} for ns, (e, b) in sorted(per_ns.items())
    )
    out.foreign_entries = foreign
    return out


def wipe(options: Any, namespace: str | None = None) -> int:
    """UNLINK every ``kvsdk:*`` key (or every ``kvsdk:<namespace>:*`` key, the
    namespace taken literally), one key per command (a cluster node refuses
    cross-slot UNLINK)."""
    prefix = PREFIX if namespace is None else PREFIX + namespace.encode() + b":"
    n = 0
    with _Session(options) as session:
        found = session.keys(_GLOB.sub(rb"\\\1", prefix) + b"*")
        for batch in _batches(rkey for rkey in found if rkey.startswith(prefix)):
            n += sum(int(r) for r in session.pipeline([("UNLINK", rkey) for rkey in batch]))
    return n


class _Session:
    """A client of the tier's server(s) for one command, each round trip on a
    thread of its own within ``connect_timeout + socket_timeout``."""

    def __init__(self, options: Any) -> None:
        self._options = options
        self._seconds = float(options.connect_timeout + options.socket_timeout)
        self._reader = DeadlineReader(1, self._seconds, name="kvsdk-redis-admin")
        self.client: Any = None
        try:
            self.client = self._ask(lambda: _connect(options))
        except BaseException:
            self._reader.close()
            raise

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection
            if self.client is not None:
                self.client.close()
        self._reader.close()

    def _ask(self, fn: Callable[[], _T]) -> _T:
        try:
            box = within(self._reader, fn, self._seconds)
        except RedisError:
            raise
        except Exception as exc:  # a reply the client library could not use
            reason = redact(self._options, f"{type(exc).__name__}: {exc}")
            raise InvalidResponse(
                f"redis tier {mask_url(self._options.url)}: an answer this client cannot use "
                f"({reason})"
            ) from None
        if not box:
            with contextlib.suppress(Exception):  # frees the thread still blocked in it
                if self.client is not None:
                    self.client.close()
            raise TimeoutError(
                f"redis tier {mask_url(self._options.url)}: no complete answer within "
                f"{self._seconds:.1f} s (connect_timeout + socket_timeout)"
            )
        return box[0]

    def keys(self, match: bytes) -> Iterator[bytes]:
        """The keys matching ``match`` on every server (every primary of a
        Cluster), a SCAN page per round trip."""
        client: Any = self.client  # (untyped upstream)
        nodes = (
            [client.get_redis_connection(n) for n in client.get_primaries()]
            if self._options.cluster
            else [client]
        )
        for node in nodes:
            cursor = 0
            while True:

                def page(node: Any = node, cursor: int = cursor) -> tuple[int, list[bytes]]:
                    nxt, found = node.scan(cursor, match=match, count=SCAN_COUNT)
                    return int(nxt), list(found)

                cursor, found = self._ask(page)
                yield from found
                if cursor == 0:
                    break

    def pipeline(self, commands: list[tuple[str, bytes]]) -> list[Any]:
        """The replies to ``commands`` (name, key), pipelined in one round trip;
        a command the server refused is its exception."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name, rkey in commands:
                pipe.execute_command(name, rkey)
            return list(pipe.execute(raise_on_error=False))

        return self._ask(run)


def _batches(keys: Iterable[bytes]) -> Iterator[list[bytes]]:
    """``keys`` in lists of at most :data:`BATCH`, each handed on when full."""
    batch: list[bytes] = []
    for rkey in keys:
        batch.append(rkey)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _connect(options: Any) -> Any:
    """A client (untyped upstream) with the tier's timeouts, AUTH and TLS, and
    redis-py's own connection pool."""
    url = effective_url(options)
    kwargs = connection_kwargs(options, url)
    kwargs.pop("max_connections")
    if options.sentinels:
        return sentinel_master(options, url, kwargs)
    if options.cluster:
        return RedisCluster.from_url(url, startup_nodes=seed_nodes(options), **kwargs)
    return redis_py.Redis.from_url(url, **kwargs)
