"""The redis tier seen from outside a running engine: what ``kvsdk inspect``
lists (entries and bytes per namespace) and what ``kvsdk clear --yes``
unlinks. Connects as the tier does: TLS and AUTH options honoured, standalone
or Cluster.

Both act on each batch of keys as the scan finds it (memory bounded by a
batch, whatever the keyspace). A namespace is matched literally: the glob
metacharacters of ``SCAN MATCH`` are escaped, and every key found is compared
with the exact prefix. Keys under ``kvsdk:`` that are not kvsdk's entries
(another type, a name not of the form ``kvsdk:<namespace hex>:<key hex>``)
are skipped and counted (``Inventory.foreign_entries``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import redis as redis_py
from redis.cluster import RedisCluster

from kvsdk.backends.redis_options import connection_kwargs, effective_url

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
    client = _connect(options)
    per_ns: dict[str, list[int]] = {}
    foreign = 0
    try:
        for batch in _batches(client.scan_iter(match=PREFIX + b"*", count=SCAN_COUNT)):
            entries: list[tuple[bytes, str]] = []
            for rkey in batch:
                m = ENTRY.fullmatch(rkey)
                if m is None:
                    foreign += 1
                else:
                    entries.append((rkey, m.group("ns").decode()))
            if not entries:
                continue
            pipe = client.pipeline(transaction=False)
            for rkey, _ns in entries:
                pipe.strlen(rkey)
            for (_rkey, ns), n in zip(entries, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(n, Exception):
                    if not str(n).startswith("WRONGTYPE"):
                        raise n
                    foreign += 1  # a list, a hash...: not one of kvsdk's frames
                    continue
                row = per_ns.setdefault(ns, [0, 0])
                row[0] += 1
                row[1] += int(n)
    finally:
        client.close()
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
    client = _connect(options)
    n = 0
    try:
        found = client.scan_iter(match=_GLOB.sub(rb"\\\1", prefix) + b"*", count=SCAN_COUNT)
        for batch in _batches(rkey for rkey in found if rkey.startswith(prefix)):
            pipe = client.pipeline(transaction=False)
            for rkey in batch:
                pipe.unlink(rkey)
            n += sum(int(r) for r in pipe.execute())
    finally:
        client.close()
    return n


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
    if options.cluster:
        return RedisCluster.from_url(url, **kwargs)
    return redis_py.Redis.from_url(url, **kwargs)
