"""What every conformance check shares: the fixtures (namespaces, keys, payloads),
assertion helpers, and the harness that opens and closes backends under test."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.eviction import LRUPolicy
from kvsdk.types import ChunkKey

BackendFactory = Callable[[TierContext], Backend]
"""``factory(context) -> backend`` on one storage location."""

NAMESPACE_A = hashlib.blake2b(b"kvsdk.testing namespace A", digest_size=16).digest()
NAMESPACE_B = hashlib.blake2b(b"kvsdk.testing namespace B", digest_size=16).digest()
CHUNK_BYTES = (1 << 20) + 1
"""``TierContext.chunk_bytes`` the suite passes: the largest payload it stores
(a tier may refuse larger ones, and treat larger stored values as corrupt)."""
PAYLOAD_SIZES: tuple[int, ...] = (0, 1, 13, 4096, (256 << 10) + 3, CHUNK_BYTES)
MIN_CAPACITY_BYTES = 16 << 20
"""Room the backend under test must have; no check stores more than a quarter of it."""
THREADS = 8


class RawAccess(Protocol):
    """Reads and replaces what a backend stored for a key, bypassing the backend."""

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        """The stored bytes (the whole frame) for ``key``, or None if nothing is stored."""

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        """Store ``data`` as the raw value of ``key``, replacing or creating it."""


class CheckSkipped(Exception):
    """A check that does not apply to this backend (the reason is the message)."""


@dataclass
class ConformanceReport:
    """What :func:`run_backend_conformance` ran."""

    backend: str
    passed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def conformance_context(namespace_fp: bytes = NAMESPACE_A) -> TierContext:
    """The context the suite builds backends with (as kvsdk's store factory does)."""
    return TierContext(
        namespace_fp=namespace_fp,
        namespace_hex=namespace_fp.hex(),
        chunk_bytes=CHUNK_BYTES,
        policy_factory=LRUPolicy,
    )


# -- helpers -------------------------------------------------------------------------------


def key_for(label: str, i: int = 0) -> ChunkKey:
    """A deterministic 16-byte chunk key."""
    return hashlib.blake2b(f"{label}/{i}".encode(), digest_size=16).digest()


def payload_for(label: str, size: int) -> bytes:
    """Deterministic pseudo-random bytes (distinct per label and size)."""
    seed = int.from_bytes(
        hashlib.blake2b(f"{label}/{size}".encode(), digest_size=8).digest(), "little"
    )
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def show(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return f"{len(data)} bytes ({data[:8].hex()}{'...' if len(data) > 8 else ''})"
    return repr(value)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def as_bytes(value: Buffer | None, op: str) -> bytes | None:
    """``value`` as bytes, after checking it is a flat byte buffer (or None)."""
    if value is None:
        return None
    require(
        isinstance(value, bytes | bytearray | memoryview),
        f"{op} returned a {type(value).__name__}; expected bytes, bytearray, memoryview or None",
    )
    nbytes = memoryview(value).nbytes
    require(
        len(value) == nbytes,
        f"{op} returned a buffer whose len() is {len(value)} but holds {nbytes} bytes; "
        "expected a flat byte buffer (memoryview of format 'B')",
    )
    return bytes(value)


class Harness:
    """Opens backends on the location under test and closes them afterwards."""

    def __init__(
        self, factory: BackendFactory, *, persistent: bool, shared: bool, raw: RawAccess | None
    ) -> None:
        self.factory = factory
        self.persistent = persistent
        self.shared = shared
        self.raw = raw
        self._opened: list[Backend] = []
        self.backend_name = ""

    def open(self, namespace_fp: bytes = NAMESPACE_A) -> Backend:
        backend = self.factory(conformance_context(namespace_fp))
        require(
            isinstance(backend, Backend),
            f"the factory returned a {type(backend).__name__}; expected a kvsdk.backend.Backend",
        )
        self._opened.append(backend)
        self.backend_name = type(backend).__name__
        return backend

    def fresh(self, namespace_fp: bytes = NAMESPACE_A) -> Backend:
        backend = self.open(namespace_fp)
        backend.clear()
        return backend

    def close_all(self) -> None:
        """Close every backend opened (each once more, for those a check closed)."""
        opened, self._opened = self._opened, []
        errors = []
        for backend in opened:
            try:
                backend.close()
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        require(not errors, f"close() raised {errors[0]}" if errors else "")


def put_all(b: Backend, items: Sequence[tuple[ChunkKey, Buffer]], what: str) -> None:
    ok = b.put(items)
    require(
        isinstance(ok, list) and len(ok) == len(items),
        f"put() of {len(items)} items returned {ok!r}; expected a list of {len(items)} bools",
    )
    require(all(x is True for x in ok), f"put() of {what} returned {ok}; expected all True")


def get_all(b: Backend, keys: Sequence[ChunkKey]) -> list[bytes | None]:
    got = b.get(keys)
    require(
        isinstance(got, list) and len(got) == len(keys),
        f"get() of {len(keys)} keys returned {len(got) if isinstance(got, list) else got!r} "
        f"values; expected a list of {len(keys)}",
    )
    return [as_bytes(v, "get()") for v in got]


def exists_all(b: Backend, keys: Sequence[ChunkKey]) -> list[bool]:
    got = b.exists(keys)
    require(
        isinstance(got, list) and len(got) == len(keys) and all(isinstance(x, bool) for x in got),
        f"exists() of {len(keys)} keys returned {got!r}; expected a list of {len(keys)} bools",
    )
    return got


def raw_access(h: Harness) -> RawAccess:
    if h.raw is None:
        raise CheckSkipped("no RawAccess given (needed to inspect and corrupt stored bytes)")
    return h.raw


@contextmanager
def harness(
    factory: BackendFactory, persistent: bool, shared: bool, raw: RawAccess | None
) -> Iterator[Harness]:
    h = Harness(factory, persistent=persistent, shared=shared, raw=raw)
    try:
        yield h
    except BaseException:
        with suppress(AssertionError):  # the check's own failure is the one to report
            h.close_all()
        raise
    h.close_all()
