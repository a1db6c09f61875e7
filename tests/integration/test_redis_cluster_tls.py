"""The Redis tier in Cluster mode against a real three-node Redis Cluster that
speaks only TLS (to clients and on the cluster bus, a throwaway CA) and
requires AUTH (``requirepass``, ``masterauth``, an ACL user; one password with
``@``, ``:`` and ``/``): the data path, ``inventory``, ``wipe`` and ``kvsdk
inspect`` connect with the tier's TLS and AUTH options, to every node; refused
credentials and an untrusted certificate are misses counted as errors, logged
as what they are; no form of either password shows anywhere."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis_server import (  # noqa: F401  (fixtures)
    ACL_USER,
    PASSWORD,
    RedisClusterNodes,
    in_url,
    inspect_cli,
    leaked,
    needs_redis,
    redis_tls_cluster_fixture,
    redis_tools_fixture,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.chunk_format import HEADER_SIZE

pytestmark = [pytest.mark.integration, needs_redis]

FAST: dict[str, Any] = {
    "backoff_initial": 0.05,
    "backoff_max": 0.2,
    "socket_timeout": 0.5,
    "connect_timeout": 0.5,
}
PATIENT: dict[str, Any] = {"socket_timeout": 5.0, "connect_timeout": 5.0}
"""Where a connection must work: TLS handshakes on a loaded 2-core machine can take >1 s."""
N = 60
"""Keys per test: enough that each of the three nodes owns some."""
WRONG = "wr0ng@pass:wo/rd"


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``, which must return within ``seconds`` (a hang fails the test
    instead of hanging the suite)."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"did not return within {seconds}s"
    return out[0]


def backend(ns: bytes, **options: Any) -> RedisBackend:
    ctx = TierContext(namespace_fp=ns, namespace_hex=ns.hex(), chunk_bytes=8 << 20)
    return RedisBackend(RedisOptions(cluster=True, **options), ctx)


def keys_per_node(cluster: RedisClusterNodes, ns: bytes) -> list[int]:
    """This namespace's keys on each node, counted by the node itself (over TLS, with AUTH)."""
    out = []
    for node in cluster.nodes:
        listed = node.cli("--scan", "--pattern", f"kvsdk:{ns.hex()}:*")
        out.append(len(listed.split()))
    return out


WAYS: dict[str, Callable[[RedisClusterNodes, Path], dict[str, Any]]] = {
    "password-option": lambda c, ca: {
        "url": f"rediss://127.0.0.1:{c.nodes[0].port}", "password": PASSWORD,
        "tls_ca_file": str(ca)},
    "acl-user-tls-option": lambda c, ca: {
        "url": f"redis://127.0.0.1:{c.nodes[1].port}", "tls": True, "username": ACL_USER,
        "password": PASSWORD, "tls_ca_file": str(ca)},
    "acl-user-in-url": lambda c, ca: {
        "url": f"rediss://{in_url(ACL_USER, PASSWORD)}127.0.0.1:{c.nodes[2].port}",
        "tls_ca_file": str(ca)},
    "option-overrides-url": lambda c, ca: {  # the options win over the URL's user and password
        "url": f"rediss://{in_url('default', WRONG)}127.0.0.1:{c.nodes[1].port}",
        "username": ACL_USER, "password": PASSWORD, "tls_ca_file": str(ca)},
    "password-in-url": lambda c, ca: {
        "url": f"rediss://{in_url('', PASSWORD)}127.0.0.1:{c.nodes[0].port}",
        "tls_ca_file": str(ca)},
}  # fmt: skip


@pytest.mark.parametrize("way", list(WAYS))
def test_cluster_over_tls_with_auth_data_path_inventory_inspect_never_show_the_password(
    redis_tls_cluster: tuple[RedisClusterNodes, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    way: str,
) -> None:
    cluster, ca = redis_tls_cluster
    opts = {**WAYS[way](cluster, ca), **PATIENT}
    ns = hashlib.blake2b(b"cluster-" + way.encode(), digest_size=16).digest()
    with caplog.at_level(logging.DEBUG, logger="kvsdk"):
        b = backend(ns, **opts)
        assert b.put([(key(i), payload(i)) for i in range(N)]) == [True] * N
        assert b.get([key(i) for i in range(N)]) == [payload(i) for i in range(N)]
        assert b.exists([key(0), key(N)]) == [True, False]
        spread = keys_per_node(cluster, ns)
        assert sum(spread) == N and all(spread), spread  # every node holds some of them
        assert sorted(b.iter_keys()) == sorted(key(i) for i in range(N))
        assert b.error_count() == 0 and b.stats()["outages"] == 0
    row = {"namespace": ns.hex(), "entries": N, "bytes": N * (HEADER_SIZE + 4096)}
    assert row in RedisBackend.inventory(b.options)
    yaml_opts = {"cluster": True, **opts}
    out = inspect_cli(tmp_path, yaml_opts)
    assert out.returncode == 0, out.stderr
    assert f"namespace {ns.hex()}: {N} chunks" in out.stdout
    as_json = inspect_cli(tmp_path, yaml_opts, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert row in json.loads(as_json.stdout)[1]["namespaces"]
    assert b.delete([key(0), key(1)]) == 2
    assert RedisBackend.wipe(b.options, ns.hex()) == N - 2 and sum(keys_per_node(cluster, ns)) == 0
    shown = " ".join([out.stdout, out.stderr, as_json.stdout, as_json.stderr, caplog.text,
                      repr(b), repr(b.options)])  # fmt: skip
    assert not leaked(shown, PASSWORD)
    b.close()


REFUSED: dict[str, tuple[Callable[[RedisClusterNodes, Path], dict[str, Any]], tuple[str, ...]]] = {
    "wrong-password": (lambda c, ca: {
        "url": f"rediss://127.0.0.1:{c.nodes[0].port}", "password": WRONG,
        "tls_ca_file": str(ca)}, ("invalid username-password", "WRONGPASS")),
    "wrong-password-in-url": (lambda c, ca: {
        "url": f"rediss://{in_url(ACL_USER, WRONG)}127.0.0.1:{c.nodes[1].port}",
        "tls_ca_file": str(ca)}, ("invalid username-password", "WRONGPASS")),
    "no-password": (lambda c, ca: {
        "url": f"rediss://127.0.0.1:{c.nodes[2].port}", "tls_ca_file": str(ca)},
        ("must be called with the client already authenticated", "NOAUTH")),
    "untrusted-certificate": (lambda c, ca: {
        "url": f"rediss://127.0.0.1:{c.nodes[0].port}", "password": PASSWORD},
        ("certificate verify failed", "CERTIFICATE_VERIFY_FAILED")),
}  # fmt: skip


@pytest.mark.parametrize("how", list(REFUSED))
def test_cluster_refusing_the_connection_is_a_miss_and_a_clear_error_without_the_password(
    redis_tls_cluster: tuple[RedisClusterNodes, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    cluster, ca = redis_tls_cluster
    make, says = REFUSED[how]
    opts = make(cluster, ca)
    with caplog.at_level(logging.DEBUG, logger="kvsdk"):
        b = backend(hashlib.blake2b(how.encode(), digest_size=16).digest(), **opts, **FAST)
        assert within(20, lambda: b.get([key(1)])) == [None]
        assert within(20, lambda: b.put([(key(2), payload(2))])) == [False]
        assert b.error_count() >= 1 and b.stats()["misses"] == 1
    assert any(s in caplog.text for s in says), caplog.text
    tls = how == "untrusted-certificate"
    assert ("failed the TLS handshake" if tls else "refused this client's credentials") in (
        caplog.text
    ), caplog.text
    for extra in ((), ("--json",)):
        out = inspect_cli(tmp_path, {"cluster": True, **opts}, *extra)
        assert out.returncode == 1, (out.stdout, out.stderr)
        assert "tiers[1] (redis)" in out.stderr and any(s in out.stderr for s in says), out.stderr
        shown = " ".join([out.stdout, out.stderr, caplog.text, repr(b), repr(b.options)])
        assert not leaked(shown, PASSWORD, WRONG)
    b.close()
