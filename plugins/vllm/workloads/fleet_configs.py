"""The configurations ``kvsdk bench fleet`` runs: a table, not code per row.

A configuration is a kvsdk tier below the host tier (or no connector) and a
router policy. Tiers (:data:`TIERS`) and policies (:data:`POLICIES`) are
tables of their own: a new shared tier is one :class:`TierSpec` (how to
start what it needs once, how to empty it before a run, the kvsdk tier entry
the engines get, and what to do to it while the workload runs: the
``redis_cluster_failover`` tier kills a master part-way through), a new
policy one :class:`PolicySpec` (the router's
``--policy``, the router arguments it needs from the engines and the engines'
own extra arguments: the ``kv_aware`` policy gives each engine
``--kv-events-config`` publishing on ``tcp://*:{events_port}`` and the
router ``--kv-event-source URL=tcp://127.0.0.1:{events_port}`` per engine,
so the router indexes vLLM's own blocks and, with kvsdk, kvsdk's tiers).
Any ``TIER-POLICY`` name of the two tables is a configuration (``none`` for
no connector); :data:`DEFAULT_CONFIGS` are the issue's five.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvsdk.plugins.vllm.workloads.fleet_mooncake import MooncakeStore, start_mooncake
from kvsdk.plugins.vllm.workloads.fleet_procs import Procs, start_redis
from kvsdk.plugins.vllm.workloads.fleet_redis_cluster import (
    MasterKill,
    Probe,
    RedisClusterFleet,
    start_redis_cluster,
)

DEFAULT_CONFIGS = (
    "none-rr",
    "none-cache_aware",
    "kvsdk-redis-rr",
    "kvsdk-redis-cache_aware",
    "kvsdk-disk-rr",
)
BASELINES = ("none-rr", "none-cache_aware")


@dataclass
class Shared:
    """What every run of a bench shares: long-lived servers (the Redis tier's),
    a work directory, the bench's settings for the tiers."""

    workdir: Path
    procs: Procs
    redis_maxmemory: str = "6gb"
    redis_policy: str = "allkeys-lru"
    mooncake_segment_bytes: int = 6 << 30
    """The Mooncake holder's memory (touched only as objects are written)."""
    state: dict[str, Any] = field(default_factory=dict)


class RunWatch(Protocol):
    """What a tier does while a run's workload goes on (see :meth:`TierSpec.watch`)."""

    def request_done(self, finished: int, total: int) -> None:
        """``finished`` of the run's ``total`` requests are done (called in the
        workload's event loop: must return at once)."""

    def result(
        self, t0: float, wall_s: float, start: list[dict[str, float]], end: list[dict[str, float]]
    ) -> dict[str, Any]:
        """What happened, for the run's JSON: times since ``t0`` (``time.perf_counter``
        when the workload started), ``start``/``end`` every engine's metrics then."""
        ...


class TierSpec:
    """One kvsdk tier below the host tier, shared by both engines."""

    name = ""
    record_key = ""
    """Where a :meth:`watch`'s result goes in the run's JSON."""

    def open(self, shared: Shared) -> None:
        """Start what the tier needs, once per bench (before its first run)."""

    def reset(self, shared: Shared) -> None:
        """Empty the tier before a run (each configuration starts cold)."""

    def tier(self, shared: Shared) -> dict[str, Any] | None:
        """The tier's entry in kvsdk's ``tiers`` list (None: the host tier alone)."""
        raise NotImplementedError

    def watch(self, shared: Shared, probe: Probe) -> RunWatch | None:
        """Something to do while the workload runs (None: nothing); ``probe``
        reads every engine's metrics."""
        return None


class HostOnly(TierSpec):
    """No shared tier: each engine's host tier alone (what kvsdk costs an engine
    before any write-through)."""

    name = "host"

    def tier(self, shared: Shared) -> dict[str, Any] | None:
        return None


class RedisTier(TierSpec):
    """One loopback ``redis-server`` (``maxmemory``, ``allkeys-lru``), flushed per run."""

    name = "redis"

    def open(self, shared: Shared) -> None:
        if "redis_port" not in shared.state:
            proc, port = start_redis(shared.workdir, shared.redis_maxmemory, shared.redis_policy)
            shared.procs.add(proc)
            shared.state["redis_port"] = port

    def reset(self, shared: Shared) -> None:
        import redis

        client = redis.Redis(port=shared.state["redis_port"])
        try:
            client.flushall()
        finally:
            client.close()

    def tier(self, shared: Shared) -> dict[str, Any]:
        return {"backend": "redis", "url": f"redis://127.0.0.1:{shared.state['redis_port']}/0"}


class DiskTier(TierSpec):
    """One directory both engines use, emptied per run."""

    name = "disk"

    def path(self, shared: Shared) -> Path:
        return shared.workdir / "kvsdk-disk"

    def reset(self, shared: Shared) -> None:
        shutil.rmtree(self.path(shared), ignore_errors=True)
        self.path(shared).mkdir(parents=True)

    def tier(self, shared: Shared) -> dict[str, Any]:
        return {"backend": "disk", "path": str(self.path(shared))}


class MooncakeTier(TierSpec):
    """A Mooncake Store on loopback: ``mooncake_master`` and one ``mooncake_client``
    holder contributing ``Shared.mooncake_segment_bytes``; each engine's tier is a
    client contributing nothing. A master keeps its index in memory and a read
    holds a lease that refuses removal for ~10 s, so the store is emptied by
    starting master and holder afresh for each run."""

    name = "mooncake"

    def reset(self, shared: Shared) -> None:
        old = shared.state.pop("mooncake", None)
        if old is not None:
            shared.procs.stop(old)
        store = start_mooncake(shared.workdir, shared.mooncake_segment_bytes)
        shared.state["mooncake"] = shared.procs.add(store)

    def tier(self, shared: Shared) -> dict[str, Any]:
        store: MooncakeStore = shared.state["mooncake"]
        return {"backend": "mooncake", "master": store.address}


class RedisClusterTier(TierSpec):
    """A Redis Cluster on loopback: three masters and a replica each,
    ``cluster-require-full-coverage no``, ``Shared.redis_maxmemory`` split over
    the masters (LRU). Each engine's tier names every master as a seed node.
    Started afresh for each run (a run may have killed a master)."""

    name = "redis_cluster"

    def reset(self, shared: Shared) -> None:
        from kvsdk.config import parse_size

        old = shared.state.pop("redis_cluster", None)
        if old is not None:
            shared.procs.stop(old)
        workdir = shared.workdir / f"redis-cluster-{shared.state.get('clusters', 0)}"
        shared.state["clusters"] = shared.state.get("clusters", 0) + 1
        memory = parse_size(shared.redis_maxmemory, "redis_maxmemory")
        cluster = start_redis_cluster(workdir, memory, shared.redis_policy)
        shared.state["redis_cluster"] = shared.procs.add(cluster)

    def tier(self, shared: Shared) -> dict[str, Any]:
        cluster: RedisClusterFleet = shared.state["redis_cluster"]
        seeds = [f"redis://127.0.0.1:{port}" for port in sorted(cluster.masters())]
        return {"backend": "redis", "cluster": True, "url": f"{seeds[0]}/0", "urls": seeds[1:]}


class RedisClusterFailover(RedisClusterTier):
    """:class:`RedisClusterTier`, and one master ``kill -9``-ed once ``kill_after``
    of each run's requests have finished (see ``fleet_redis_cluster.MasterKill``)."""

    name = "redis_cluster_failover"
    record_key = "failover"
    kill_after = 0.4

    def watch(self, shared: Shared, probe: Probe) -> RunWatch:
        return MasterKill(shared.state["redis_cluster"], self.kill_after, probe)


TIERS: dict[str, TierSpec] = {
    t.name: t
    for t in (
        RedisTier(),
        DiskTier(),
        HostOnly(),
        MooncakeTier(),
        RedisClusterTier(),
        RedisClusterFailover(),
    )
}
"""kvsdk tiers below the host tier, by name (``kvsdk-NAME-POLICY``)."""


@dataclass(frozen=True)
class EngineInfo:
    """What a policy may need from an engine: its index, URL, and a free port
    reserved for it (e.g. the ZMQ endpoint of vLLM's KV events, which a
    ``kv_aware`` router subscribes to)."""

    index: int
    url: str
    events_port: int
    model: str = ""
    """The model the engine serves (as requests name it)."""


VLLM_CPU_BLOCK_SIZE = 128
"""vLLM-CPU's block size for the bench's Llama: the token blocks a KV-aware router hashes."""


def kv_events_args(info: EngineInfo) -> list[str]:
    """vLLM's KV events (its own blocks', and kvsdk's tiers') on the engine's port."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{info.events_port}",
    }
    return ["--kv-events-config", json.dumps(config)]


def kv_event_sources(engines: list[EngineInfo]) -> list[str]:
    """The ``kv_aware`` router's subscriptions: every engine's events, vLLM-CPU's block size."""
    args = []
    for e in engines:
        args += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{e.events_port}"]
    args += ["--kv-event-block-size", str(VLLM_CPU_BLOCK_SIZE)]
    if engines and engines[0].model:
        args += ["--kv-event-model", engines[0].model]
    return args


def _none(_: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class PolicySpec:
    """A router policy: ``--policy VALUE``, the router's extra arguments built
    from the engines, and each engine's extra ``vllm serve`` arguments."""

    value: str
    router_args: Callable[[list[EngineInfo]], list[str]] = _none
    engine_args: Callable[[EngineInfo], list[str]] = _none


POLICIES: dict[str, PolicySpec] = {
    "rr": PolicySpec("round_robin"),
    "cache_aware": PolicySpec("cache_aware"),
    "kv_aware": PolicySpec("kv_aware", kv_event_sources, kv_events_args),
}
"""Router policies, by the short name configurations use."""


@dataclass(frozen=True)
class FleetConfig:
    name: str
    tier: TierSpec | None  # None: no connector
    policy: PolicySpec

    def kv_transfer(
        self, shared: Shared, host_bytes: int, metrics_port: int
    ) -> dict[str, Any] | None:
        """vLLM's ``--kv-transfer-config`` (None: no connector): kvsdk's defaults
        but a host tier of ``host_bytes`` and this tier below it; its exporter
        on ``metrics_port`` (the lookup-wait histogram is served there only)."""
        if self.tier is None:
            return None
        below = self.tier.tier(shared)
        config = {
            "tiers": [{"backend": "cpu", "capacity": host_bytes}, *([below] if below else [])],
            "metrics": {"prometheus_port": metrics_port},
        }
        return {
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": config},
        }


def parse_config(name: str) -> FleetConfig:
    """``none-POLICY`` or ``kvsdk-TIER-POLICY``; names the choices when wrong."""
    choices = [f"none-{p}" for p in POLICIES] + [f"kvsdk-{t}-{p}" for t in TIERS for p in POLICIES]
    for policy_name, policy in POLICIES.items():
        if name == f"none-{policy_name}":
            return FleetConfig(name, None, policy)
        for tier_name, tier in TIERS.items():
            if name == f"kvsdk-{tier_name}-{policy_name}":
                return FleetConfig(name, tier, policy)
    raise ValueError(f"unknown fleet config {name!r}; expected one of {', '.join(choices)}")


def parse_configs(text: str) -> list[FleetConfig]:
    """A comma-separated list; ``none-rr`` (the baseline) is run first, added if absent."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    names = ["none-rr", *(n for n in names if n != "none-rr")]
    return [parse_config(n) for n in dict.fromkeys(names)]
