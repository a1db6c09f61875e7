"""A Redis Cluster on loopback for ``kvsdk bench fleet``, and a master killed
under load.

:func:`start_redis_cluster` starts three masters and a replica each (six
``redis-server`` processes, persistence off, ``cluster-require-full-coverage
no`` so the other shards keep serving while one fails over, ``maxmemory``
split over the masters, LRU, replicas that always fail over), joins them with ``redis-cli --cluster create``
and returns once every node sees a healthy cluster of six and every replica
has synced (a replica that never synced is not promoted).

:class:`MasterKill` is the failover: once a share of a run's requests has
finished it ``kill -9``s one master at once (the next requests are sent after
it), then, on a thread of its own, reads every engine's metrics, asks the
master's replica for its role until it says ``master`` and reads the metrics
again. :meth:`MasterKill.result` gives the
times on the workload's clock and the engines' figures over each stretch
(before the kill, kill to promotion, after the promotion).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_metrics import delta, engine_figures
from kvsdk.plugins.vllm.workloads.fleet_procs import Proc, free_port, start_redis

NODE_TIMEOUT_MS = 2000
"""``cluster-node-timeout``: a master silent this long is failed over (~3-5 s here)."""
REPLICA_ARGS = [
    "--cluster-replica-validity-factor", "0",
    "--client-output-buffer-limit", "replica 0 0 0",
]  # fmt: skip
"""A replica fails over however long its link was down, and a master never drops a
replica that fell behind on 4 MiB writes (a busy machine): either would leave the
shard without a promotion. A key names its tokens and model, so a replica that lags
holds that key's KV or lacks it (a miss), never another key's."""
Probe = Callable[[], list[dict[str, float]]]
"""Every engine's metrics now (``fleet_metrics.scrape`` of each)."""


def _redis(port: int) -> Any:
    import redis

    return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)


def _info(port: int, section: str) -> dict[str, Any]:
    client = _redis(port)
    try:
        return dict(client.info(section))
    finally:
        client.close()


@dataclass
class ClusterNode:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@dataclass
class RedisClusterFleet:
    """The cluster's nodes (masters first, as created)."""

    nodes: list[ClusterNode]

    def node(self, port: int) -> ClusterNode:
        (node,) = [n for n in self.nodes if n.port == port]
        return node

    def role(self, port: int) -> str:
        """``master`` or ``slave``, as the node says now."""
        return str(_info(port, "replication")["role"])

    def masters(self) -> dict[int, int]:
        """Each live master's port and its online replica's port (0: none)."""
        out = {}
        for n in self.nodes:
            if n.proc.proc.poll() is not None:
                continue
            with contextlib.suppress(Exception):
                info = _info(n.port, "replication")
                if info["role"] == "master":
                    replicas = [v for k, v in info.items() if k.startswith("slave")
                                and isinstance(v, dict) and v.get("state") == "online"]  # fmt: skip
                    out[n.port] = int(replicas[0]["port"]) if replicas else 0
        return out

    def flush(self) -> None:
        """Empty every master (their replicas follow)."""
        for port in self.masters():
            client = _redis(port)
            try:
                client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        for n in reversed(self.nodes):
            n.proc.stop()


def _cluster_info(port: int) -> str:
    client = _redis(port)
    try:
        info = client.execute_command("CLUSTER", "INFO")
    finally:
        client.close()
    return info.decode() if isinstance(info, bytes) else str(info)


def _healthy(nodes: list[ClusterNode], masters: int) -> bool:
    """Every node sees all of them and ``cluster_state:ok``; ``masters`` masters,
    each with a replica whose link is up."""
    try:
        for n in nodes:
            text = _cluster_info(n.port)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{len(nodes)}" not in text:
                return False
        seen = RedisClusterFleet(nodes).masters()
        if len(seen) != masters or not all(seen.values()):
            return False
        return all(_info(p, "replication").get("master_link_status") == "up" for p in seen.values())
    except Exception:  # a node not answering yet
        return False


def start_redis_cluster(
    workdir: Path, maxmemory_bytes: int, policy: str, masters: int = 3, timeout: float = 60.0
) -> RedisClusterFleet:
    """``masters`` masters with a replica each, ``maxmemory_bytes`` split over the
    masters; node files under ``workdir``, logs there too."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-server)")
    per_node = str(max(1 << 20, maxmemory_bytes // masters))
    nodes: list[ClusterNode] = []
    try:
        for i in range(2 * masters):
            port = free_port(also_free=10000)
            node_dir = workdir / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                     "--cluster-require-full-coverage", "no", *REPLICA_ARGS]  # fmt: skip
            proc, _ = start_redis(node_dir, per_node, policy, name=f"redis-cluster-node{i}",
                                  port=port, extra=extra)  # fmt: skip
            nodes.append(ClusterNode(proc, port))
        res = subprocess.run(
            [cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {res.stdout[-1500:]}")
        deadline = time.monotonic() + timeout
        while not _healthy(nodes, masters):
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not become healthy with synced replicas")
            time.sleep(0.2)
    except BaseException:
        for n in reversed(nodes):
            n.proc.stop()
        raise
    return RedisClusterFleet(nodes)


def _summed(samples: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        for k, v in s.items():
            out[k] = out.get(k, 0.0) + v
    return out


def stretch(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    """The fleet's figures between two reads of every engine's metrics (engines added up)."""
    return engine_figures(delta(_summed(before), _summed(after)))


class MasterKill:
    """``kill -9`` of one master once ``after`` of a run's requests have finished;
    the promotion of its replica watched (every 0.1 s, at most ``timeout`` s)."""

    def __init__(
        self, cluster: RedisClusterFleet, after: float, probe: Probe, timeout: float = 60.0
    ) -> None:
        self.cluster = cluster
        self.after = after
        self.probe = probe
        self.timeout = timeout
        masters = cluster.masters()
        self.victim = sorted(masters)[1 % len(masters)]
        self.replica = masters[self.victim]
        self.after_requests = 0
        self.killed_at: float | None = None
        self.promoted_at: float | None = None
        self.at_kill: list[dict[str, float]] | None = None
        self.at_promotion: list[dict[str, float]] | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def request_done(self, finished: int, total: int) -> None:
        """Called as each request finishes (in the workload's event loop): the kill is
        a signal and a wait for the process to end; the rest goes on a thread."""
        if self.killed_at is None and finished >= max(1, math.ceil(self.after * total)):
            self.after_requests = finished
            self.killed_at = time.perf_counter()
            self.cluster.node(self.victim).proc.kill()
            self._thread = threading.Thread(target=self._watch, name="master-kill", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        assert self.killed_at is not None
        try:
            self.at_kill = self.probe()
            while time.perf_counter() - self.killed_at < self.timeout:
                with contextlib.suppress(Exception):
                    if self.cluster.role(self.replica) == "master":
                        self.promoted_at = time.perf_counter()
                        break
                time.sleep(0.1)
            self.at_promotion = self.probe()
        except Exception as exc:  # recorded in the result: the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def result(
        self, t0: float, wall_s: float, start: list[dict[str, float]], end: list[dict[str, float]]
    ) -> dict[str, Any]:
        """Waits for the watch to end; times in seconds since ``t0`` (the workload's
        clock, as the records' ``sent_s``), the fleet's figures over each stretch
        (``after_promotion`` None when the promotion came after the workload; the
        metrics are read just after the kill, so ``before_kill`` holds what the
        engines did in the few hundred ms that reading took too)."""
        if self._thread is not None:
            self._thread.join(self.timeout + 30)
        kill_s = None if self.killed_at is None else self.killed_at - t0
        promoted_s = None if self.promoted_at is None else self.promoted_at - t0
        stretches: dict[str, Any] = {}
        if self.at_kill is not None:
            stretches["before_kill"] = stretch(start, self.at_kill)
            in_run = promoted_s is not None and promoted_s < wall_s
            mid_end = self.at_promotion if in_run and self.at_promotion is not None else end
            stretches["kill_to_promotion"] = stretch(self.at_kill, mid_end)
            stretches["after_promotion"] = (
                stretch(self.at_promotion, end) if in_run and self.at_promotion else None
            )
        return {
            "killed_master": f"127.0.0.1:{self.victim}" if self.killed_at else None,
            "promoted_replica": f"127.0.0.1:{self.replica}" if self.promoted_at else None,
            "kill_after_share": self.after,
            "kill_after_requests": self.after_requests,
            "kill_s": kill_s,
            "promoted_s": promoted_s,
            "promotion_after_kill_s": None
            if kill_s is None or promoted_s is None
            else promoted_s - kill_s,
            "workload_wall_s": wall_s,
            "stretches": stretches,
            "error": self.error,
        }
