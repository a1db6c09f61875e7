"""The redis tier against real ``redis-server`` processes: one server and a 3-node Cluster."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster
from redis_server import (  # noqa: F401  (fixtures)
    ACL_USER,
    FAST,
    PASSWORD,
    RedisClusterNodes,
    RedisServer,
    free_port,
    in_url,
    inspect_cli,
    key,
    leaked,
    needs_redis,
    payload,
    redis_cluster_fixture,
    redis_server_fixture,
    redis_tools_fixture,
    start_tls_server,
)

from kvsdk import plugins_manager
from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk
from kvsdk.config import ConfigError, load_config

pytestmark = [pytest.mark.integration, needs_redis]

NS = hashlib.blake2b(b"model-a", digest_size=16).digest()
NS_B = hashlib.blake2b(b"model-b", digest_size=16).digest()


LARGEST = 8 << 20
"""The largest payload the tests' tiers take (``TierContext.chunk_bytes``)."""


def ctx(ns: bytes = NS) -> TierContext:
    return TierContext(namespace_fp=ns, namespace_hex=ns.hex(), chunk_bytes=LARGEST)


def backend(url: str, ns: bytes = NS, **options: Any) -> RedisBackend:
    return RedisBackend(RedisOptions(url=url, **options), ctx(ns))


def rkey(k: bytes, ns: bytes = NS) -> str:
    return f"kvsdk:{ns.hex()}:{k.hex()}"


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def hits(b: RedisBackend, n: int, start: int = 0) -> int:
    return sum(v is not None for v in b.get([key(i) for i in range(start, start + n)]))


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# -- one server ----------------------------------------------------------------------------


def test_round_trip_exists_delete(redis_server: RedisServer) -> None:
    b = backend(redis_server.url)
    items = [(key(i), payload(i)) for i in range(10)]
    assert b.put(items) == [True] * 10
    assert b.exists([key(0), key(99)]) == [True, False]
    got = b.get([key(99), *[k for k, _ in items]])
    assert got[0] is None and [bytes(v) for v in got[1:] if v is not None] == [p for _, p in items]
    assert b.delete([key(0), key(1), key(99)]) == 2
    assert b.exists([key(0), key(2)]) == [False, True]
    s = b.stats()
    assert s["hits"] == 10 and s["misses"] == 1 and s["puts"] == 10 and s["deletes"] == 2


def test_batches_larger_than_max_batch_and_big_values(redis_server: RedisServer) -> None:
    b = backend(redis_server.url, max_batch=7)
    assert all(b.put([(key(i), payload(i, 1000)) for i in range(100)]))
    assert hits(b, 100) == 100
    arr = np.arange(1 << 20, dtype=np.float32).reshape(256, 4096)  # 4 MiB
    assert b.put([(key(500), arr)]) == [True]
    (v,) = b.get([key(500)])
    assert v is not None
    np.testing.assert_array_equal(np.frombuffer(v, dtype=np.float32).reshape(256, 4096), arr)


def test_keys_are_prefixed_by_namespace_and_isolated(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    a, b = backend(redis_server.url, NS), backend(redis_server.url, NS_B)
    a.put([(key(1), payload(1))])
    assert raw.exists(rkey(key(1))) == 1
    assert b.get([key(1)]) == [None] and b.exists([key(1)]) == [False]
    b.put([(key(1), payload(2))])
    a.clear()
    assert a.exists([key(1)]) == [False] and b.get([key(1)])[0] == payload(2)
    assert sorted(b.iter_keys()) == [key(1)]


def test_ttl_is_set_when_configured(redis_server: RedisServer, raw: redis.Redis) -> None:
    backend(redis_server.url, ttl_seconds=30).put([(key(1), payload(1))])
    backend(redis_server.url).put([(key(2), payload(2))])
    assert 0 < raw.ttl(rkey(key(1))) <= 30
    assert raw.ttl(rkey(key(2))) == -1


def test_registered_through_the_backends_hook_and_config(redis_server: RedisServer) -> None:
    assert plugins_manager.backends()["redis"] is RedisBackend
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu"},
                {"backend": "redis", "url": redis_server.url, "ttl_seconds": 60},
            ]
        }
    )
    opts = cfg.tiers[1].options
    assert isinstance(opts, RedisOptions) and opts.ttl_seconds == 60
    b = RedisBackend(opts, ctx())
    assert b.put([(key(1), b"abc")]) == [True] and b.get([key(1)])[0] == b"abc"


def test_bad_options_fail_at_start() -> None:
    with pytest.raises(ValueError, match="url"):
        RedisOptions(url="http://localhost")
    with pytest.raises(ValueError, match="ttl_seconds"):
        RedisOptions(ttl_seconds=0)
    with pytest.raises(ValueError, match="max_batch"):
        RedisOptions(max_batch=0)


# -- integrity -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda good: b"garbage", id="garbage"),
        pytest.param(lambda good: b"", id="empty"),
        pytest.param(lambda good: good[:-1], id="truncated"),
        pytest.param(lambda good: good[: HEADER_SIZE - 3], id="truncated-header"),
        pytest.param(lambda good: good[:500] + bytes([good[500] ^ 1]) + good[501:], id="flipped"),
        pytest.param(lambda good: encode_chunk(NS_B, key(1), payload(1)), id="foreign-namespace"),
        pytest.param(lambda good: encode_chunk(NS, key(2), payload(1)), id="other-key"),
    ],
)
def test_bad_values_are_misses_and_deleted(
    redis_server: RedisServer, raw: redis.Redis, plant: Callable[[bytes], bytes]
) -> None:
    b = backend(redis_server.url)
    b.put([(key(1), payload(1)), (key(3), payload(3))])
    good = raw.get(rkey(key(1)))
    assert isinstance(good, bytes)
    raw.set(rkey(key(1)), plant(good))
    assert b.get([key(1), key(3)]) == [None, payload(3)]
    assert raw.exists(rkey(key(1))) == 0, "the bad entry is deleted"
    assert b.stats()["corrupt"] == 1


def test_a_value_of_the_wrong_type_is_a_miss(redis_server: RedisServer, raw: redis.Redis) -> None:
    raw.rpush(rkey(key(1)), b"x")  # GET on a list: WRONGTYPE
    b = backend(redis_server.url, max_batch=1)
    b.put([(key(2), payload(2))])
    assert b.get([key(1), key(2)]) == [None, payload(2)]


# -- failures ----------------------------------------------------------------------------------------


def test_server_killed_mid_run_gives_misses_then_recovers(redis_server: RedisServer) -> None:
    b = backend(redis_server.url, **FAST)
    assert all(b.put([(key(i), payload(i)) for i in range(20)]))
    assert hits(b, 20) == 20
    redis_server.kill()
    start = time.monotonic()
    assert b.get([key(i) for i in range(20)]) == [None] * 20
    assert b.put([(key(100), payload(100))]) == [False]
    assert b.exists([key(1)]) == [False] and b.delete([key(1)]) == 0
    for _ in range(50):  # while the breaker is open, calls cost nothing
        b.get([key(1)])
    assert time.monotonic() - start < 2.0
    s = b.stats()
    assert s["outages"] >= 1 and s["skipped"] > 0 and s["breakers_open"] in (0.0, 1.0)
    redis_server.start()  # same port, empty (no persistence)
    wait_until(lambda: b.put([(key(200), payload(200))]) == [True], timeout=5)
    assert b.get([key(200)])[0] == payload(200)
    assert b.get([key(1)]) == [None]  # the restart lost it: a miss, not an error


def test_unresponsive_server_times_out_into_misses(redis_server: RedisServer) -> None:
    b = backend(redis_server.url, **FAST)
    b.put([(key(1), payload(1))])
    redis_server.pause()
    try:
        start = time.monotonic()
        assert b.get([key(1)]) == [None]
        assert time.monotonic() - start < 2.0
        assert b.put([(key(2), payload(2))]) == [False]
    finally:
        redis_server.resume()
    wait_until(lambda: b.get([key(1)])[0] == payload(1), timeout=5)


def test_no_server_at_start_is_not_an_error() -> None:
    b = backend(f"redis://127.0.0.1:{free_port()}/0", **FAST)
    assert b.get([key(1)]) == [None] and b.put([(key(1), b"x")]) == [False]
    assert b.stats()["outages"] == 1


def test_password_auth_and_the_password_never_shows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "s3cret-Pa55"
    server = RedisServer(tmp_path, password=secret).start()
    try:
        ok = backend(server.url, password=secret)
        assert ok.put([(key(1), payload(1))]) == [True] and ok.get([key(1)])[0] == payload(1)
        in_url = backend(f"redis://:{secret}@127.0.0.1:{server.port}/0")
        assert in_url.get([key(1)])[0] == payload(1)
        with caplog.at_level(logging.DEBUG, logger="kvsdk"):
            wrong = backend(
                f"redis://:{secret}x@127.0.0.1:{server.port}/0", password="nope-" + secret, **FAST
            )
            assert wrong.get([key(1)]) == [None] and wrong.put([(key(2), b"x")]) == [False]
            server.kill()
            assert in_url.get([key(1)]) == [None]
        shown = " ".join([repr(ok), repr(ok.options), repr(in_url), repr(in_url.options),
                          repr(wrong.options), caplog.text])  # fmt: skip
        assert "redis tier" in caplog.text and secret not in shown and "***" in shown
    finally:
        server.kill()


def test_the_password_from_a_file_or_the_environment_and_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``password_file`` (a mounted secret, its trailing newline dropped) and
    ``password_env`` authenticate like ``password``; a missing file, an unset
    variable or two sources at once are one-sentence config errors (exit 2 from
    ``kvsdk config check``) naming the key, never the password."""
    from kvsdk.cli import main

    secret = "f1le-Pa55-w0rd"
    server = RedisServer(tmp_path / "srv", password=secret).start()
    try:
        pw_file = tmp_path / "redis-password"
        pw_file.write_text(secret + "\n")
        monkeypatch.setenv("KVSDK_TEST_REDIS_PASSWORD", secret)
        for source in ({"password_file": str(pw_file)},
                       {"password_env": "KVSDK_TEST_REDIS_PASSWORD"}):  # fmt: skip
            cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"},
                                         {"backend": "redis", "url": server.url, **source}]})  # fmt: skip
            b = RedisBackend(cfg.tiers[1].options, ctx())
            assert b.put([(key(1), payload(1))]) == [True] and b.get([key(1)])[0] == payload(1)
            assert secret not in repr(cfg.tiers[1].options) and secret not in repr(b)

        bad = {
            "password_env: the environment variable 'KVSDK_NO_SUCH_VAR' is not set": {
                "password_env": "KVSDK_NO_SUCH_VAR"},
            "password_file: cannot read": {"password_file": str(tmp_path / "absent")},
            "password_file: set together with password": {
                "password": secret, "password_file": str(pw_file)},
        }  # fmt: skip
        for message, source in bad.items():
            tier = {"backend": "redis", "url": server.url, **source}
            with pytest.raises(ConfigError, match=r"tiers\[1\]: " + message):
                load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, tier]})
            path = tmp_path / "bad.yaml"
            path.write_text(json.dumps({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, tier]}))
            assert main(["config", "check", str(path)]) == 2
            out = capsys.readouterr()
            assert message in out.err + out.out and secret not in out.err + out.out
    finally:
        server.kill()


def test_large_chunks_move_in_round_trips_of_bounded_bytes(redis_server: RedisServer) -> None:
    """No round trip moves more than ROUND_TRIP_BYTES (8 MiB): 16 chunks of 1 MiB
    go in 3 round trips each way (7 per trip), 64 chunks of 4 KiB in one."""
    from kvsdk.backends.redis_routing import ROUND_TRIP_BYTES

    mib = 1 << 20
    ctx_1mib = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=mib)
    b = RedisBackend(RedisOptions(url=redis_server.url), ctx_1mib)
    big = [(key(i), payload(i, mib)) for i in range(16)]
    trips = b.stats()["round_trips"]
    assert b.put(big) == [True] * 16
    assert b.stats()["round_trips"] - trips == 3 == -(-16 // (ROUND_TRIP_BYTES // (mib + 64)))
    got = b.get([k for k, _ in big])
    assert [bytes(v) for v in got if v is not None] == [v for _, v in big]
    assert b.stats()["round_trips"] - trips == 6
    small = [(key(100 + i), payload(100 + i)) for i in range(64)]
    assert b.put(small) == [True] * 64 and b.stats()["round_trips"] - trips == 7
    b.clear()


def test_a_hit_restarts_its_ttl_only_with_ttl_refresh_on_hit(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    plain = backend(redis_server.url, ttl_seconds=100)
    fresh = backend(redis_server.url, ttl_seconds=100, ttl_refresh_on_hit=True)
    assert plain.put([(key(1), payload(1)), (key(2), payload(2))]) == [True, True]
    for i in (1, 2):
        raw.expire(rkey(key(i)), 5)  # as if stored 95 s ago
    assert plain.get([key(1)])[0] is not None and raw.ttl(rkey(key(1))) <= 5
    got = fresh.get([key(2), key(99)])
    assert got[0] is not None and bytes(got[0]) == payload(2) and got[1] is None
    assert raw.ttl(rkey(key(2))) > 90  # the hit lives another ttl_seconds
    assert raw.exists(rkey(key(99))) == 0  # a miss creates nothing
    with pytest.raises(ValueError, match="ttl_refresh_on_hit: set without ttl_seconds"):
        RedisOptions(url=redis_server.url, ttl_refresh_on_hit=True)
    plain.clear()


def _store_in_child(url: str, start: int, n: int) -> list[bool]:
    b = backend(url)
    stored: list[bool] = b.put([(key(i), payload(i)) for i in range(start, start + n)])
    return stored


def test_processes_share_entries_and_concurrent_writers_agree(redis_server: RedisServer) -> None:
    fork = mp.get_context("fork")
    with fork.Pool(2) as pool:
        results = pool.starmap(
            _store_in_child, [(redis_server.url, 0, 40), (redis_server.url, 20, 40)]
        )
    assert all(all(r) for r in results)
    reader = backend(redis_server.url)
    assert hits(reader, 60) == 60 and reader.stats()["corrupt"] == 0


def test_threads_share_one_backend(redis_server: RedisServer) -> None:
    b = backend(redis_server.url, max_connections=4)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for r in range(30):
                i = seed * 1000 + r
                assert b.put([(key(i), payload(i, 2048))]) == [True]
                assert b.get([key(i)])[0] == payload(i, 2048)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and b.stats()["outages"] == 0


def test_tls(tmp_path: Path) -> None:
    server, cert = start_tls_server(tmp_path)
    try:
        b = backend(server.url, tls=True, tls_ca_file=str(cert))
        assert b.put([(key(1), payload(1))]) == [True] and b.get([key(1)])[0] == payload(1)
        plain = backend(server.url, **FAST)  # no TLS against a TLS port: misses, no crash
        assert plain.get([key(1)]) == [None]
    finally:
        server.kill()


# -- AUTH over TLS: the data path, inventory and `kvsdk inspect` ------------------------------


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    """TLS only (no plain port), AUTH required, and an ACL user; one password
    with ``@``, ``:`` and ``/`` for both."""
    server, ca = start_tls_server(
        tmp_path_factory.mktemp("secure"), password=PASSWORD, acl_user=ACL_USER
    )
    yield server, ca
    server.kill()


SECURE_WAYS: dict[str, Callable[[int, Path], dict[str, Any]]] = {
    "default-user": lambda port, ca: {
        "url": f"rediss://127.0.0.1:{port}/0", "password": PASSWORD, "tls_ca_file": str(ca)},
    "acl-user-tls-option": lambda port, ca: {
        "url": f"redis://127.0.0.1:{port}/0", "tls": True, "username": ACL_USER,
        "password": PASSWORD, "tls_ca_file": str(ca)},
    "acl-user-in-url": lambda port, ca: {
        "url": f"rediss://{in_url(ACL_USER, PASSWORD)}127.0.0.1:{port}/0",
        "tls_ca_file": str(ca)},
}  # fmt: skip


@pytest.mark.parametrize("way", list(SECURE_WAYS))
def test_auth_over_tls_data_path_inventory_and_inspect_never_show_the_password(
    secure_server: tuple[RedisServer, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    way: str,
) -> None:
    server, ca = secure_server
    opts = SECURE_WAYS[way](server.port, ca)
    ns = hashlib.blake2b(way.encode(), digest_size=16).digest()
    with caplog.at_level(logging.DEBUG, logger="kvsdk"):
        b = backend(opts.pop("url"), ns, **opts)
        opts["url"] = b.options.url
        assert b.put([(key(i), payload(i)) for i in range(3)]) == [True] * 3
        assert b.get([key(i) for i in range(3)]) == [payload(i) for i in range(3)]
        assert b.error_count() == 0
    row = {"namespace": ns.hex(), "entries": 3, "bytes": 3 * (HEADER_SIZE + 4096)}
    assert row in RedisBackend.inventory(RedisOptions(**opts))
    text = out = inspect_cli(tmp_path, opts)
    assert out.returncode == 0, out.stderr
    assert f"namespace {ns.hex()}: 3 chunks" in out.stdout
    as_json = inspect_cli(tmp_path, opts, "--json")
    assert as_json.returncode == 0 and row in json.loads(as_json.stdout)[1]["namespaces"]
    text = " ".join([out.stdout, out.stderr, as_json.stdout, as_json.stderr, caplog.text,
                     repr(b), repr(b.options)])  # fmt: skip
    assert not leaked(text, PASSWORD)
    b.clear()
    b.close()


WRONG = "wr0ng@pass:wo/rd"
REFUSED: dict[str, tuple[Callable[[int, Path], dict[str, Any]], tuple[str, ...]]] = {
    "wrong-password": (lambda port, ca: {"password": WRONG, "tls_ca_file": str(ca)},
                       ("invalid username-password", "WRONGPASS")),
    "wrong-password-in-url": (
        lambda port, ca: {"url": f"rediss://{in_url(ACL_USER, WRONG)}127.0.0.1:{port}/0",
                          "tls_ca_file": str(ca)},
        ("invalid username-password", "WRONGPASS")),
    "no-password": (lambda port, ca: {"tls_ca_file": str(ca)},
                    ("must be called with the client already authenticated", "NOAUTH")),
    "untrusted-certificate": (lambda port, ca: {"password": PASSWORD},
                              ("certificate verify failed", "CERTIFICATE_VERIFY_FAILED")),
}  # fmt: skip


@pytest.mark.parametrize("how", list(REFUSED))
def test_a_refused_connection_is_a_miss_and_a_clear_error_without_the_password(
    secure_server: tuple[RedisServer, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    server, ca = secure_server
    make, says = REFUSED[how]
    opts = {"url": f"rediss://127.0.0.1:{server.port}/0", **make(server.port, ca)}
    with caplog.at_level(logging.DEBUG, logger="kvsdk"):
        b = backend(opts.pop("url"), **opts, **FAST)
        opts["url"] = b.options.url
        assert b.get([key(1)]) == [None] and b.put([(key(2), payload(2))]) == [False]
        assert b.error_count() >= 1
    assert any(s in caplog.text for s in says), caplog.text
    tls = how == "untrusted-certificate"
    assert ("failed the TLS handshake" if tls else "refused this client's credentials") in (
        caplog.text
    )
    out = inspect_cli(tmp_path, opts)
    assert out.returncode == 1
    assert "tiers[1] (redis)" in out.stderr and any(s in out.stderr for s in says), out.stderr
    text = " ".join([out.stdout, out.stderr, caplog.text, repr(b), repr(b.options)])
    assert not leaked(text, PASSWORD, WRONG)
    b.close()


# -- cluster -------------------------------------------------------------------------------------------


@pytest.fixture
def cluster_raw(redis_cluster: RedisClusterNodes) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.url)
    yield client
    client.close()


def test_cluster_round_trip_spreads_over_nodes(
    redis_cluster: RedisClusterNodes, cluster_raw: RedisCluster
) -> None:
    b = backend(redis_cluster.url, cluster=True)
    assert all(b.put([(key(i), payload(i)) for i in range(60)]))
    assert hits(b, 60) == 60 and b.exists([key(0), key(999)]) == [True, False]
    assert all(int(n.cli("DBSIZE")) > 0 for n in redis_cluster.nodes)
    assert b.delete([key(0), key(1)]) == 2
    b.clear()
    assert hits(b, 60) == 0 and sum(int(n.cli("DBSIZE")) for n in redis_cluster.nodes) == 0


def test_cluster_garbage_is_a_miss_and_deleted(
    redis_cluster: RedisClusterNodes, cluster_raw: RedisCluster
) -> None:
    b = backend(redis_cluster.url, cluster=True)
    b.put([(key(i), payload(i)) for i in range(10)])
    cluster_raw.set(rkey(key(3)), b"not a frame")
    got = b.get([key(i) for i in range(10)])
    assert got[3] is None and sum(v is not None for v in got) == 9
    assert cluster_raw.exists(rkey(key(3))) == 0 and b.stats()["corrupt"] == 1
    b.clear()


def test_cluster_node_down_misses_its_slots_only_then_recovers(
    redis_cluster: RedisClusterNodes, cluster_raw: RedisCluster
) -> None:
    b = backend(redis_cluster.url, cluster=True, **FAST)
    n = 60
    assert all(b.put([(key(i), payload(i)) for i in range(n)]))
    victim = redis_cluster.nodes[1]
    raw: Any = cluster_raw  # (untyped upstream)
    on_victim = {i for i in range(n) if raw.get_node_from_key(rkey(key(i))).port == victim.port}
    assert 0 < len(on_victim) < n
    victim.kill()
    try:
        for _ in range(3):  # repeatedly: the other nodes keep serving, before and after
            got = b.get([key(i) for i in range(n)])  # the cluster marks the node failed
            assert {i for i, v in enumerate(got) if v is None} == on_victim
            time.sleep(0.3)
        stored = b.put([(key(i), payload(i)) for i in range(n, n + 30)])
        assert 0 < sum(stored) < 30
        assert b.stats()["outages"] >= 1
    finally:
        victim.start()
    # the node comes back empty (no persistence) and rejoins: stores and loads work again
    wait_until(lambda: all(b.put([(key(i), payload(i)) for i in on_victim])), timeout=20)
    assert hits(b, n) == n
    b.clear()
