"""The redis tier seen from outside a running engine: what ``kvsdk inspect``
lists (entries and bytes per namespace) and what ``kvsdk clear --yes``
unlinks. Connects as the tier does: TLS and AUTH options honoured, standalone
or Cluster."""

from __future__ import annotations

from typing import Any

import redis as redis_py
from redis.cluster import RedisCluster

from kvsdk.backends.redis_options import connection_kwargs, effective_url


def inventory(options: Any) -> list[dict[str, Any]]:
    """Entries and bytes per namespace (a SCAN of ``kvsdk:*``; STRLEN per key)."""
    client = _connect(options)
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
    return [{"namespace": ns, "entries": e, "bytes": b} for ns, (e, b) in sorted(per_ns.items())]


def wipe(options: Any, namespace: str | None = None) -> int:
    """UNLINK every ``kvsdk:*`` key (or ``kvsdk:<namespace>:*``), one key per
    command (a cluster node refuses cross-slot UNLINK)."""
    client = _connect(options)
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


def _connect(options: Any) -> Any:
    """A client (untyped upstream) with the tier's timeouts, AUTH and TLS, and
    redis-py's own connection pool."""
    url = effective_url(options)
    kwargs = connection_kwargs(options, url)
    kwargs.pop("max_connections")
    if options.cluster:
        return RedisCluster.from_url(url, **kwargs)
    return redis_py.Redis.from_url(url, **kwargs)
