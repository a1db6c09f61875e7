"""The redis tier's local index (``may_contain``) against real ``redis-server``
processes: kept current across processes through the namespace's channel,
seeded by a scan, never False before that scan, corrected by what reads find,
and rebuilt after a flush, a restart or a dropped subscription."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import (  # noqa: F401  (fixtures)
    FAST,
    RedisClusterNodes,
    RedisServer,
    key,
    needs_redis,
    payload,
    redis_cluster_fixture,
    redis_server_fixture,
    redis_tools_fixture,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = [pytest.mark.integration, needs_redis]

NS = hashlib.blake2b(b"index", digest_size=16).digest()
SEEN_WITHIN_S = 2.0
"""How soon another process's put must show in an index (measured: milliseconds)."""


def backend(url: str, **options: Any) -> RedisBackend:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=1 << 20)
    return RedisBackend(RedisOptions(url=url, **{**FAST, **options}), ctx)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what or 'condition'} not met within {timeout}s")
        time.sleep(0.01)
    return time.monotonic() - start


def seeded(b: RedisBackend) -> bool:
    return b.stats().get("index_seeded") == 1.0


def keys(r: range) -> list[bytes]:
    return [key(i) for i in r]


def put(b: RedisBackend, r: range) -> None:
    assert b.put([(key(i), payload(i)) for i in r]) == [True] * len(r)


@pytest.fixture
def tiers(redis_server: RedisServer) -> Iterator[Callable[..., RedisBackend]]:
    made: list[RedisBackend] = []

    def make(**options: Any) -> RedisBackend:
        b = backend(redis_server.url, **options)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def hold(monkeypatch: Any, b: RedisBackend, method: str) -> threading.Event:
    """Make ``b``'s index reader wait before each call of ``method`` while the
    returned event is set (it is, until the test clears it)."""
    index: Any = b._index
    held = threading.Event()
    real = getattr(index, method)

    def waiting(*args: Any, **kwargs: Any) -> Any:
        while held.is_set():
            time.sleep(0.01)
        return real(*args, **kwargs)

    held.set()
    monkeypatch.setattr(index, method, waiting)
    return held


def _put_in_child(url: str, start: int, n: int) -> float:
    b = backend(url)
    put(b, range(start, start + n))
    done = time.time()
    b.close()
    return done


def test_another_process_put_shows_within_a_short_time(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend]
) -> None:
    b = tiers()
    wait_until(lambda: seeded(b), what="the seed")
    assert b.may_contain(keys(range(40))) == [False] * 40  # stored nowhere: no round trip
    with mp.get_context("fork").Pool(1) as pool:
        stored_at = pool.apply(_put_in_child, (redis_server.url, 0, 40))
    waited = wait_until(lambda: all(b.may_contain(keys(range(40)))), SEEN_WITHIN_S,
                        "another process's keys in the index")  # fmt: skip
    lag = time.time() - stored_at
    assert lag < SEEN_WITHIN_S, f"seen {lag:.3f}s after the other process's put ({waited:.3f})"
    assert b.may_contain(keys(range(40, 50))) == [False] * 10
    assert b.stats()["index_entries"] == 40


def test_this_process_put_shows_at_once_and_never_stored_keys_are_false(
    tiers: Callable[..., RedisBackend],
) -> None:
    a = tiers()
    wait_until(lambda: seeded(a), what="the seed")
    put(a, range(10))
    assert a.may_contain(keys(range(12))) == [True] * 10 + [False] * 2


def test_before_its_first_seed_the_index_answers_true_for_every_key(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend]
) -> None:
    redis_server.pause()  # the seed cannot run
    try:
        b = tiers()
        time.sleep(0.5)
        assert not seeded(b)
        assert b.may_contain(keys(range(5))) == [True] * 5  # never False from no index
    finally:
        redis_server.resume()
    wait_until(lambda: seeded(b), what="the seed after the server answered again")
    assert b.may_contain(keys(range(5))) == [False] * 5


def test_the_seed_finds_keys_stored_before_the_index_started(
    tiers: Callable[..., RedisBackend],
) -> None:
    put(tiers(local_index=False), range(300))
    b = tiers()
    wait_until(lambda: seeded(b), what="the seed")
    assert all(b.may_contain(keys(range(300))))
    assert not any(b.may_contain(keys(range(300, 400))))
    assert b.stats()["index_entries"] == 300


def test_a_key_deleted_behind_its_back_is_a_miss_then_false(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend]
) -> None:
    b = tiers()
    put(b, range(4))
    wait_until(lambda: seeded(b), what="the seed")
    raw = redis.Redis.from_url(redis_server.url)
    prefix = f"kvsdk:{NS.hex()}:"
    raw.delete(prefix + key(0).hex(), prefix + key(1).hex())  # evicted, expired, deleted
    raw.close()
    assert b.may_contain(keys(range(4))) == [True] * 4  # it cannot know yet
    assert b.exists([key(0)]) == [False]
    assert b.get([key(1), key(2)])[0] is None
    assert b.may_contain(keys(range(4))) == [False, False, True, True]


def test_a_delete_by_another_instance_is_published(tiers: Callable[..., RedisBackend]) -> None:
    a, b = tiers(), tiers()
    put(a, range(6))
    wait_until(lambda: seeded(b) and all(b.may_contain(keys(range(6)))), what="the keys in b")
    assert a.delete([key(0), key(1)]) == 2
    wait_until(lambda: b.may_contain(keys(range(2))) == [False, False], SEEN_WITHIN_S,
               "the deletion in b")  # fmt: skip
    a.clear()
    wait_until(lambda: not any(b.may_contain(keys(range(6)))), SEEN_WITHIN_S, "the clear in b")


def test_a_flushed_server_makes_the_index_rescan(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend]
) -> None:
    a, b = tiers(), tiers()
    put(a, range(20))
    wait_until(lambda: seeded(b) and all(b.may_contain(keys(range(20)))), what="the keys in b")
    resyncs = b.stats()["index_resyncs"]
    redis_server.cli("FLUSHALL")
    wait_until(lambda: b.stats()["index_resyncs"] > resyncs and seeded(b), what="a rescan")
    assert not any(b.may_contain(keys(range(20))))  # gone with the flush
    put(a, range(100, 110))  # and the stream goes on
    wait_until(lambda: all(b.may_contain(keys(range(100, 110)))), SEEN_WITHIN_S, "new keys")


def test_a_restarted_server_makes_the_index_rescan(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend], monkeypatch: Any
) -> None:
    a, b = tiers(), tiers()
    put(a, range(20))
    wait_until(lambda: seeded(b) and all(b.may_contain(keys(range(20)))), what="the keys in b")
    resyncs = b.stats()["index_resyncs"]
    held = hold(monkeypatch, b, "_seed")  # the rescan waits until the key below is stored
    redis_server.kill()
    redis_server.start()  # same port, empty
    raw = redis.Redis.from_url(redis_server.url)
    prefix = f"kvsdk:{NS.hex()}:"
    raw.set(prefix + key(50).hex(), b"x")  # stored while b was away (not published)
    raw.close()
    held.clear()
    wait_until(lambda: b.stats()["index_resyncs"] > resyncs and seeded(b), what="a rescan")
    assert not any(b.may_contain(keys(range(20))))
    assert b.may_contain([key(50)]) == [True]
    wait_until(lambda: a.put([(key(60), payload(60))]) == [True], what="a's writes again")
    wait_until(lambda: b.may_contain([key(60)]) == [True], SEEN_WITHIN_S, "a new key")


def test_a_subscriber_the_server_dropped_rescans_and_finds_what_it_missed(
    redis_server: RedisServer, tiers: Callable[..., RedisBackend], monkeypatch: Any
) -> None:
    a, b = tiers(), tiers()
    wait_until(lambda: seeded(b), what="the seed")
    resyncs = b.stats()["index_resyncs"]
    held = hold(monkeypatch, b, "_seed")  # the rescan waits until a has stored
    redis_server.cli("CLIENT", "KILL", "TYPE", "pubsub")  # as for an output buffer overrun
    wait_until(lambda: not seeded(b), what="the index to notice")
    assert b.may_contain(keys(range(10))) == [True] * 10  # incomplete: ask
    put(a, range(10))  # published while nobody listened
    held.clear()
    wait_until(lambda: b.stats()["index_resyncs"] > resyncs and seeded(b), what="a rescan")
    assert b.may_contain(keys(range(12))) == [True] * 10 + [False] * 2


def test_a_full_index_forgets_its_oldest_keys_and_counts_them(
    tiers: Callable[..., RedisBackend],
) -> None:
    b = tiers(local_index_max_entries=10)
    wait_until(lambda: seeded(b), what="the seed")
    put(b, range(25))
    s = b.stats()
    assert s["index_entries"] == 10 and s["index_dropped"] == 15
    assert b.may_contain(keys(range(25))) == [False] * 15 + [True] * 10
    assert [v is not None for v in b.get(keys(range(25)))] == [True] * 25  # still served


def test_without_local_index_every_key_may_be_there(tiers: Callable[..., RedisBackend]) -> None:
    on, off = tiers(), tiers(local_index=False)
    wait_until(lambda: seeded(on), what="the seed")
    assert on.may_contain(keys(range(3))) == [False] * 3
    assert off.may_contain(keys(range(3))) == [True] * 3
    assert "index_entries" not in off.stats()


def test_on_a_cluster_the_index_seeds_from_every_master_and_follows_puts(
    redis_cluster: RedisClusterNodes, tmp_path: Path
) -> None:
    ns = hashlib.blake2b(tmp_path.name.encode(), digest_size=16).digest()
    ctx = TierContext(namespace_fp=ns, namespace_hex=ns.hex(), chunk_bytes=1 << 20)

    def tier() -> RedisBackend:
        # the tier's default timeouts: nothing fails here, and a loaded machine
        # can take longer than FAST's 0.3 s to answer a cluster read
        return RedisBackend(RedisOptions(url=redis_cluster.url, cluster=True), ctx)

    a = tier()
    put(a, range(200))  # spread over the three masters
    owners = {redis_cluster.nodes[0].cli("CLUSTER", "KEYSLOT", f"kvsdk:{ns.hex()}:{key(i).hex()}")
              for i in range(200)}  # fmt: skip
    assert len(owners) > 3
    b = tier()
    try:
        wait_until(lambda: seeded(b), what="the seed")
        assert all(b.may_contain(keys(range(200))))  # found on every master
        assert not any(b.may_contain(keys(range(200, 300))))
        put(a, range(300, 340))
        wait_until(lambda: all(b.may_contain(keys(range(300, 340)))), SEEN_WITHIN_S,
                   "a's keys in b")  # fmt: skip
        assert b.exists([key(0)]) == [True]
    finally:
        a.clear()
        a.close()
        b.close()


def test_a_user_refused_info_still_gets_an_index(redis_tools: None, tmp_path: Path) -> None:
    acl = ["--user", "idx", "on", ">pw-1", "~kvsdk:*", "&kvsdk:*", "+@all", "-info"]
    server = RedisServer(tmp_path, args=acl).start()
    try:
        a = backend(server.url, username="idx", password="pw-1")
        b = backend(server.url, username="idx", password="pw-1")
        wait_until(lambda: seeded(b), what="the seed")
        put(a, range(5))
        wait_until(lambda: all(b.may_contain(keys(range(5)))), SEEN_WITHIN_S, "a's keys in b")
        assert b.may_contain([key(9)]) == [False]
        a.close()
        b.close()
    finally:
        server.kill()


_FORKED: list[RedisBackend] = []
"""The tier a forked child inherits (a tier does not pickle)."""


def _may_contain_in_child(k: bytes) -> bool:
    return _FORKED[0].may_contain([k])[0]


def test_a_forked_child_without_the_reader_asks_for_every_key(
    tiers: Callable[..., RedisBackend],
) -> None:
    b = tiers()
    wait_until(lambda: seeded(b), what="the seed")
    assert b.may_contain([key(7)]) == [False]
    _FORKED[:] = [b]
    with mp.get_context("fork").Pool(1) as pool:  # (its index would never hear of new keys)
        assert pool.apply(_may_contain_in_child, (key(7),)) is True
    _FORKED.clear()
