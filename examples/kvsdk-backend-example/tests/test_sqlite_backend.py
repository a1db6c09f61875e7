"""The sqlite backend: kvsdk's conformance suite, then what is its own (capacity,
eviction, locking, start-up errors, registration)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvsdk.backend import Backend, BackendError, TierContext
from kvsdk.chunk_format import HEADER_SIZE
from kvsdk.testing import BackendConformance, BackendFactory, conformance_context
from kvsdk.types import ChunkKey

from kvsdk_sqlite import SQLiteBackend, SQLiteOptions

PAYLOAD = 1000
FRAME = HEADER_SIZE + PAYLOAD


class SQLiteRaw:
    """The stored frame of a key, read and written with a connection of its own."""

    @contextlib.contextmanager
    def _db(self, backend: Backend) -> Iterator[tuple[sqlite3.Connection, bytes]]:
        assert isinstance(backend, SQLiteBackend)
        conn = sqlite3.connect(backend.options.path)
        try:
            with conn:  # one transaction, committed on success
                yield conn, backend.namespace_fp
        finally:
            conn.close()

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        with self._db(backend) as (conn, ns):
            row = conn.execute(
                "SELECT frame FROM kvsdk_chunks WHERE ns = ? AND key = ?", (ns, key)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        with self._db(backend) as (conn, ns):
            conn.execute(
                "INSERT INTO kvsdk_chunks (ns, key, frame, size, used) VALUES (?, ?, ?, ?, 0) "
                "ON CONFLICT (ns, key) DO UPDATE SET frame = excluded.frame, size = excluded.size",
                (ns, key, data, len(data)),
            )


class TestSQLiteConformance(BackendConformance):
    persistent = True
    shared = True
    raw = SQLiteRaw()

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda ctx: SQLiteBackend(SQLiteOptions(path=str(tmp_path / "kv.db")), ctx)


# -- its own behaviour -------------------------------------------------------------------------


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD


def ctx() -> TierContext:
    return conformance_context()


@pytest.fixture
def opened() -> Iterator[list[SQLiteBackend]]:
    backends: list[SQLiteBackend] = []
    yield backends
    for b in backends:
        b.close()


def sqlite(opened: list[SQLiteBackend], path: Path, **options: Any) -> SQLiteBackend:
    b = SQLiteBackend(SQLiteOptions(path=str(path), **options), ctx())
    opened.append(b)
    return b


def test_evicts_the_least_recently_used_beyond_capacity(
    opened: list[SQLiteBackend], tmp_path: Path
) -> None:
    b = sqlite(opened, tmp_path / "kv.db", capacity=3 * FRAME)
    for i in range(3):
        assert b.put([(key(i), payload(i))]) == [True]
    assert b.get([key(0)]) == [payload(0)]  # key 0 is now the most recently used
    assert b.put([(key(3), payload(3))]) == [True]
    assert b.exists([key(i) for i in range(4)]) == [True, False, True, True]
    stats = b.stats()
    assert stats["evictions"] == 1
    assert stats["bytes_used"] == 3 * FRAME


def test_a_put_of_a_stored_key_counts_as_use(opened: list[SQLiteBackend], tmp_path: Path) -> None:
    b = sqlite(opened, tmp_path / "kv.db", capacity=2 * FRAME)
    b.put([(key(0), payload(0))])
    b.put([(key(1), payload(1))])
    b.put([(key(0), payload(0))])
    b.put([(key(2), payload(2))])
    assert b.exists([key(0), key(1), key(2)]) == [True, False, True]


def test_a_chunk_larger_than_the_capacity_is_refused(
    opened: list[SQLiteBackend], tmp_path: Path
) -> None:
    b = sqlite(opened, tmp_path / "kv.db", capacity=FRAME)
    b.put([(key(0), payload(0))])
    assert b.put([(key(1), payload(1) * 2), (key(2), payload(2))]) == [False, True]
    assert b.stats()["put_too_large"] == 1


def test_a_batch_larger_than_the_capacity_keeps_what_fits(
    opened: list[SQLiteBackend], tmp_path: Path
) -> None:
    b = sqlite(opened, tmp_path / "kv.db", capacity=2 * FRAME)
    assert b.put([(key(i), payload(i)) for i in range(3)]) == [True, True, False]
    assert b.stats()["bytes_used"] == 2 * FRAME


def test_namespaces_in_one_file_share_its_capacity(
    opened: list[SQLiteBackend], tmp_path: Path
) -> None:
    a = sqlite(opened, tmp_path / "kv.db", capacity=2 * FRAME)
    other = conformance_context(hashlib.blake2b(b"other", digest_size=16).digest())
    b = SQLiteBackend(SQLiteOptions(path=str(tmp_path / "kv.db"), capacity=2 * FRAME), other)
    opened.append(b)
    a.put([(key(0), payload(0)), (key(1), payload(1))])
    b.put([(key(2), payload(2))])
    assert a.exists([key(0), key(1)]) == [False, True]
    assert b.stats()["bytes_used"] == 2 * FRAME


def test_reads_are_served_while_another_connection_holds_the_write_lock(
    opened: list[SQLiteBackend], tmp_path: Path
) -> None:
    b = sqlite(opened, tmp_path / "kv.db", busy_timeout=0.05)
    b.put([(key(0), payload(0))])
    holder = sqlite3.connect(tmp_path / "kv.db", isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        assert b.get([key(0)]) == [payload(0)]  # WAL: readers never wait
        with pytest.raises(BackendError, match="put failed"):
            b.put([(key(1), payload(1))])
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    assert b.put([(key(1), payload(1))]) == [True]
    assert b.stats()["errors"] == 1


def test_calls_after_close_raise_backend_error(opened: list[SQLiteBackend], tmp_path: Path) -> None:
    b = sqlite(opened, tmp_path / "kv.db")
    b.close()
    with pytest.raises(BackendError, match="closed"):
        b.get([key(0)])
    seen: list[BaseException] = []

    def other_thread() -> None:
        try:
            b.exists([key(0)])
        except BaseException as exc:
            seen.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert [type(e) for e in seen] == [BackendError]


def test_a_file_that_is_not_a_database_fails_at_start(tmp_path: Path) -> None:
    path = tmp_path / "kv.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="cannot use"):
        SQLiteBackend(SQLiteOptions(path=str(path)), ctx())


def test_the_database_file_is_private(opened: list[SQLiteBackend], tmp_path: Path) -> None:
    sqlite(opened, tmp_path / "sub" / "kv.db")
    assert (tmp_path / "sub" / "kv.db").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "sub").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("path", ["", ":memory:", "file:kv.db?mode=memory"])
def test_options_refuse_paths_that_are_not_files(path: str) -> None:
    with pytest.raises(ValueError, match="path"):
        SQLiteOptions(path=path)


def _installed() -> bool:
    eps = importlib.metadata.entry_points(group="kvsdk")
    return any(ep.value == "kvsdk_sqlite.plugin" for ep in eps)


@pytest.mark.skipif(not _installed(), reason="package not installed (pip install -e .)")
def test_kvsdk_finds_it_through_the_entry_point_and_builds_it_from_yaml(tmp_path: Path) -> None:
    from kvsdk import plugins_manager
    from kvsdk.config import load_config

    assert plugins_manager.backends()["sqlite"] is SQLiteBackend
    cfg = load_config(
        "tiers:\n"
        "  - {backend: cpu, capacity: 64MiB}\n"
        f"  - {{backend: sqlite, path: {tmp_path / 'kv.db'}, capacity: 2GiB}}\n"
    )
    assert cfg.tiers[1].options == SQLiteOptions(path=str(tmp_path / "kv.db"), capacity=2 << 30)
