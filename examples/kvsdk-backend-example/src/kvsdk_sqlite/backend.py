"""``sqlite``: KV-cache chunks as rows of one SQLite file on local disk.

One table holds every namespace's entries: ``(ns, key) -> frame``, where the
frame is a :mod:`kvsdk.chunk_format` frame (namespace, key, shape, checksum,
payload). Nothing is pickled; every value read back is verified, and one
that fails (a bit flip, a truncated row, another namespace's frame) is a
miss: counted, and its row deleted.

Capacity counts the bytes of frames in the file, over all namespaces in it
(a trigger keeps the running total in ``kvsdk_usage``, so nothing scans the
table on a put). When a put would go over it, the least recently used rows
are deleted in the same transaction; a hit refreshes its row's ``used``
stamp, best effort. A key already stored is not rewritten (keys are content
hashes) but counts as used.

Thread-safe: each thread gets its own connection (SQLite connections must
not be shared between threads mid-statement); writes take the file's write
lock up front (``BEGIN IMMEDIATE``) and the file is in WAL mode, so readers
never wait for a writer. Several processes on one machine may share the
file. Every batched call is a few statements (``IN (...)`` lists of up to
:data:`MAX_PARAMS` keys, ``executemany``), never one round trip per key.

A database error (locked for longer than ``busy_timeout``, disk full, a
damaged file) raises :class:`kvsdk.backend.BackendError`: the tiered store
serves misses for that call and counts the failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.chunk_format import CorruptChunk, UnverifiableChunk, decode_chunk, encode_chunk
from kvsdk.config import BYTES
from kvsdk.types import ChunkKey, Locality, Medium

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""``PRAGMA user_version`` of a file this backend created."""
MAX_PARAMS = 500
"""Keys per ``IN (...)`` list (SQLite's limit on bound parameters is higher)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kvsdk_chunks (
    ns    BLOB    NOT NULL,
    key   BLOB    NOT NULL,
    frame BLOB    NOT NULL,
    size  INTEGER NOT NULL,
    used  INTEGER NOT NULL,
    UNIQUE (ns, key)
);
CREATE INDEX IF NOT EXISTS kvsdk_chunks_used ON kvsdk_chunks (used);
CREATE TABLE IF NOT EXISTS kvsdk_usage (
    id    INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO kvsdk_usage VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS kvsdk_chunks_added AFTER INSERT ON kvsdk_chunks
    BEGIN UPDATE kvsdk_usage SET bytes = bytes + new.size; END;
CREATE TRIGGER IF NOT EXISTS kvsdk_chunks_removed AFTER DELETE ON kvsdk_chunks
    BEGIN UPDATE kvsdk_usage SET bytes = bytes - old.size; END;
CREATE TRIGGER IF NOT EXISTS kvsdk_chunks_resized AFTER UPDATE OF size ON kvsdk_chunks
    BEGIN UPDATE kvsdk_usage SET bytes = bytes - old.size + new.size; END;
"""


@dataclass(frozen=True)
class SQLiteOptions:
    path: str
    """The database file (created ``0600`` with its directory if missing); processes
    on one machine may share it."""
    capacity: int = field(default=1 << 30, metadata=BYTES)
    """Bytes of chunk frames the file keeps (e.g. ``10GiB``); least recently used
    rows are evicted beyond it."""
    busy_timeout: float = 5.0
    """Seconds a call waits for another connection's write lock before it fails."""

    def __post_init__(self) -> None:
        if not self.path or self.path == ":memory:" or self.path.startswith("file:"):
            raise ValueError(f"path: got {self.path!r}; expected a database file path")
        if self.busy_timeout <= 0:
            raise ValueError(f"busy_timeout: got {self.busy_timeout}; expected a positive number")


def _batches(keys: Sequence[ChunkKey]) -> Iterator[Sequence[ChunkKey]]:
    for start in range(0, len(keys), MAX_PARAMS):
        yield keys[start : start + MAX_PARAMS]


def _marks(n: int) -> str:
    return ",".join("?" * n)


class SQLiteBackend(Backend):
    name = "sqlite"
    Options = SQLiteOptions
    medium = Medium.DISK
    locality = Locality.NODE
    supports_listing = True

    def __init__(self, options: SQLiteOptions, context: TierContext) -> None:
        self.options = options
        self.namespace_fp = context.namespace_fp
        self._path = os.path.abspath(options.path)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "puts", "put_skipped_present", "put_too_large", "put_no_room",
             "corrupt", "unverifiable", "evictions", "deletes", "errors"), 0,
        )  # fmt: skip
        try:
            os.makedirs(os.path.dirname(self._path), mode=0o700, exist_ok=True)
            os.close(os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = self._conn()
            conn.execute("PRAGMA journal_mode=WAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise ValueError(
                    f"sqlite tier: {self._path} has schema version {version}; "
                    f"this backend reads version {SCHEMA_VERSION}"
                )
            conn.executescript(
                f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;"
            )
        except sqlite3.Error as exc:
            self.close()
            raise ValueError(f"sqlite tier: cannot use {self._path}: {exc}") from None
        except BaseException:
            self.close()
            raise

    # -- connections and transactions --------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and not self._closed:
            return conn
        with self._lock:
            if self._closed:
                raise BackendError(f"sqlite tier {self._path}: closed")
            conn = sqlite3.connect(
                self._path,
                timeout=self.options.busy_timeout,
                isolation_level=None,  # autocommit; write transactions are explicit
                check_same_thread=False,  # only so close() may close it from another thread
            )
            self._conns.append(conn)
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never torn
        self._local.conn = conn
        return conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A transaction that takes the file's write lock at its start, so it never
        fails half-way for want of it (a deferred one could, to avoid a deadlock)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # never leave this thread's connection mid-transaction
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            self._count("errors")
            raise BackendError(f"sqlite tier {self._path}: {op} failed: {exc}") from None

    def _rows(
        self, conn: sqlite3.Connection, columns: str, keys: Sequence[ChunkKey]
    ) -> Iterator[tuple[Any, ...]]:
        """``columns`` of this namespace's rows for ``keys`` (each key once)."""
        for part in _batches(list(dict.fromkeys(keys))):
            yield from conn.execute(
                f"SELECT {columns} FROM kvsdk_chunks WHERE ns = ? AND key IN ({_marks(len(part))})",
                (self.namespace_fp, *part),
            )

    # -- Backend -------------------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._errors("exists"):
            found = {bytes(k) for (k,) in self._rows(self._conn(), "key", keys)}
        return [k in found for k in keys]

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        with self._errors("get"):
            frames = {bytes(k): f for k, f in self._rows(self._conn(), "key, frame", keys)}
        payloads: dict[ChunkKey, memoryview] = {}
        corrupt: list[tuple[ChunkKey, bytes]] = []
        for key, frame in frames.items():
            try:
                payloads[key] = decode_chunk(frame, namespace_fp=self.namespace_fp, key=key)
            except UnverifiableChunk as exc:  # written by a process with another checksum library
                self._count("unverifiable")
                log.debug("sqlite tier: cannot verify %s: %s", key.hex(), exc.reason)
            except CorruptChunk as exc:
                self._count("corrupt")
                log.warning("sqlite tier %s: dropping %s: %s", self._path, key.hex(), exc.reason)
                corrupt.append((key, frame))
        if corrupt:
            self._drop_corrupt(corrupt)
        if payloads:
            self._mark_used(list(payloads))
        out: list[Buffer | None] = [payloads.get(k) for k in keys]
        hits = sum(v is not None for v in out)
        self._count("hits", hits)
        self._count("misses", len(keys) - hits)
        return out

    def _drop_corrupt(self, rows: list[tuple[ChunkKey, bytes]]) -> None:
        """Delete rows that failed verification, best effort (they are misses anyway).
        Only the bad frame itself: another process may have stored a good one meanwhile."""
        try:
            with self._write() as conn:
                conn.executemany(
                    "DELETE FROM kvsdk_chunks WHERE ns = ? AND key = ? AND frame = ?",
                    [(self.namespace_fp, k, f) for k, f in rows],
                )
        except sqlite3.Error as exc:
            self._count("errors")
            log.warning("sqlite tier %s: cannot delete corrupt rows: %s", self._path, exc)

    def _mark_used(self, keys: Sequence[ChunkKey]) -> None:
        """Refresh recency after hits; skipped when the write lock is busy."""
        now = time.time_ns()
        try:
            with self._write() as conn:
                conn.executemany(
                    "UPDATE kvsdk_chunks SET used = ? WHERE ns = ? AND key = ?",
                    [(now, self.namespace_fp, k) for k in keys],
                )
        except sqlite3.Error as exc:
            log.debug("sqlite tier: recency update skipped: %s", exc)

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        frames = [(k, encode_chunk(self.namespace_fp, k, v)) for k, v in items]  # outside the lock
        ok = [False] * len(items)
        with self._errors("put"), self._write() as conn:
            now = time.time_ns()
            present = {bytes(k) for (k,) in self._rows(conn, "key", [k for k, _ in frames])}
            conn.executemany(
                "UPDATE kvsdk_chunks SET used = ? WHERE ns = ? AND key = ?",
                [(now, self.namespace_fp, k) for k in present],
            )
            new: dict[ChunkKey, bytes] = {}
            incoming = 0
            for key, frame in frames:
                if key in present or key in new:
                    continue
                if len(frame) > self.options.capacity:
                    self._count("put_too_large")
                    continue
                new[key] = frame
                incoming += len(frame)
            incoming -= self._make_room(conn, incoming, now, new)
            conn.executemany(
                "INSERT INTO kvsdk_chunks (ns, key, frame, size, used) VALUES (?, ?, ?, ?, ?)",
                [(self.namespace_fp, k, f, len(f), now) for k, f in new.items()],
            )
        for i, (key, _) in enumerate(frames):
            ok[i] = key in present or key in new
        self._count("puts", len(new))
        self._count("put_skipped_present", sum(k in present for k, _ in frames))
        return ok

    def _make_room(
        self, conn: sqlite3.Connection, incoming: int, now: int, new: dict[ChunkKey, bytes]
    ) -> int:
        """Evict least recently used rows (not those this put touched) until ``incoming``
        more bytes fit; if they cannot, drop the last of ``new``. Returns the bytes dropped."""
        (used,) = conn.execute("SELECT bytes FROM kvsdk_usage").fetchone()
        excess = used + incoming - self.options.capacity
        victims: list[tuple[bytes, bytes]] = []
        if excess > 0:
            for ns, key, size in conn.execute(
                "SELECT ns, key, size FROM kvsdk_chunks WHERE used < ? ORDER BY used", (now,)
            ):
                victims.append((ns, key))
                excess -= size
                if excess <= 0:
                    break
            conn.executemany("DELETE FROM kvsdk_chunks WHERE ns = ? AND key = ?", victims)
            self._count("evictions", len(victims))
        dropped = 0
        while excess > 0 and new:
            key = next(reversed(new))
            size = len(new.pop(key))
            excess -= size
            dropped += size
            self._count("put_no_room")
        return dropped

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._errors("delete"), self._write() as conn:
            for part in _batches(list(dict.fromkeys(keys))):
                n += conn.execute(
                    f"DELETE FROM kvsdk_chunks WHERE ns = ? AND key IN ({_marks(len(part))})",
                    (self.namespace_fp, *part),
                ).rowcount
        self._count("deletes", n)
        return n

    def clear(self) -> None:
        with self._errors("clear"), self._write() as conn:
            conn.execute("DELETE FROM kvsdk_chunks WHERE ns = ?", (self.namespace_fp,))

    def iter_keys(self) -> Iterator[ChunkKey]:
        with self._errors("list"):
            rows = self._conn().execute(
                "SELECT key FROM kvsdk_chunks WHERE ns = ?", (self.namespace_fp,)
            )
            return iter([bytes(k) for (k,) in rows])

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counters.items()}
        out["capacity_bytes"] = float(self.options.capacity)
        with contextlib.suppress(sqlite3.Error, BackendError):
            conn = self._conn()
            (entries,) = conn.execute(
                "SELECT COUNT(*) FROM kvsdk_chunks WHERE ns = ?", (self.namespace_fp,)
            ).fetchone()
            (used,) = conn.execute("SELECT bytes FROM kvsdk_usage").fetchone()
            out.update(entries=float(entries), bytes_used=float(used))
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # -- helpers -------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters[name] += n

    def __repr__(self) -> str:
        return f"SQLiteBackend({self._path!r}, capacity={self.options.capacity})"
