"""Real ``redis-server`` processes for tests: one server, or a three-node Cluster,
each also TLS only with AUTH (a throwaway CA from ``openssl``).

Every server runs on a free loopback port with persistence off
(``--save '' --appendonly no``) in a temporary directory, and is killed at
the end. Import the fixtures into a test module::

    from redis_server import redis_cluster_fixture, redis_server_fixture  # noqa: F401
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import yaml

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.usefixtures("redis_tools")
"""Tests that need redis-server and redis-cli: without them they fail (never skip);
import ``redis_tools`` next to it."""


def free_port(also_free: int = 0) -> int:
    """A free loopback port; with ``also_free``, one whose ``port + also_free`` is free too
    (Cluster nodes also listen on port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also_free:
            return port
        if port + also_free > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + also_free))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


def _ping(port: int, password: str | None = None, extra: Sequence[str] = ()) -> bool:
    assert REDIS_CLI is not None
    args = [REDIS_CLI, "-p", str(port), *extra]
    env = dict(os.environ, REDISCLI_AUTH=password) if password else None
    res = subprocess.run([*args, "PING"], capture_output=True, text=True, env=env, timeout=5)
    return res.returncode == 0 and "PONG" in res.stdout


@dataclass
class RedisServer:
    """One ``redis-server``; ``stop``/``start`` keep its port, so clients can reconnect."""

    workdir: Path
    port: int = 0
    args: list[str] = field(default_factory=list)
    password: str | None = None
    ping_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert REDIS_SERVER is not None
        if not self.port:
            self.port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
               "--logfile", str(self.workdir / "redis.log"), *self.args]  # fmt: skip
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if _ping(self.port, self.password, self.ping_args):
                return self
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (timeouts)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def cli(self, *args: str) -> str:
        assert REDIS_CLI is not None
        env = dict(os.environ, REDISCLI_AUTH=self.password) if self.password else None
        res = subprocess.run([REDIS_CLI, "-p", str(self.port), *self.ping_args, *args],
                             capture_output=True, text=True, env=env, timeout=10, check=True)  # fmt: skip
        return res.stdout.strip()


@dataclass
class RedisClusterNodes:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def node_for_port(self, port: int) -> RedisServer:
        (node,) = [n for n in self.nodes if n.port == port]
        return node


def start_cluster(
    workdir: Path,
    n: int = 3,
    *,
    node_args: Callable[[int], list[str]] | None = None,
    password: str | None = None,
    cli_args: Sequence[str] = (),
    replicas: int = 0,
) -> RedisClusterNodes:
    """``n`` cluster-enabled servers joined with ``redis-cli --cluster create``
    (with ``replicas``, each master gets that many of the ``n`` as replicas).

    ``cluster-require-full-coverage no``: when a node dies the others keep
    serving their own slots (a cache wants exactly that). ``node_args(port)``
    adds each node's own arguments (e.g. TLS only on ``port``), ``password``
    is the AUTH every node requires and ``cli_args`` what ``redis-cli`` needs
    to reach them (``--tls --cacert ...``)."""
    assert REDIS_CLI is not None
    nodes: list[RedisServer] = []
    try:
        for i in range(n):
            port = free_port(also_free=10000)
            args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                    *(node_args(port) if node_args else [])]  # fmt: skip
            nodes.append(RedisServer(workdir / f"node{i}", port, args, password=password,
                                     ping_args=list(cli_args)).start())  # fmt: skip
        env = dict(os.environ, REDISCLI_AUTH=password) if password else None
        subprocess.run(
            [REDIS_CLI, *cli_args, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in nodes],
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in nodes) and (
                not replicas or _replicas_known(nodes, n // (replicas + 1))
            ):
                return RedisClusterNodes(nodes)
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")
    except BaseException:
        for s in nodes:
            s.kill()
        raise


def _replicas_known(nodes: list[RedisServer], masters: int) -> bool:
    """Every node sees ``masters`` masters, each with a replica that has synced."""
    for node in nodes:
        seen = cluster_masters(node)
        if len(seen) != masters or not all(replica for _, replica in seen.values()):
            return False
    return all(
        "master_link_status:up" in node.cli("INFO", "replication")
        for node in nodes
        if "role:slave" in node.cli("INFO", "replication")
    )


def cluster_masters(node: RedisServer) -> dict[int, tuple[int, int]]:
    """Each master's port: ``(first slot it serves, port of its replica or 0)``,
    as ``node`` sees the cluster now."""
    rows = [line.split() for line in node.cli("CLUSTER", "NODES").splitlines()]
    port = {r[0]: int(r[1].split("@")[0].rsplit(":", 1)[1]) for r in rows}
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        if "master" in r[2] and "fail" not in r[2] and len(r) > 8:
            replica = next((port[x[0]] for x in rows if x[3] == r[0] and "fail" not in x[2]), 0)
            out[port[r[0]]] = (int(r[8].split("-")[0]), replica)
    return out


# -- the chunks a test stores in a redis tier ----------------------------------------------

FAST: dict[str, Any] = {
    "backoff_initial": 0.05,
    "backoff_max": 0.2,
    "socket_timeout": 0.3,
    "connect_timeout": 0.3,
}
"""Tier options that notice a dead server, and retry it, within a fraction of a second."""


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def served(tier: Any, keys: range) -> set[int]:
    """Which of chunks ``keys`` the tier serves, each checked byte for byte."""
    got = tier.get([key(i) for i in keys])
    wrong = [i for i, v in zip(keys, got, strict=True) if v is not None and bytes(v) != payload(i)]
    assert not wrong, f"wrong bytes for {wrong}"
    return {i for i, v in zip(keys, got, strict=True) if v is not None}


def watch_failover(
    tier: Any, n: int, promoted: Callable[[], bool], always: Collection[int] = ()
) -> tuple[float, float, list[tuple[float, int]]]:
    """Right after a master was killed: read chunks ``0..n-1`` every 0.2 s (``always``
    must be served throughout) until ``promoted()`` and every chunk is served again.
    Returns the seconds from the kill to the promotion, from the promotion to the
    first read that served all, and the reads' log; fails after 40 s."""
    killed = time.monotonic()
    promoted_at = served_at = None
    log: list[tuple[float, int]] = []
    while time.monotonic() - killed < 40 and served_at is None:
        hit = served(tier, range(n))
        now = time.monotonic()
        log.append((round(now - killed, 2), len(hit)))
        assert set(always) <= hit, f"chunks that must stay served missed: {log}"
        if promoted_at is None and promoted():
            promoted_at = now
        if promoted_at is not None and len(hit) == n:
            served_at = now
        time.sleep(0.2)
    assert promoted_at is not None, f"no replica was promoted within 40 s: {log}"
    assert served_at is not None, f"the chunks missed for 40 s after the kill: {log}"
    return promoted_at - killed, served_at - promoted_at, log


PASSWORD = "s3cr@t:pa/ss-W0rd"
"""A password with ``@``, ``:`` and ``/`` (URL delimiters): tests check it never shows."""
ACL_USER = "kvsdk-writer"


def make_test_ca(workdir: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 (one day):
    ``(ca.crt, server.crt, server.key)``. Needs the ``openssl`` binary."""
    if shutil.which("openssl") is None:
        missing_tool("openssl not installed: cannot make a test certificate authority")
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, csr = workdir / "server.crt", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-days", "1", "-keyout", ca_key, "-out", ca,
         "-subj", "/CN=kvsdk test CA"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-days", "1", "-out", cert, "-extfile", ext],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True, timeout=30)
    return ca, cert, key


def _tls_args(port: int, ca: Path, cert: Path, key: Path) -> list[str]:
    """TLS only: no plain port, ``port`` speaks TLS with the test CA's certificate."""
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
            "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
            "--tls-auth-clients", "no"]  # fmt: skip


def _acl_args(acl_user: str | None, password: str | None) -> list[str]:
    """An ACL user with ``password``, limited to kvsdk's keys."""
    if acl_user is None:
        return []
    assert password is not None
    return ["--user", acl_user, "on", f">{password}", "~kvsdk:*", "&*", "+@all"]


def start_tls_server(
    workdir: Path, password: str | None = None, acl_user: str | None = None
) -> tuple[RedisServer, Path]:
    """A ``redis-server`` that speaks only TLS (no plain port), with a
    certificate from :func:`make_test_ca`; with ``password``, AUTH is required
    (``requirepass``) and ``acl_user`` is an ACL user with the same password,
    limited to kvsdk's keys. Returns the server and the CA file to trust."""
    ca, cert, key = make_test_ca(workdir / "pki")
    port = free_port()
    args = [*_tls_args(port, ca, cert, key), *_acl_args(acl_user, password)]
    server = RedisServer(workdir / "srv", port=port, args=args, password=password,
                         ping_args=["--tls", "--cacert", str(ca)])  # fmt: skip
    try:
        server.start(timeout=10)
    except RuntimeError as exc:
        server.kill()
        missing_tool(f"this redis-server cannot serve TLS: {exc}")
    return server, ca


def start_tls_cluster(
    workdir: Path, password: str, acl_user: str | None = None, n: int = 3
) -> tuple[RedisClusterNodes, Path]:
    """A ``n``-node Redis Cluster that speaks only TLS, to clients and between
    its nodes (``--tls-cluster yes``, ``--tls-replication yes``; no plain port),
    with one certificate from :func:`make_test_ca`; every node requires AUTH
    (``requirepass``, ``masterauth``) and has ``acl_user`` with the same
    password. Returns the cluster and the CA file to trust."""
    ca, cert, key = make_test_ca(workdir / "pki")

    def node_args(port: int) -> list[str]:
        return [*_tls_args(port, ca, cert, key), "--tls-cluster", "yes",
                "--tls-replication", "yes", "--masterauth", password,
                *_acl_args(acl_user, password)]  # fmt: skip

    try:
        cluster = start_cluster(workdir, n, node_args=node_args, password=password,
                                cli_args=["--tls", "--cacert", str(ca)])  # fmt: skip
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        missing_tool(f"this redis-server cannot run a TLS cluster: {exc}")
    return cluster, ca


def in_url(user: str, password: str) -> str:
    """``user:password@`` for a URL, both percent-encoded."""
    return f"{quote(user, safe='')}:{quote(password, safe='')}@"


def leaked(text: str, *passwords: str) -> list[str]:
    """Each form of each password (raw, percent-encoded) found in ``text``."""
    forms = {f for p in passwords for f in (p, quote(p, safe=""), quote(p))}
    return sorted(f for f in forms if f in text)


def inspect_cli(
    tmp_path: Path, tier: dict[str, Any], *extra: str
) -> subprocess.CompletedProcess[str]:
    """``kvsdk inspect`` of a config whose slower tier is the Redis ``tier``, as a user runs it."""
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": [{"backend": "cpu", "capacity": "1MiB"},
                                             {"backend": "redis", **tier}]}))  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", "inspect", str(cfg), *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def missing_tool(message: str) -> None:
    """A tool the tests need is missing: a failure, never a skip (a skipped test
    proves nothing); scripts/setup.sh installs every one of them."""
    pytest.fail(f"{message} -- run scripts/setup.sh (or scripts/test.sh), which installs it")


@pytest.fixture(name="redis_tools")
def redis_tools_fixture() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing_tool("redis-server / redis-cli not installed (apt-get install redis-server)")


@pytest.fixture(name="redis_server")
def redis_server_fixture() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvsdk-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield server
        finally:
            server.kill()


@pytest.fixture(scope="module", name="redis_cluster")
def redis_cluster_fixture() -> Iterator[RedisClusterNodes]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing_tool("redis-server / redis-cli not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvsdk-redis-cluster-") as tmp:
        cluster = start_cluster(Path(tmp))
        try:
            yield cluster
        finally:
            for node in cluster.nodes:
                node.kill()


@pytest.fixture(scope="module", name="redis_tls_cluster")
def redis_tls_cluster_fixture(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisClusterNodes, Path]]:
    """:func:`start_tls_cluster` with :data:`PASSWORD` and :data:`ACL_USER`:
    ``(cluster, CA file)``."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        missing_tool("redis-server / redis-cli not installed (apt-get install redis-server)")
    cluster, ca = start_tls_cluster(
        tmp_path_factory.mktemp("tls-cluster"), password=PASSWORD, acl_user=ACL_USER
    )
    try:
        yield cluster, ca
    finally:
        for node in cluster.nodes:
            node.kill()
