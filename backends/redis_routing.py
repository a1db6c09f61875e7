"""Where the redis tier's commands go and how: the standalone client, or the
Cluster client with keys grouped by the node that owns their slot (the slot
map refreshed after a MOVED, ASK or TRYAGAIN reply), and pipelines of
``max_batch`` keys per round trip behind each server's breaker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis as redis_py
from redis import connection as redis_connection
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import AskError, ClusterDownError, TryAgainError
from redis.retry import Retry

from kvsdk.backend import BackendError
from kvsdk.backends.redis_health import OUTAGE, Health
from kvsdk.backends.redis_options import RedisOptions, connection_kwargs, effective_url

SKIPPED = object()
"""The reply of a key whose server was skipped (breaker open, slot uncovered)."""
TOPOLOGY = (AskError, ClusterDownError, TryAgainError)  # AskError covers MovedError
"""Replies that mean the slot map is stale: refresh it."""
TOPOLOGY_REFRESH_S = 1.0
"""Seconds at least between two slot map refreshes."""

Route = tuple[str, Any, list[int]]  # (server name, client, positions in the batch)
AddCommands = Callable[[Any, list[int]], None]


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
        if not options.cluster:
            pool = BlockingConnectionPool.from_url(
                url, retry=Retry(NoBackoff(), 0), timeout=options.connect_timeout, **self._kwargs
            )
            self.client = redis_py.Redis(connection_pool=pool)

    def cluster_client(self) -> RedisCluster | None:
        """The Cluster client, connecting it on first use; None while the
        cluster's breaker is open or the connection failed."""
        if self.cluster is not None:
            return self.cluster
        breaker = self._health.breaker("cluster")
        if not breaker.allow():
            return None
        failure: BaseException | None = None
        with self._connect_lock:  # (the outage is reported after releasing it)
            if self.cluster is None:
                try:
                    self.cluster = RedisCluster.from_url(
                        self._url,
                        require_full_coverage=False,
                        retry=Retry(NoBackoff(), 0),
                        connection_pool_class=BlockingConnectionPool,
                        timeout=self._options.connect_timeout,
                        **self._kwargs,
                    )
                except OUTAGE as exc:
                    failure = exc
        if failure is not None:
            self._health.outage("cluster", None, failure)
            return None
        breaker.succeeded()
        return self.cluster

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
            rc.nodes_manager.initialize()
        except OUTAGE as exc:
            reason = self._health.redact(str(exc))
            self._health.burst.warning(
                "topology", "redis tier %s: topology refresh failed: %s", self._health.where, reason
            )

    def execute(
        self, rkeys: Sequence[bytes], add: AddCommands, per_key: bool, commands_per_key: int = 1
    ) -> list[Any]:
        """Pipelined commands for ``rkeys``, ``max_batch`` keys per round trip.

        Returns one reply per key: the server's answer, an exception for a
        command the server refused, or ``SKIPPED`` when its server is out.
        ``add(pipe, positions)`` queues the commands; with ``per_key=False`` it
        queues one multi-key command whose reply is a list. With
        ``commands_per_key`` > 1 it queues that many per key, and each key's
        reply is the tuple of their replies (an exception if one failed).
        """
        out: list[Any] = [SKIPPED] * len(rkeys)
        step = self._options.max_batch
        for name, client, positions in self.routes(rkeys):
            breaker = self._health.breaker(name)
            for start in range(0, len(positions), step):
                part = positions[start : start + step]
                if not breaker.allow():
                    continue
                try:
                    pipe = client.pipeline(transaction=False)
                    add(pipe, part)
                    replies = pipe.execute(raise_on_error=False)
                except OUTAGE as exc:
                    self._health.outage(name, client, exc)
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
                    if isinstance(reply, TOPOLOGY):
                        self._refresh_topology = True
                    out[i] = reply
        skipped = sum(1 for r in out if r is SKIPPED)
        if skipped:
            self._health.count("skipped", skipped)
        return out

    def scan_clients(self) -> list[tuple[str, Any]]:
        """A client per server that holds keys (every primary in Cluster mode)."""
        if self.client is not None:
            return [("server", self.client)]
        rc: Any = self.cluster_client()
        if rc is None:
            raise BackendError(f"redis tier {self._health.where}: cluster not reachable")
        return [(n.name, rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client.connection_pool.disconnect()
        if self.cluster is not None:
            self.cluster.close()
