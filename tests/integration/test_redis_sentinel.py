"""The redis tier behind Redis Sentinel, as users run a standalone master with a
replica: three real sentinels monitor it, the master is killed (``kill -9``),
the sentinels promote the replica, and the tier follows: every chunk is served
again, byte-identical, within seconds of the promotion, and writes land on the
new master."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis_server import (
    REDIS_CLI,
    REDIS_SERVER,
    RedisServer,
    free_port,
    key,
    missing_tool,
    payload,
    served,
    watch_failover,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"sentinel", digest_size=16).digest()
SERVICE = "kvsdk-cache"
N = 64
FOLLOW_WITHIN_S = 10.0


@dataclass
class Deployment:
    master: RedisServer
    replica: RedisServer
    sentinels: list[tuple[int, subprocess.Popen[bytes]]]

    def urls(self) -> tuple[str, ...]:
        return tuple(f"redis://127.0.0.1:{port}" for port, _ in self.sentinels)


def _cli(port: int, *args: str) -> str:
    assert REDIS_CLI is not None
    res = subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True,
                         timeout=10)  # fmt: skip
    return res.stdout.strip()


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout}s")
        time.sleep(0.1)


def start_sentinel(workdir: Path, master_port: int) -> tuple[int, subprocess.Popen[bytes]]:
    assert REDIS_SERVER is not None
    port = free_port()
    workdir.mkdir(parents=True)
    conf = workdir / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n"
        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
        f"sentinel failover-timeout {SERVICE} 5000\n"
    )
    proc = subprocess.Popen([REDIS_SERVER, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    return port, proc


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """A master, its replica and three sentinels (quorum 2) on loopback."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing_tool("redis-server / redis-cli not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvsdk-redis-sentinel-") as tmp:
        master = RedisServer(Path(tmp) / "master").start()
        replica = RedisServer(Path(tmp) / "replica",
                              args=["--replicaof", "127.0.0.1", str(master.port)]).start()  # fmt: skip
        sentinels = [start_sentinel(Path(tmp) / f"s{i}", master.port) for i in range(3)]
        d = Deployment(master, replica, sentinels)
        try:
            _wait(lambda: "master_link_status:up" in replica.cli("INFO", "replication"),
                  "the replica did not sync")  # fmt: skip
            for port, _ in sentinels:
                _wait(lambda port=port: "sentinels=3" in _cli(port, "INFO", "sentinel")
                      and "slaves=1" in _cli(port, "INFO", "sentinel"),
                      "the sentinels did not find each other and the replica")  # fmt: skip
            yield d
        finally:
            for _, proc in sentinels:
                proc.kill()
                proc.wait(timeout=10)
            master.kill()
            replica.kill()


def backend(d: Deployment, **extra: Any) -> RedisBackend:
    options = RedisOptions(
        sentinels=d.urls(),
        sentinel_master=SERVICE,
        socket_timeout=0.3,
        connect_timeout=0.3,
        backoff_initial=0.05,
        backoff_max=0.2,
        **extra,
    )
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=1 << 20)
    return RedisBackend(options, ctx)


def test_the_tier_follows_the_master_the_sentinels_promote(deployment: Deployment) -> None:
    d = deployment
    b = backend(d)
    assert all(b.put([(key(i), payload(i)) for i in range(N)]))
    assert int(d.master.cli("DBSIZE")) == N  # on the master the sentinels named
    assert int(d.master.cli("WAIT", "1", "5000")) == 1
    assert served(b, range(N)) == set(range(N))

    d.master.kill()

    def promoted() -> bool:
        return "role:master" in d.replica.cli("INFO", "replication")

    to_promotion, to_served, log = watch_failover(b, N, promoted)
    assert to_served <= FOLLOW_WITHIN_S, log
    print(f"sentinel failover: promoted {to_promotion:.1f} s after the kill, served "
          f"again {to_served:.1f} s after the promotion")  # fmt: skip
    fresh = range(N, N + 32)
    assert all(b.put([(key(i), payload(i)) for i in fresh]))
    assert int(d.replica.cli("DBSIZE")) == N + 32  # written to the promoted replica
    assert b.stats()["outages"] >= 1
    b.close()


def test_sentinel_options_are_checked_when_the_config_is_read() -> None:
    from kvsdk.config import ConfigError, load_config

    def tier(**extra: Any) -> dict[str, Any]:
        return {"tiers": [{"backend": "cpu", "capacity": "1MiB"},
                          {"backend": "redis", **extra}]}  # fmt: skip

    load_config(tier(sentinels=["redis://127.0.0.1:26379"], sentinel_master="m"))
    with pytest.raises(ConfigError, match=r"one set without the other"):
        load_config(tier(sentinels=["redis://127.0.0.1:26379"]))
    with pytest.raises(ConfigError, match=r"Sentinel with cluster: true is not supported"):
        load_config(tier(sentinels=["redis://h:26379"], sentinel_master="m", cluster=True))
    with pytest.raises(ConfigError, match=r"Sentinel with TLS is not supported"):
        load_config(tier(sentinels=["redis://h:26379"], sentinel_master="m", tls=True))
    with pytest.raises(ConfigError, match=r"sentinels\[0\]: expected redis://host:port"):
        load_config(tier(sentinels=["redis://h"], sentinel_master="m"))
