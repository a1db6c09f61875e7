"""The tiered store over real slower tiers, built from configs as a user writes them.

Chains ``cpu → disk``, ``cpu → redis`` and ``cpu → disk → redis`` come from
config mappings (the YAML equivalent) through ``kvsdk.store.factory.build_store``,
over a real directory and a real ``redis-server`` on a loopback port:

- write-through: a stored chunk reaches every lower tier;
- restart and sharing: a fresh store in a new process (``spawn``) answers
  RETRY, then HIT_PENDING / HIT, with byte-identical slots, and what it stores
  is found by the first instance;
- promotion: a chunk the host tier evicted comes back from a lower tier;
- integrity: flipped, truncated or foreign bytes in a lower tier are misses,
  counted and dropped, never a HIT;
- outages: Redis killed mid-run gives misses and no exception; restarted, it
  is written through and hit again;
- isolation: two namespaces over one directory and one server never see
  each other's chunks, even under identical keys;
- the scheduler thread never waits: with every lower-tier call slowed to
  0.5 s, each ``lookup()`` / ``step()`` / store call returns in a few ms;
- the example configs in ``examples/`` pass ``kvsdk config check`` and build
  working stores.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from redis_server import REDIS_SERVER, RedisServer, missing_tool

from kvsdk.backend import Buffer
from kvsdk.backends.disk import DiskBackend
from kvsdk.backends.redis import RedisBackend
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk
from kvsdk.config import load_config
from kvsdk.events import EventKind, KVEvent
from kvsdk.hooks import hookimpl
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.plugins_manager import plugin_manager
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import ChunkKey, Locality, LookupResult, Medium

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CHUNK = 8192
HOST_SLOTS = 16
TIMEOUT_S = 15.0
HIT, MISS = LookupResult.HIT, LookupResult.MISS
RETRY, PENDING = LookupResult.RETRY, LookupResult.HIT_PENDING
REDIS_FAST: dict[str, Any] = {
    "socket_timeout": 0.5,
    "connect_timeout": 0.5,
    "backoff_initial": 0.05,
    "backoff_max": 0.2,
}
"""Short timeouts and backoff so outage tests recover in well under a second."""
SLOW_S = 0.5
"""Delay of every exists/get/put of the slowed tiers."""
CALL_LIMIT_S = 0.15
"""What "well under" ``SLOW_S`` means for one scheduler-thread call: a call that
waited for the slow tier would take at least ``SLOW_S``; the margin absorbs a
loaded machine's scheduling noise (a few tens of ms)."""


def namespace(model: str = "tiering-model-a", tenant: str = "") -> Namespace:
    return Namespace(
        model=model,
        dtype="float32",
        groups=(GroupLayout((2, CHUNK // 2), "uint8"),),
        tokens_per_chunk=32,
        tenant_salt=tenant,
    )


NS_A = namespace()


def key(i: int) -> ChunkKey:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, salt: int = 0) -> bytes:
    return np.random.default_rng([i, salt]).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


# -- chains ------------------------------------------------------------------------------------


@dataclass
class Chain:
    """One configured tier chain and the stores built from it in this process."""

    name: str
    lower: list[dict[str, Any]]
    disk_dir: Path | None = None
    redis: RedisServer | None = None
    made: list[TieredStore] = field(default_factory=list)

    def config(
        self, host_slots: int = HOST_SLOTS, override: dict[str, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The config mapping (what a YAML file holds); ``override`` replaces
        options of lower tiers by backend name, e.g. ``{"disk": {"path": ...}}``."""
        override = override or {}
        tiers: list[dict[str, Any]] = [
            {"backend": "cpu", "capacity": host_slots * CHUNK, "pin_memory": "never"}
        ]
        for tier in self.lower:
            tiers.append({**tier, **override.get(tier["backend"], {})})
        return {"chunk_tokens": 32, "io_threads": 4, "tiers": tiers}

    def store(
        self,
        ns: Namespace = NS_A,
        host_slots: int = HOST_SLOTS,
        override: dict[str, dict[str, Any]] | None = None,
    ) -> TieredStore:
        store = build_store(load_config(self.config(host_slots, override)), ns, CHUNK)
        self.made.append(store)
        return store

    def tier(self, store: TieredStore, backend: type) -> Any:
        (found,) = [t for t in store.lower if isinstance(t, backend)]
        return found


CHAINS = {"cpu-disk": ["disk"], "cpu-redis": ["redis"], "cpu-disk-redis": ["disk", "redis"]}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()


def make_chain(
    request: pytest.FixtureRequest, tmp_path: Path, name: str, slow: bool = False
) -> Chain:
    lower: list[dict[str, Any]] = []
    chain = Chain(name, lower)
    for backend in CHAINS[name]:
        if backend == "disk":
            chain.disk_dir = tmp_path / "disk"
            lower.append({"backend": "disk", "path": str(chain.disk_dir), "capacity": "64MiB"})
        else:
            chain.redis = request.getfixturevalue("redis_server")
            lower.append({"backend": "redis", "url": chain.redis.url, **REDIS_FAST})
        if slow:
            lower[-1]["backend"] = "slow-" + backend
    return chain


@pytest.fixture
def chains(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Chain]]:
    """``chains(name, slow=False)`` → a chain; its stores are shut down after the test."""
    made: list[Chain] = []

    def make(name: str, slow: bool = False) -> Chain:
        made.append(make_chain(request, tmp_path, name, slow))
        return made[-1]

    yield make
    for c in made:
        for store in c.made:
            store.shutdown()


@pytest.fixture(params=list(CHAINS))
def chain(request: pytest.FixtureRequest, chains: Callable[..., Chain]) -> Chain:
    return chains(request.param)


@pytest.fixture
def stores() -> Iterator[list[TieredStore]]:
    """Stores built directly by a test; shut down after it."""
    made: list[TieredStore] = []
    yield made
    for store in made:
        store.shutdown()


@pytest.fixture(scope="module")
def spawn_pool() -> Iterator[Any]:
    """One helper process started with ``spawn`` (no state inherited from this one)."""
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool


# -- driving a store as an adapter does ------------------------------------------------------------


def save(store: TieredStore, items: dict[ChunkKey, bytes]) -> None:
    """Reserve host slots, copy the bytes in (as a transfer worker would), commit."""
    plan = store.prepare_store(list(items))
    assert plan is not None, "no room in the host tier"
    slab = store.host.slab.numpy()
    for k, slot in zip(plan.keys, plan.slots):
        slab[slot] = np.frombuffer(items[k], dtype=np.uint8)
    store.complete_store(list(plan.keys))


def pump(
    store: TieredStore, timeout: float = TIMEOUT_S, timings: list[float] | None = None
) -> None:
    """``step()`` until every I/O job (write-through, query, promotion) was applied."""
    deadline = time.monotonic() + timeout
    while True:
        start = time.perf_counter()
        store.step()
        if timings is not None:
            timings.append(time.perf_counter() - start)
        if not store.has_pending_work():
            return
        assert time.monotonic() < deadline, "I/O did not finish"
        time.sleep(0.002)


def resolve(
    store: TieredStore,
    keys: Sequence[ChunkKey],
    timeout: float = TIMEOUT_S,
    timings: list[float] | None = None,
) -> dict[ChunkKey, list[LookupResult]]:
    """Look every key up once per step until each answers HIT or MISS.
    Returns each key's answers with consecutive repeats collapsed."""
    answers: dict[ChunkKey, list[LookupResult]] = {k: [] for k in keys}
    todo = list(keys)
    deadline = time.monotonic() + timeout
    while True:
        for k in todo:
            start = time.perf_counter()
            r = store.lookup(k)
            if timings is not None:
                timings.append(time.perf_counter() - start)
            if not answers[k] or answers[k][-1] is not r:
                answers[k].append(r)
        todo = [k for k in todo if answers[k][-1] not in (HIT, MISS)]
        if not todo:
            return answers
        assert time.monotonic() < deadline, {k.hex(): answers[k] for k in todo}
        start = time.perf_counter()
        store.step()
        if timings is not None:
            timings.append(time.perf_counter() - start)
        time.sleep(0.002)


def read(store: TieredStore, k: ChunkKey) -> bytes:
    (slot,) = store.prepare_load([k])
    try:
        return bytes(store.host.slab.numpy()[slot])
    finally:
        store.complete_load([k])


def promoted_pattern(answers: list[LookupResult]) -> bool:
    """RETRY first (a lower tier is asked), then HIT_PENDING while promoting, then HIT."""
    order = {RETRY: 0, PENDING: 1, HIT: 2}
    ranks = [order.get(a, -1) for a in answers]
    return answers[0] is RETRY and answers[-1] is HIT and ranks == sorted(ranks) and -1 not in ranks


def events(store: TieredStore) -> list[KVEvent]:
    return list(store.events.take_events())


def stored_keys(evs: list[KVEvent], tier: int, kind: EventKind = EventKind.STORED) -> set[bytes]:
    return {k for e in evs if e.kind is kind and e.tier == tier for k in e.keys}


def disk_file(disk_dir: Path, ns: Namespace, k: ChunkKey) -> Path:
    (found,) = (disk_dir / ns.hex).rglob(k.hex() + ".kvc")
    return found


def rkey(ns: Namespace, k: ChunkKey) -> str:
    return f"kvsdk:{ns.hex}:{k.hex()}"


def redis_client(server: RedisServer) -> Any:
    import redis

    return redis.Redis.from_url(server.url)


MEDIUM = {"disk": (Medium.DISK, Locality.NODE), "redis": (Medium.REMOTE, Locality.CLUSTER)}


# -- write-through ---------------------------------------------------------------------------------


def test_a_stored_chunk_is_written_through_to_every_lower_tier(chain: Chain) -> None:
    store = chain.store()
    items = {key(i): payload(i) for i in range(8)}
    save(store, items)
    pump(store)
    evs = events(store)
    assert stored_keys(evs, 0) == set(items)
    for t, (tier, backend) in enumerate(zip(store.lower, CHAINS[chain.name]), start=1):
        assert tier.exists(list(items)) == [True] * 8, backend
        assert [bytes(v or b"") for v in tier.get(list(items))] == list(items.values())
        assert stored_keys(evs, t) == set(items), backend
        assert {(e.medium, e.locality) for e in evs if e.tier == t} == {MEDIUM[backend]}
        assert store.metrics.counter("kvsdk_stored_bytes_total", tier=t) == 8 * CHUNK
    if chain.disk_dir is not None:
        assert {p.name for p in chain.disk_dir.rglob("*.kvc")} == {k.hex() + ".kvc" for k in items}
    if chain.redis is not None:
        client = redis_client(chain.redis)
        assert sorted(client.keys(f"kvsdk:{NS_A.hex}:*")) == sorted(
            rkey(NS_A, k).encode() for k in items
        )
        client.close()
    assert store.host.num_used == 8  # write-through leaves the host copies in place
    assert all(store.lookup(k) is HIT for k in items)


# -- restart persistence and sharing across processes -----------------------------------------------


def instance_in_new_process(
    config: dict[str, Any], read_keys: list[bytes], write: dict[bytes, bytes]
) -> dict[str, Any]:
    """Runs in the spawned helper: a fresh store over the same tiers reads
    ``read_keys``, then stores ``write`` (written through before it returns)."""
    store = build_store(load_config(config), NS_A, CHUNK)
    try:
        answers = resolve(store, read_keys)
        got = {k: read(store, k) for k in read_keys if answers[k][-1] is HIT}
        save(store, write)
        pump(store)
        return {
            "pid": os.getpid(),
            "answers": {k: [a.name for a in v] for k, v in answers.items()},
            "bytes": got,
            "loaded": {
                t: store.metrics.counter("kvsdk_loaded_bytes_total", tier=t)
                for t in range(1, len(store.tiers))
            },
        }
    finally:
        store.shutdown()


def test_restart_and_sharing_between_processes(
    chain: Chain, spawn_pool: Any, tmp_path: Path
) -> None:
    first = chain.store()
    mine = {key(i): payload(i) for i in range(6)}
    save(first, mine)
    pump(first)

    # the other instance runs in another process; with disk and redis it stands
    # for another machine: its own (empty) disk, the shared redis
    other_machine = chain.name == "cpu-disk-redis"
    override = {"disk": {"path": str(tmp_path / "other-disk")}} if other_machine else {}
    theirs = {key(100 + i): payload(100 + i) for i in range(4)}
    job = spawn_pool.apply_async(
        instance_in_new_process, (chain.config(override=override), list(mine), theirs)
    )
    res = job.get(timeout=60)
    assert res["pid"] != os.getpid()
    for k in mine:
        answers = [LookupResult[a] for a in res["answers"][k]]
        assert promoted_pattern(answers), answers
        assert res["bytes"][k] == mine[k]
    source = len(CHAINS[chain.name])  # other machine: redis; else the first lower tier
    assert res["loaded"][source if other_machine else 1] == len(mine) * CHUNK

    # the first instance, still running, finds what the other one stored
    found = resolve(first, list(theirs))
    assert all(promoted_pattern(a) for a in found.values()), found
    assert [read(first, k) for k in theirs] == list(theirs.values())

    # restart: a new instance over the first one's tiers serves both sets
    first.shutdown()
    chain.made.remove(first)
    again = chain.store()
    both = {**mine, **theirs}
    found = resolve(again, list(both))
    assert all(promoted_pattern(a) for a in found.values()), found
    assert [read(again, k) for k in both] == list(both.values())


# -- promotion after host eviction ---------------------------------------------------------------


def test_host_eviction_then_promotion_from_a_lower_tier(chain: Chain) -> None:
    store = chain.store(host_slots=4)
    first = {key(i): payload(i) for i in range(4)}
    later = {key(i): payload(i) for i in range(4, 8)}
    save(store, first)
    pump(store)  # written through, unpinned: evictable
    save(store, later)
    pump(store)
    evs = events(store)
    assert stored_keys(evs, 0, EventKind.REMOVED) == set(first)  # evicted from host RAM
    assert all(store.lookup(k) is HIT for k in later)

    lost_from_disk: set[bytes] = set()
    if chain.name == "cpu-disk-redis":  # half of them only redis still has
        assert chain.disk_dir is not None
        lost_from_disk = set(list(first)[:2])
        for k in lost_from_disk:
            disk_file(chain.disk_dir, NS_A, k).unlink()

    answers = resolve(store, list(first))
    assert all(promoted_pattern(a) for a in answers.values()), answers
    assert [read(store, k) for k in first] == list(first.values())
    evs = events(store)
    assert stored_keys(evs, 0) == set(first)  # promoted: stored in the host tier again
    assert stored_keys(evs, 0, EventKind.REMOVED) == set(later)  # room made for them
    n_lower = len(store.lower)
    loaded = [store.metrics.counter("kvsdk_loaded_bytes_total", tier=t) for t in (1, n_lower)]
    if lost_from_disk:
        assert loaded == [2 * CHUNK, 2 * CHUNK]  # two from disk, two from redis
    else:
        assert loaded[0] == 4 * CHUNK


# -- integrity --------------------------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["cpu-disk", "cpu-disk-redis"])
def test_corrupt_disk_files_are_misses_never_hits(name: str, chains: Callable[..., Chain]) -> None:
    chain = chains(name)
    assert chain.disk_dir is not None
    writer = chain.store()
    items = {key(i): payload(i) for i in range(4)}
    save(writer, items)
    pump(writer)
    k_payload, k_header, k_short, k_good = items
    flip(disk_file(chain.disk_dir, NS_A, k_payload), HEADER_SIZE + 1000)
    flip(disk_file(chain.disk_dir, NS_A, k_header), 20)  # inside the namespace field
    short = disk_file(chain.disk_dir, NS_A, k_short)
    short.write_bytes(short.read_bytes()[: HEADER_SIZE + CHUNK // 2])
    if chain.redis is not None:  # redis keeps no copy: the disk entry is all there is
        client = redis_client(chain.redis)
        client.delete(*(rkey(NS_A, k) for k in items))
        client.close()

    store = chain.store()
    answers = resolve(store, list(items))
    for k in (k_payload, k_header, k_short):
        assert HIT not in answers[k] and answers[k][-1] is MISS, answers[k]
        assert not list(chain.disk_dir.rglob(k.hex() + ".kvc")), "a bad entry must be dropped"
    assert promoted_pattern(answers[k_good]) and read(store, k_good) == items[k_good]
    disk = chain.tier(store, DiskBackend)
    assert disk.stats()["corrupt"] == 3
    assert store.host.num_used == 1  # the slots reserved for the bad ones were freed


def test_a_corrupt_disk_copy_falls_back_to_the_redis_copy(chains: Callable[..., Chain]) -> None:
    chain = chains("cpu-disk-redis")
    assert chain.disk_dir is not None
    writer = chain.store()
    save(writer, {key(1): payload(1)})
    pump(writer)
    flip(disk_file(chain.disk_dir, NS_A, key(1)), HEADER_SIZE + 5)

    store = chain.store()
    store.ABSENT_TTL_S = 0.05  # ask again soon after the miss
    first = resolve(store, [key(1)])[key(1)]
    assert HIT not in first and first[-1] is MISS  # the disk copy was bad: dropped
    deadline = time.monotonic() + TIMEOUT_S
    while store.lookup(key(1)) is not HIT:
        assert time.monotonic() < deadline, "never served from redis"
        store.step()
        time.sleep(0.005)
    assert read(store, key(1)) == payload(1)
    assert store.metrics.counter("kvsdk_loaded_bytes_total", tier=2) == CHUNK


def test_garbage_planted_in_redis_is_a_miss_never_a_hit(chains: Callable[..., Chain]) -> None:
    chain = chains("cpu-redis")
    assert chain.redis is not None
    writer = chain.store()
    items = {key(i): payload(i) for i in range(4)}
    save(writer, items)
    pump(writer)
    k_garbage, k_foreign, k_flipped, k_good = items
    k_planted = key(50)  # never stored by kvsdk at all
    client = redis_client(chain.redis)
    ns_b = namespace("tiering-model-b")
    good_frame = bytearray(client.get(rkey(NS_A, k_flipped)))
    good_frame[HEADER_SIZE + 10] ^= 0x01
    client.set(rkey(NS_A, k_garbage), b"\x00garbage" * 100)
    client.set(rkey(NS_A, k_foreign), encode_chunk(ns_b.fingerprint, k_foreign, payload(9)))
    client.set(rkey(NS_A, k_flipped), bytes(good_frame))
    client.set(rkey(NS_A, k_planted), b"KVSDK" + os.urandom(CHUNK))

    store = chain.store()
    bad = [k_garbage, k_foreign, k_flipped, k_planted]
    answers = resolve(store, [*bad, k_good])
    for k in bad:
        assert HIT not in answers[k] and answers[k][-1] is MISS, answers[k]
        assert client.exists(rkey(NS_A, k)) == 0, "a bad value must be deleted"
    assert promoted_pattern(answers[k_good]) and read(store, k_good) == items[k_good]
    assert chain.tier(store, RedisBackend).stats()["corrupt"] == len(bad)
    assert store.host.num_used == 1
    client.close()


def test_corrupt_chunks_are_counted_in_the_store_metrics(chains: Callable[..., Chain]) -> None:
    chain = chains("cpu-disk")
    assert chain.disk_dir is not None
    writer = chain.store()
    save(writer, {key(1): payload(1)})
    pump(writer)
    flip(disk_file(chain.disk_dir, NS_A, key(1)), HEADER_SIZE + 5)
    store = chain.store()
    assert resolve(store, [key(1)])[key(1)][-1] is MISS
    assert chain.tier(store, DiskBackend).stats()["corrupt"] == 1
    assert store.metrics.counter("kvsdk_corrupt_chunks_total") == 1


# -- Redis outage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cpu-redis", "cpu-disk-redis"])
def test_redis_killed_mid_run_gives_misses_then_recovers(
    name: str, chains: Callable[..., Chain], tmp_path: Path
) -> None:
    chain = chains(name)
    server = chain.redis
    assert server is not None
    store = chain.store()
    before = {key(i): payload(i) for i in range(4)}
    save(store, before)
    pump(store)
    client = redis_client(server)
    assert client.exists(*(rkey(NS_A, k) for k in before)) == 4
    client.close()

    server.kill()
    during = {key(i): payload(i) for i in range(10, 14)}
    save(store, during)  # write-through to a dead server: refused, no exception
    pump(store)
    rtier = chain.tier(store, RedisBackend)
    assert rtier.stats()["put_failures"] >= len(during)
    assert all(store.lookup(k) is HIT for k in during)  # the host tier keeps serving

    fresh = chain.store()
    answers = resolve(fresh, list(before))
    if name == "cpu-redis":
        assert all(a[-1] is MISS and HIT not in a for a in answers.values()), answers
    else:  # the disk tier keeps serving while redis is down
        assert all(promoted_pattern(a) for a in answers.values()), answers
        assert [read(fresh, k) for k in before] == list(before.values())

    server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + TIMEOUT_S
    client = redis_client(server)
    probe = 20
    while True:  # the first writes may still meet the breaker's backoff
        save(store, {key(probe): payload(probe)})
        pump(store)
        if client.exists(rkey(NS_A, key(probe))):
            break
        assert time.monotonic() < deadline, "write-through never resumed"
        probe += 1
        time.sleep(0.05)
    after = {key(i): payload(i) for i in range(40, 44)}
    save(store, after)
    pump(store)
    assert client.exists(*(rkey(NS_A, k) for k in after)) == 4  # write-through resumed
    client.close()

    reader = chain.store(override={"disk": {"path": str(tmp_path / "empty-disk")}})
    answers = resolve(reader, list(after))
    assert all(promoted_pattern(a) for a in answers.values()), answers
    assert [read(reader, k) for k in after] == list(after.values())
    assert reader.metrics.counter("kvsdk_loaded_bytes_total", tier=len(reader.lower)) == 4 * CHUNK


# -- namespaces --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other", [namespace("tiering-model-b"), namespace(tenant="tenant-2")], ids=["model", "tenant"]
)
def test_two_namespaces_over_one_dir_and_one_redis_never_cross(
    other: Namespace, chains: Callable[..., Chain]
) -> None:
    chain = chains("cpu-disk-redis")
    assert chain.disk_dir is not None and chain.redis is not None
    assert other.fingerprint != NS_A.fingerprint
    keys = [key(i) for i in range(6)]  # the same key bytes in both namespaces
    a = chain.store(NS_A)
    b = chain.store(other)
    save(a, {k: payload(i, salt=1) for i, k in enumerate(keys)})
    pump(a)
    answers = resolve(b, keys)
    assert all(v == [RETRY, MISS] for v in answers.values()), answers
    save(b, {k: payload(i, salt=2) for i, k in enumerate(keys)})
    pump(b)

    for ns, salt in ((NS_A, 1), (other, 2)):  # fresh instances: each sees its own bytes
        s = chain.store(ns)
        answers = resolve(s, keys)
        assert all(promoted_pattern(v) for v in answers.values()), answers
        assert [read(s, k) for k in keys] == [payload(i, salt=salt) for i in range(6)]
    assert sorted(p.name for p in chain.disk_dir.iterdir()) == sorted([NS_A.hex, other.hex])
    client = redis_client(chain.redis)
    for ns in (NS_A, other):
        assert len(client.keys(f"kvsdk:{ns.hex}:*")) == 6
    client.close()


# -- the scheduler thread never waits on a slow tier ---------------------------------------------------


class _Slow:
    """Mixin: every lower-tier data call sleeps ``SLOW_S`` first (on the I/O thread)."""

    slowed: list[str]

    def _slow(self, op: str) -> None:
        self.slowed.append(op)
        time.sleep(SLOW_S)


class SlowDisk(_Slow, DiskBackend):
    name = "slow-disk"
    slowed: list[str] = []

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._slow("exists")
        return super().exists(keys)

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._slow("get")
        return super().get(keys)

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        self._slow("get")
        return super().get_into(keys, outs)

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._slow("put")
        return super().put(items)


class SlowRedis(_Slow, RedisBackend):
    name = "slow-redis"
    slowed: list[str] = []

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._slow("exists")
        return super().exists(keys)

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._slow("get")
        return super().get(keys)

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._slow("put")
        return super().put(items)


class _SlowTiers:
    @hookimpl
    def kvsdk_backends(self) -> dict[str, type]:
        return {"slow-disk": SlowDisk, "slow-redis": SlowRedis}


@pytest.fixture
def slow_backends() -> Iterator[None]:
    plugin = _SlowTiers()
    plugin_manager().register(plugin, name="test-tiering-slow-tiers")
    SlowDisk.slowed.clear()
    SlowRedis.slowed.clear()
    try:
        yield
    finally:
        plugin_manager().unregister(plugin)


@pytest.mark.parametrize("name", list(CHAINS))
def test_the_scheduler_thread_never_waits_for_a_slow_tier(
    name: str, slow_backends: None, chains: Callable[..., Chain]
) -> None:
    chain = chains(name, slow=True)
    calls: list[float] = []

    def timed(fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        calls.append(time.perf_counter() - start)
        return out

    writer = chain.store()
    items = {key(i): payload(i) for i in range(6)}
    plan = timed(writer.prepare_store, list(items))
    slab = writer.host.slab.numpy()
    for k, slot in zip(plan.keys, plan.slots):
        slab[slot] = np.frombuffer(items[k], dtype=np.uint8)
    timed(writer.complete_store, list(plan.keys))
    started = time.monotonic()
    pump(writer, timings=calls)  # write-through: >= SLOW_S per lower tier
    assert time.monotonic() - started >= SLOW_S * 0.9

    reader = chain.store()
    started = time.monotonic()
    answers = resolve(reader, list(items), timings=calls)  # exists, then get: >= 2 x SLOW_S
    assert time.monotonic() - started >= 2 * SLOW_S * 0.9
    assert all(promoted_pattern(a) for a in answers.values()), answers
    assert [timed(read, reader, k) for k in items] == list(items.values())
    assert len(calls) > 50
    slowed = SlowDisk.slowed + SlowRedis.slowed
    assert {"exists", "get", "put"} <= set(slowed)
    assert max(calls) < CALL_LIMIT_S, f"slowest call {max(calls) * 1e3:.1f} ms"


def test_reset_does_not_wait_for_a_slow_tier(
    slow_backends: None, chains: Callable[..., Chain]
) -> None:
    chain = chains("cpu-disk", slow=True)
    store = chain.store()
    save(store, {key(i): payload(i) for i in range(4)})  # write-through now in flight
    start = time.perf_counter()
    store.reset()
    took = time.perf_counter() - start
    assert all(store.lookup(key(i)) is not HIT for i in range(4))
    assert took < CALL_LIMIT_S, f"reset() took {took * 1e3:.0f} ms"


# -- example configs ---------------------------------------------------------------------------------

EXAMPLE_CHAINS = {
    "kvsdk-disk.yaml": ["cpu", "disk"],
    "kvsdk-redis.yaml": ["cpu", "redis"],
    "kvsdk-tiered.yaml": ["cpu", "disk", "redis"],
}


def test_example_configs_pass_kvsdk_config_check() -> None:
    script = shutil.which("kvsdk", path=str(Path(sys.executable).parent))
    if script is None:
        missing_tool("the kvsdk console script is not installed next to this interpreter")
    procs = {
        name: subprocess.Popen(
            [script, "config", "check", str(EXAMPLES / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in EXAMPLE_CHAINS
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err)
        assert f"OK (tiers: {', '.join(EXAMPLE_CHAINS[name])};" in out, out


@pytest.mark.parametrize("name", list(EXAMPLE_CHAINS))
def test_example_configs_build_working_stores(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, stores: list[TieredStore]
) -> None:
    """Each example, with its path / URL pointed at this test's directory and
    server (and a small host tier), stores, writes through and serves a restart."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    assert [t["backend"] for t in data["tiers"]] == EXAMPLE_CHAINS[name]
    for tier in data["tiers"]:
        if tier["backend"] == "cpu":
            tier["capacity"] = "1MiB"
        elif tier["backend"] == "disk":
            tier["path"] = str(tmp_path / "disk")
        elif tier["backend"] == "redis":
            tier["url"] = request.getfixturevalue("redis_server").url
    config = load_config(data)
    writer = build_store(config, NS_A, CHUNK)
    stores.append(writer)
    items = {key(i): payload(i) for i in range(3)}
    save(writer, items)
    pump(writer)
    reader = build_store(config, NS_A, CHUNK)
    stores.append(reader)
    answers = resolve(reader, list(items))
    assert all(promoted_pattern(a) for a in answers.values()), answers
    assert [read(reader, k) for k in items] == list(items.values())
