"""The redis tier on a Redis Cluster with replicas, as a fleet runs it: a master
is killed (``kill -9``), the cluster promotes its replica, and the tier follows
the failover: the shard's chunks are served again from the promoted replica
within seconds of its promotion, byte-identical, and writes to it land, while
the dead node stays dead. A tier whose configured node is the dead one starts
through its other seed nodes (``urls``)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster
from redis_server import (  # noqa: F401  (fixtures)
    FAST,
    REDIS_CLI,
    REDIS_SERVER,
    RedisClusterNodes,
    cluster_masters,
    key,
    missing_tool,
    payload,
    redis_tools_fixture,
    served,
    start_cluster,
    watch_failover,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"failover", digest_size=16).digest()
N = 96
FOLLOW_WITHIN_S = 10.0
"""The issue's goal: the shard hits again within this long of the promotion."""


def backend(url: str, **options: Any) -> RedisBackend:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=1 << 20)
    return RedisBackend(RedisOptions(url=url, cluster=True, **{**FAST, **options}), ctx)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    """3 masters, each with a replica (6 ``redis-server`` processes)."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing_tool("redis-server / redis-cli not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvsdk-redis-failover-") as tmp:
        nodes = start_cluster(Path(tmp), 6, replicas=1)
        try:
            yield nodes
        finally:
            for node in nodes.nodes:
                node.kill()


def test_a_killed_master_is_followed_to_its_promoted_replica(cluster: RedisClusterNodes) -> None:
    masters = cluster_masters(cluster.nodes[0])
    assert len(masters) == 3 and all(replica for _, replica in masters.values())
    b = backend(cluster.url)
    assert all(b.put([(key(i), payload(i)) for i in range(N)]))
    raw = RedisCluster.from_url(cluster.url)
    try:
        owner = {
            i: raw.get_node_from_key(f"kvsdk:{NS.hex()}:{key(i).hex()}").port for i in range(N)
        }
    finally:
        raw.close()
    victim_port = next(p for p in masters if p != cluster.nodes[0].port)
    replica_port = masters[victim_port][1]
    shard = {i for i in range(N) if owner[i] == victim_port}
    assert 0 < len(shard) < N
    victim, replica = cluster.node_for_port(victim_port), cluster.node_for_port(replica_port)
    assert int(victim.cli("WAIT", "1", "5000")) == 1  # the replica holds every write

    victim.kill()

    def promoted() -> bool:
        return "role:master" in replica.cli("INFO", "replication")

    to_promotion, to_served, log = watch_failover(b, N, promoted, set(range(N)) - shard)
    assert to_served <= FOLLOW_WITHIN_S, log
    print(
        f"failover: promoted {to_promotion:.1f} s after the kill, shard served again "
        f"{to_served:.1f} s after the promotion ({len(shard)} chunks)"
    )
    # writes to the shard land on the promoted replica, the dead node still dead
    fresh = range(N, N + 48)
    assert all(b.put([(key(i), payload(i)) for i in fresh]))
    assert served(b, fresh) == set(fresh)
    assert b.stats()["topology_refreshes"] >= 1
    b.close()


def test_a_tier_whose_configured_node_is_dead_starts_through_its_other_seeds(
    cluster: RedisClusterNodes,
) -> None:
    dead = next(n for n in cluster.nodes if n.proc is None)  # the master killed above
    live = [n for n in cluster.nodes if n.proc is not None]
    alone = backend(dead.url)
    assert alone.put([(key(N + 100), payload(N + 100))]) == [False]  # no seed answers
    alone.close()
    b = backend(dead.url, urls=tuple(f"redis://127.0.0.1:{n.port}" for n in live[:2]))
    assert all(b.put([(key(i), payload(i)) for i in range(200, 260)]))
    assert served(b, range(200, 260)) == set(range(200, 260))
    b.close()


def test_seed_urls_are_checked_when_the_config_is_read() -> None:
    from kvsdk.config import ConfigError, load_config

    def tier(**extra: Any) -> dict[str, Any]:
        return {"tiers": [{"backend": "cpu", "capacity": "1MiB"},
                          {"backend": "redis", "url": "redis://127.0.0.1:7000", **extra}]}  # fmt: skip

    load_config(tier(cluster=True, urls=["redis://127.0.0.1:7001"]))
    with pytest.raises(ConfigError, match=r"urls: set without cluster: true"):
        load_config(tier(urls=["redis://127.0.0.1:7001"]))
    with pytest.raises(ConfigError, match=r"urls\[0\]: a seed node carries no credentials"):
        load_config(tier(cluster=True, urls=["redis://:pw@127.0.0.1:7001"]))
    with pytest.raises(ConfigError, match=r"urls\[1\]: got scheme rediss://"):
        load_config(tier(cluster=True, urls=["redis://h:1", "rediss://h:2"]))
