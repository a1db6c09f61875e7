"""The ``mooncake`` tier against a real Mooncake Store on loopback: a master and a
``mooncake_client`` holder contributing memory (``mooncake_server.py``).

The public conformance suite (with raw access, so framing and corruption are
checked too), a round trip between two processes, the put/get semantics the
tier relies on, corrupt and foreign frames, a master killed and brought back
(misses within the deadline, then the breaker skipping the store), and a full
segment refusing puts."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mooncake_server import (  # noqa: F401  (fixtures)
    MooncakeCluster,
    free_port,
    mooncake_cluster_fixture,
    needs_mooncake,
    start_cluster,
)

from kvsdk.backend import Backend, TierContext
from kvsdk.backends.mooncake import MooncakeBackend, MooncakeOptions
from kvsdk.backends.mooncake_client import address_of
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk
from kvsdk.testing import BackendConformance, BackendFactory, checks
from kvsdk.types import ChunkKey

pytestmark = [pytest.mark.integration, needs_mooncake]

CHUNK = 1 << 20


def ns(label: str) -> bytes:
    return hashlib.blake2b(label.encode(), digest_size=16).digest()


def ctx(namespace: bytes, chunk_bytes: int = CHUNK) -> TierContext:
    return TierContext(namespace_fp=namespace, namespace_hex=namespace.hex(),
                       chunk_bytes=chunk_bytes)  # fmt: skip


def key(i: int) -> ChunkKey:
    return hashlib.blake2b(f"key/{i}".encode(), digest_size=16).digest()


def payload(i: int, size: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


class RawClient:
    """A plain Mooncake client (no kvsdk) on the cluster: reads and replaces objects."""

    def __init__(self, master: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        assert self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0

    def read(self, name: str) -> bytes | None:
        size = self.client.get_size(name)
        if size < 0:
            return None
        buf = bytearray(max(size, 1))
        n = self.client.batch_get_into([name], [address_of(buf)], [size])[0]
        return bytes(buf[:size]) if n == size else None

    def write(self, name: str, data: bytes) -> None:
        self.client.remove(name, True)
        buf = bytearray(data)  # (Mooncake refuses an empty object)
        assert self.client.put_from(name, address_of(buf), len(buf)) == 0

    def close(self) -> None:
        self.client.close()


class MooncakeRaw:
    """``kvsdk.testing.RawAccess`` through a plain client."""

    def __init__(self) -> None:
        self.clients: dict[str, RawClient] = {}

    def _client(self, backend: Backend) -> RawClient:
        assert isinstance(backend, MooncakeBackend)
        master = backend.options.master
        if master not in self.clients:
            self.clients[master] = RawClient(master)
        return self.clients[master]

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        assert isinstance(backend, MooncakeBackend)
        return self._client(backend).read(backend._mkey(key))

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        assert isinstance(backend, MooncakeBackend)
        self._client(backend).write(backend._mkey(key), data)


RAW = MooncakeRaw()


@pytest.fixture
def raw(mooncake_cluster: MooncakeCluster) -> Iterator[RawClient]:
    client = RawClient(mooncake_cluster.master)
    yield client
    client.close()


@pytest.fixture
def make(mooncake_cluster: MooncakeCluster) -> Iterator[Any]:
    """``make(namespace, **options)``: a tier on the module's cluster, closed after."""
    made: list[MooncakeBackend] = []

    def build(namespace: bytes, **overrides: Any) -> MooncakeBackend:
        b = MooncakeBackend(mooncake_cluster.options(**overrides), ctx(namespace))
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


class TestMooncakeConformance(BackendConformance):
    persistent = True  # the holder keeps objects after a client closes
    shared = True
    raw = RAW

    @pytest.fixture
    def backend_factory(self, mooncake_cluster: MooncakeCluster) -> BackendFactory:
        return lambda c: MooncakeBackend(mooncake_cluster.options(), c)

    def test_corrupt_or_foreign_entries_are_deleted_misses(
        self, backend_factory: BackendFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every corruption but an empty value: Mooncake stores no empty object
        (``put`` of 0 bytes is refused), so no such entry can exist to be read."""
        kept = tuple(c for c in checks.CORRUPTIONS if c[0] != "no bytes at all")
        assert len(kept) == len(checks.CORRUPTIONS) - 1
        monkeypatch.setattr(checks, "CORRUPTIONS", kept)
        super().test_corrupt_or_foreign_entries_are_deleted_misses(backend_factory)

    def test_iter_keys_lists_exactly_the_stored_keys(self, backend_factory: BackendFactory) -> None:
        """The Mooncake client cannot list keys: the tier says so (the suite's
        listing check would skip, and a skip fails scripts/test.sh)."""
        b = backend_factory(ctx(checks.NAMESPACE_A))
        try:
            assert MooncakeBackend.supports_listing is False
            with pytest.raises(NotImplementedError):
                next(iter(b.iter_keys()))
            assert MooncakeBackend.inventory(b.options) == []
        finally:
            b.close()


# -- semantics ----------------------------------------------------------------------------


def test_round_trip_between_two_processes(mooncake_cluster: MooncakeCluster, make: Any) -> None:
    """Another process's tier writes 16 x 1 MiB; this one reads them byte-identical."""
    space = ns("two-processes")
    child = textwrap.dedent(f"""
        import hashlib, numpy as np
        from kvsdk.backend import TierContext
        from kvsdk.backends.mooncake import MooncakeBackend, MooncakeOptions
        fp = bytes.fromhex({space.hex()!r})
        b = MooncakeBackend(MooncakeOptions(master={mooncake_cluster.master!r}, timeout=2.0),
                            TierContext(namespace_fp=fp, namespace_hex=fp.hex(),
                                        chunk_bytes={CHUNK}))
        items = [(hashlib.blake2b(f"key/{{i}}".encode(), digest_size=16).digest(),
                  np.random.default_rng(i).integers(0, 256, {CHUNK}, dtype=np.uint8).tobytes())
                 for i in range(16)]
        assert b.put(items) == [True] * 16
        b.close()
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    b = make(space)
    assert b.exists([key(i) for i in range(16)]) == [True] * 16
    slab = np.zeros((16, CHUNK), dtype=np.uint8)
    assert b.get_into([key(i) for i in range(16)], [memoryview(r) for r in slab]) == [True] * 16
    for i in range(16):
        assert slab[i].tobytes() == payload(i, CHUNK)
    got = b.get([key(3), key(99)])
    assert got[1] is None and got[0] is not None and bytes(got[0]) == payload(3, CHUNK)


def test_put_of_a_stored_key_keeps_the_first_value(make: Any) -> None:
    b = make(ns("keep-first"))
    assert b.put([(key(1), payload(1))]) == [True]
    assert b.put([(key(1), payload(2)), (key(2), payload(2))]) == [True, True]
    got = b.get([key(1), key(2)])
    assert [bytes(v) for v in got if v is not None] == [payload(1), payload(2)]
    assert b.stats()["puts"] == 3


def test_get_into_another_size_is_a_miss_and_keeps_the_entry(make: Any) -> None:
    b = make(ns("sizes"))
    assert b.put([(key(1), payload(1, 1000))]) == [True]
    big, small = bytearray(4096), bytearray(10)
    assert b.get_into([key(1), key(1)], [memoryview(big), memoryview(small)]) == [False, False]
    # one at a time: read straight into place, Mooncake refuses both sizes (-800, -600)
    assert b.get_into([key(1)], [memoryview(big)]) == [False]
    assert b.get_into([key(1)], [memoryview(small)]) == [False]
    assert b.corrupt_count() == 0 and b.error_count() == 0
    out = bytearray(1000)
    assert b.get_into([key(1)], [memoryview(out)]) == [True] and bytes(out) == payload(1, 1000)


def test_a_read_into_place_past_its_deadline_is_waited_for_never_left_behind(
    make: Any,
) -> None:
    """``get_into`` reads straight into the caller's buffer, so a read past its
    deadline is not abandoned (it could write into a buffer the caller reused):
    the breaker opens at the deadline, later calls skip the store at once, and
    the call returns only after Mooncake did. A delay is put between the tier
    and the real client's read; abandoning the read returned before it wrote."""
    b = make(ns("late"), timeout=0.3, backoff_initial=5.0, backoff_max=5.0)
    assert b.put([(key(1), payload(1))]) == [True]
    conn = b._conn
    real = conn._client
    wrote: list[float] = []

    class LateReads:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def batch_get_into_multi_buffers(self, *args: Any) -> Any:
            time.sleep(1.0)
            got = real.batch_get_into_multi_buffers(*args)
            wrote.append(time.monotonic())
            return got

    conn._client = LateReads()
    out = bytearray(4096)
    t = time.monotonic()
    assert b.get_into([key(1)], [memoryview(out)]) == [False]
    returned = time.monotonic()
    assert wrote and wrote[0] <= returned and returned - t >= 1.0
    assert not b.available() and b.stats()["timeouts"] == 1
    skipped = time.monotonic()
    assert b.get_into([key(1)], [memoryview(out)]) == [False]  # the breaker: no call
    assert time.monotonic() - skipped < 0.1 and b.stats()["skipped"] == 1
    conn._client = real


def test_parts_and_duplicates(make: Any) -> None:
    b = make(ns("parts"))
    v = payload(7, 300_000)
    view = memoryview(v)
    assert b.put_parts([(key(7), [view[:5], view[5:200_000], view[200_000:]])]) == [True]
    a, c = np.zeros(300_000, np.uint8), np.zeros(300_000, np.uint8)
    outs = [[memoryview(a)[:1000], memoryview(a)[1000:]], [memoryview(c)]]
    assert b.get_into_parts([key(7), key(7)], outs) == [True, True]
    assert a.tobytes() == v and c.tobytes() == v


def test_corrupt_and_foreign_frames_are_misses_counted_and_removed(
    make: Any, raw: RawClient
) -> None:
    mine, theirs = ns("mine"), ns("theirs")
    b = make(mine)
    name = b._mkey(key(1))
    raw.write(name, encode_chunk(theirs, key(1), payload(1)))  # another namespace's frame
    assert b.get([key(1)]) == [None]
    assert b.corrupt_count() == 1 and raw.read(name) is None
    frame = bytearray(encode_chunk(mine, key(1), payload(1)))
    frame[HEADER_SIZE + 10] ^= 1  # a flipped payload bit, in a frame of the right size
    raw.write(name, bytes(frame))
    assert b.get_into([key(1)], [memoryview(bytearray(4096))]) == [False]
    assert b.corrupt_count() == 2 and raw.read(name) is None
    raw.write(name, bytes(frame[:-7]))  # truncated
    assert b.get_into([key(1)], [memoryview(bytearray(4096))]) == [False]
    assert b.corrupt_count() == 3 and raw.read(name) is None
    assert b.stats()["corrupt"] == 3 and b.error_count() == 0


def test_a_value_larger_than_a_frame_is_dropped_unread(make: Any, raw: RawClient) -> None:
    b = MooncakeBackend(make(ns("x")).options, ctx(ns("small"), chunk_bytes=4096))
    try:
        raw.write(b._mkey(key(1)), b"\0" * (HEADER_SIZE + 4096 + 1))
        assert b.get([key(1)]) == [None]
        assert b.stats()["oversized"] == 1 and raw.read(b._mkey(key(1))) is None
        assert b.put([(key(2), payload(2, 4097))]) == [False]  # a reader would drop it
    finally:
        b.close()


def test_clear_drops_only_its_namespace(make: Any) -> None:
    a, b = make(ns("clear-a")), make(ns("clear-b"))
    assert a.put([(key(1), payload(1))]) == [True] and b.put([(key(1), payload(1))]) == [True]
    a.clear()
    assert a.exists([key(1)]) == [False] and b.exists([key(1)]) == [True]


def test_options_are_checked_with_the_key_named() -> None:
    with pytest.raises(ValueError, match="master: got 'nowhere'"):
        MooncakeOptions(master="nowhere")
    with pytest.raises(ValueError, match="timeout: got 0"):
        MooncakeOptions(timeout=0)
    with pytest.raises(ValueError, match="backoff_max: got 1"):
        MooncakeOptions(backoff_initial=2.0, backoff_max=1.0)


# -- failures -----------------------------------------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[Any]:
    """``own_cluster(segment)``: a master and holder of this test's own."""
    made: list[MooncakeCluster] = []
    with tempfile.TemporaryDirectory(prefix="kvsdk-mooncake-") as tmp:

        def start(segment: str = "64MB") -> MooncakeCluster:
            c = start_cluster(Path(tmp) / str(len(made)), segment)
            made.append(c)
            return c

        for i in range(4):
            (Path(tmp) / str(i)).mkdir()
        try:
            yield start
        finally:
            for c in made:
                c.stop()


def test_master_killed_misses_within_the_deadline_then_the_breaker_skips_it(
    own_cluster: Any,
) -> None:
    cluster = own_cluster()
    b = MooncakeBackend(cluster.options(timeout=0.5, backoff_initial=1.0, backoff_max=2.0),
                        ctx(ns("outage")))  # fmt: skip
    try:
        assert b.put([(key(1), payload(1))]) == [True]
        assert b.available() and b.error_count() == 0
        cluster.kill_master()
        t = time.monotonic()
        first = b.get([key(1)])
        first_took = time.monotonic() - t
        assert first == [None] and first_took < 1.5  # Mooncake alone waits ~4 s
        assert not b.available() and b.error_count() >= 1
        t = time.monotonic()
        assert b.exists([key(1)]) == [False]
        assert b.put([(key(2), payload(2))]) == [False]
        assert b.get_into([key(1)], [memoryview(bytearray(4096))]) == [False]
        assert time.monotonic() - t < 0.1  # skipped: no call to Mooncake
        assert b.stats()["skipped"] >= 3
        cluster.restart_master()  # no snapshot: the new master has no objects
        cluster.wait_holder()
        deadline = time.monotonic() + 30
        while b.put([(key(3), payload(3))]) != [True]:
            assert time.monotonic() < deadline, "the tier never wrote again"
            time.sleep(0.2)
        assert b.available()
        assert [bytes(v) if v is not None else None for v in b.get([key(3), key(1)])] == [
            payload(3), None,  # key 1 went with the old master
        ]  # fmt: skip
    finally:
        b.close()


def test_a_master_restarted_from_its_snapshot_keeps_the_objects(tmp_path: Path) -> None:
    """With snapshots on (``docs/deployment.md``), a master killed and restarted with
    ``--enable_snapshot_restore`` still knows the objects the holder keeps."""
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    flags = ("--enable_snapshot", "--snapshot_interval_seconds=1",
             "--snapshot_object_store_type=local")  # fmt: skip
    cluster = start_cluster(tmp_path, "64MB", master_args=flags,
                            master_env={"MOONCAKE_SNAPSHOT_LOCAL_PATH": str(snaps)})  # fmt: skip
    b = MooncakeBackend(cluster.options(timeout=1.0, backoff_initial=0.2, backoff_max=0.5),
                        ctx(ns("snapshot")))  # fmt: skip
    try:
        assert b.put([(key(1), payload(1))]) == [True]

        def latest() -> str:
            return "".join(sorted(p.read_text() for p in snaps.rglob("latest.txt")))

        seen = [latest()]
        deadline = time.monotonic() + 60
        while len(seen) < 3:  # two more snapshots finished: one begun after the put
            assert time.monotonic() < deadline, f"snapshots written: {seen}"
            time.sleep(0.2)
            if latest() != seen[-1]:
                seen.append(latest())
        cluster.kill_master()
        cluster.master_args = (*flags, "--enable_snapshot_restore")
        cluster.start_master()
        deadline = time.monotonic() + 30
        while (got := b.get([key(1)])) == [None]:
            assert time.monotonic() < deadline, (
                f"the restored master never served the object: {cluster.tail('master')}"
            )
            time.sleep(0.2)
        assert got[0] is not None and bytes(got[0]) == payload(1)
    finally:
        b.close()
        cluster.stop()


def test_a_hung_master_costs_each_call_its_deadline_only(own_cluster: Any) -> None:
    """A master that holds its connections open and answers nothing (SIGSTOP):
    each call gives up at its deadline, then the breaker skips the store; once
    the master answers again, so does the tier (its objects kept)."""
    cluster = own_cluster()
    b = MooncakeBackend(cluster.options(timeout=0.5, backoff_initial=0.5, backoff_max=0.5),
                        ctx(ns("hung")))  # fmt: skip
    try:
        assert b.put([(key(1), payload(1))]) == [True]
        cluster.pause_master()
        for call in (lambda: b.exists([key(1)]), lambda: b.get([key(1)]),
                     lambda: b.put([(key(2), payload(2))])):  # fmt: skip
            time.sleep(0.6)  # past the backoff: the call is tried
            t = time.monotonic()
            assert not any(call())
            assert time.monotonic() - t < 1.2  # 0.5 s and the payload's bytes at 64 MiB/s
        assert b.stats()["timeouts"] >= 3 and not b.available()
        cluster.resume_master()
        deadline = time.monotonic() + 30
        while b.exists([key(1)]) != [True]:
            assert time.monotonic() < deadline, "the tier never answered again"
            time.sleep(0.2)
        assert [bytes(v) for v in b.get([key(1)]) if v is not None] == [payload(1)]
    finally:
        cluster.resume_master()
        b.close()


def test_a_holder_gone_is_misses_within_the_deadline_then_a_new_one_serves(
    own_cluster: Any,
) -> None:
    """The holder's memory goes with it: reads of its objects miss (Mooncake: -800),
    writes placed on its segment fail within the deadline until the master drops
    it (``--client_ttl``); a new holder takes writes again."""
    cluster = own_cluster()
    b = MooncakeBackend(cluster.options(timeout=0.5, backoff_initial=0.2, backoff_max=0.5),
                        ctx(ns("holder")))  # fmt: skip
    try:
        assert b.put([(key(1), payload(1))]) == [True]
        assert cluster.holder_proc is not None
        cluster.holder_proc.kill()
        cluster.holder_proc.wait()
        t = time.monotonic()
        assert b.get([key(1)]) == [None]
        assert b.get_into([key(1)], [memoryview(bytearray(4096))]) == [False]
        assert b.put([(key(2), payload(2))]) == [False]
        assert time.monotonic() - t < 3 * 0.6 + 0.5 and b.error_count() >= 1
        cluster.holder_port = free_port()
        cluster.start_holder()
        deadline = time.monotonic() + 60
        while b.put([(key(3), payload(3))]) != [True]:
            assert time.monotonic() < deadline, "a new holder never took a write"
            time.sleep(0.3)
        assert [bytes(v) for v in b.get([key(3)]) if v is not None] == [payload(3)]
    finally:
        b.close()


def test_a_dead_master_at_start_is_no_build_error(own_cluster: Any) -> None:
    cluster = own_cluster()
    cluster.kill_master()
    b = MooncakeBackend(cluster.options(timeout=0.5), ctx(ns("late")))
    try:
        t = time.monotonic()
        assert b.exists([key(1)]) == [False]
        assert time.monotonic() - t < 1.5 and not b.available()
    finally:
        b.close()


def test_a_full_segment_refuses_puts_counted_as_refused(own_cluster: Any) -> None:
    cluster = own_cluster("16MB")
    b = MooncakeBackend(cluster.options(), ctx(ns("full")))
    try:
        items = [(key(i), payload(i, CHUNK)) for i in range(40)]  # 40 MiB into 16 MiB
        ok = b.put(items)
        stored = sum(ok)
        assert 0 < stored < 40
        s = b.stats()
        assert s["write_refusals"] == 40 - stored and s["refused_bytes"] > 0
        assert s["put_failures"] == 40 - stored and b.error_count() == 0 and b.available()
        assert sum(v is not None for v in b.get([k for k, _ in items])) <= stored
    finally:
        b.close()


def test_wipe_removes_every_namespace_or_one(make: Any) -> None:
    a, b = make(ns("wipe-a")), make(ns("wipe-b"))
    a.put([(key(1), payload(1)), (key(2), payload(2))])
    b.put([(key(1), payload(1))])
    assert MooncakeBackend.wipe(a.options, ns("wipe-a").hex()) == 2
    assert a.exists([key(1)]) == [False] and b.exists([key(1)]) == [True]


def test_a_missing_client_is_a_config_error_in_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'kvsdk\[mooncake\]'"):
        MooncakeBackend(MooncakeOptions(), ctx(ns("none")))


def test_the_tier_is_configured_by_name_with_errors_naming_the_key() -> None:
    from kvsdk.config import ConfigError, load_config

    tiers = [{"backend": "cpu"}, {"backend": "mooncake", "master": "10.0.0.5:50051"}]
    cfg = load_config({"tiers": tiers})
    assert cfg.tiers[1].options == MooncakeOptions(master="10.0.0.5:50051")
    with pytest.raises(ConfigError, match=r"tiers\[1\].*timeout"):
        load_config({"tiers": [tiers[0], {**tiers[1], "timeout": -1}]})


# -- under the tiered store ---------------------------------------------------------------


def test_a_tiered_store_writes_through_and_another_instance_promotes(
    mooncake_cluster: MooncakeCluster,
) -> None:
    """``cpu -> mooncake`` built from a config mapping, as a user writes it: what one
    store saves is written through to Mooncake, and a second store (another engine
    with an empty host tier) finds it there and promotes it byte-identical."""
    from kvsdk.config import load_config
    from kvsdk.keys import GroupLayout, Namespace
    from kvsdk.store.factory import build_store
    from kvsdk.types import LookupResult

    chunk = 8192
    space = Namespace(model="mooncake-tiering", dtype="float32",
                      groups=(GroupLayout((2, chunk // 2), "uint8"),), tokens_per_chunk=32)  # fmt: skip
    config = {"chunk_tokens": 32, "io_threads": 2, "tiers": [
        {"backend": "cpu", "capacity": 16 * chunk, "pin_memory": "never"},
        {"backend": "mooncake", "master": mooncake_cluster.master, "timeout": 2.0},
    ]}  # fmt: skip
    chunks = {key(500 + i): payload(500 + i, chunk) for i in range(6)}

    def settle(store: Any) -> None:
        deadline = time.monotonic() + 30
        store.step()
        while store.has_pending_work():
            assert time.monotonic() < deadline, "I/O did not finish"
            time.sleep(0.005)
            store.step()

    first = build_store(load_config(config), space, chunk)
    second = build_store(load_config(config), space, chunk)
    try:
        plan = first.prepare_store(list(chunks))
        assert plan is not None
        slab = first.host.slab.numpy()
        for k, slot in zip(plan.keys, plan.slots):
            slab[slot] = np.frombuffer(chunks[k], dtype=np.uint8)
        first.complete_store(list(plan.keys))
        settle(first)
        answers: dict[ChunkKey, LookupResult] = {}
        deadline = time.monotonic() + 30
        while len(answers) < len(chunks):
            for k in chunks:
                r = second.lookup(k)
                if r in (LookupResult.HIT, LookupResult.MISS):
                    answers[k] = r
            second.step()
            assert time.monotonic() < deadline, answers
            time.sleep(0.005)
        assert set(answers.values()) == {LookupResult.HIT}
        for k, value in chunks.items():
            (slot,) = second.prepare_load([k])
            assert bytes(second.host.slab.numpy()[slot]) == value
            second.complete_load([k])
    finally:
        first.shutdown()
        second.shutdown()


def test_staging_buffers_are_reused_within_limits() -> None:
    from kvsdk.backends.mooncake_reads import STAGING_KEPT, STAGING_KEPT_BYTES, Staging

    staging = Staging()
    buf = staging.take(10)
    assert len(buf) == 1 << 20  # whole MiB
    staging.give(buf)
    assert staging.take(1000) is buf and staging.kept_bytes() == 0
    for _ in range(STAGING_KEPT + 3):  # (np.empty: no page is touched)
        staging.give(staging.take(200 << 20) if staging.kept_bytes() else np.empty(200 << 20))
    assert 0 < staging.kept_bytes() <= STAGING_KEPT_BYTES
    for _ in range(STAGING_KEPT + 3):
        staging.give(np.empty(1 << 20, np.uint8))
    assert staging.kept_bytes() <= STAGING_KEPT_BYTES
