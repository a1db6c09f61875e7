"""The backend conformance suite: the checks every storage backend passes.

kvsdk's own ``disk`` and ``redis`` backends run exactly these checks, and a
third-party backend runs them the same way, either from a plain function::

    from kvsdk.testing import run_backend_conformance

    def test_my_backend_conforms(tmp_path):
        run_backend_conformance(
            lambda ctx: MyBackend(MyOptions(path=str(tmp_path)), ctx),
            persistent=True,
            shared=True,
        )

or as a pytest class, one test per check (a failure names the behaviour)::

    import pytest
    from kvsdk.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        persistent = True
        shared = True

        @pytest.fixture
        def backend_factory(self, tmp_path):
            return lambda ctx: MyBackend(MyOptions(path=str(tmp_path)), ctx)

The factory is called with a :class:`~kvsdk.backend.TierContext` (as
kvsdk's store factory calls ``cls(options, context)``) and must open the
*same storage location* on every call within one run: that is how the suite
builds a second namespace on the same location, and, with ``persistent`` or
``shared``, a second instance. Give it room for at least
:data:`MIN_CAPACITY_BYTES`. Every check starts with ``clear()`` on what it opens.

What the suite pins down:

- Payloads of 0, 1, 13, 4 KiB, 256 KiB + 3 and 1 MiB + 1 bytes round-trip
  exactly. ``put`` accepts ``bytes``, ``bytearray`` and ``memoryview`` (also
  of a numpy ``uint8`` row, which is what the tiered store passes); ``get``
  returns a flat byte buffer whose ``len()`` is its byte length. A
  zero-length payload is included on purpose: the store never writes one,
  but a backend that tests ``if value:`` instead of ``is not None`` would
  turn a stored chunk into a miss, and a framed entry is never empty anyway.
- Batched calls answer one value per key, in order, with duplicate and
  missing keys interleaved; empty batches are fine. A missing key is a miss:
  ``exists`` False, ``get`` None, ``delete`` counts 0, never an exception.
- ``delete`` returns how many distinct stored keys it removed; ``clear``
  drops every entry of the backend's namespace and no other namespace's.
- ``put`` of a key already stored returns True and the key stays readable
  (keys are content hashes: a second value for the same key is equal in
  practice; a backend may keep either).
- ``stats()`` is a ``dict`` of names to finite numbers.
- Two namespaces on one location never see each other's entries.
- Several threads calling one instance at once get correct answers.
- ``close()`` may be called twice.
- ``iter_keys()`` lists exactly the stored keys (when ``supports_listing``).
- ``get_into`` (when defined) fills right-sized buffers and answers False
  for a missing key or a buffer of another size.
- ``persistent=True``: a new instance on the same location, opened after the
  first was closed, sees its entries.
- ``shared=True``: two live instances see each other's puts, deletes and clears;
  the backend then declares a ``locality`` wider than ``PROCESS``.

Integrity checks need raw access to what the backend stored; a backend
that keeps bytes outside the process (and so frames them with
:mod:`kvsdk.chunk_format`) provides it as a :class:`RawAccess` (``raw=`` or
the class attribute): ``read_raw(backend, key)`` returns the stored bytes,
``write_raw(backend, key, data)`` replaces (or creates) them. With it the
suite checks that entries are chunk-format frames for the right namespace
and key, and that a corrupt, truncated, foreign, pickled or garbage value is
a miss that the backend deletes. Without it those two checks are skipped.

Capacity and eviction are not checked here: their semantics are each
backend's own (test them next to the backend).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.chunk_format import CorruptChunk, decode_chunk, encode_chunk
from kvsdk.eviction import LRUPolicy
from kvsdk.types import ChunkKey, Locality, Medium

__all__ = [
    "CHUNK_BYTES",
    "MIN_CAPACITY_BYTES",
    "NAMESPACE_A",
    "NAMESPACE_B",
    "PAYLOAD_SIZES",
    "BackendConformance",
    "BackendFactory",
    "ConformanceReport",
    "RawAccess",
    "conformance_context",
    "run_backend_conformance",
]

BackendFactory = Callable[[TierContext], Backend]
"""``factory(context) -> backend`` on one storage location."""

NAMESPACE_A = hashlib.blake2b(b"kvsdk.testing namespace A", digest_size=16).digest()
NAMESPACE_B = hashlib.blake2b(b"kvsdk.testing namespace B", digest_size=16).digest()
PAYLOAD_SIZES: tuple[int, ...] = (0, 1, 13, 4096, (256 << 10) + 3, (1 << 20) + 1)
CHUNK_BYTES = 1 << 20
"""``TierContext.chunk_bytes`` the suite passes (the usual payload size)."""
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


def _show(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return f"{len(data)} bytes ({data[:8].hex()}{'...' if len(data) > 8 else ''})"
    return repr(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _as_bytes(value: Buffer | None, op: str) -> bytes | None:
    """``value`` as bytes, after checking it is a flat byte buffer (or None)."""
    if value is None:
        return None
    _require(
        isinstance(value, bytes | bytearray | memoryview),
        f"{op} returned a {type(value).__name__}; expected bytes, bytearray, memoryview or None",
    )
    nbytes = memoryview(value).nbytes
    _require(
        len(value) == nbytes,
        f"{op} returned a buffer whose len() is {len(value)} but holds {nbytes} bytes; "
        "expected a flat byte buffer (memoryview of format 'B')",
    )
    return bytes(value)


class _Harness:
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
        _require(
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
        _require(not errors, f"close() raised {errors[0]}" if errors else "")


# -- the checks ----------------------------------------------------------------------------


def _put_all(b: Backend, items: Sequence[tuple[ChunkKey, Buffer]], what: str) -> None:
    ok = b.put(items)
    _require(
        isinstance(ok, list) and len(ok) == len(items),
        f"put() of {len(items)} items returned {ok!r}; expected a list of {len(items)} bools",
    )
    _require(all(x is True for x in ok), f"put() of {what} returned {ok}; expected all True")


def _get(b: Backend, keys: Sequence[ChunkKey]) -> list[bytes | None]:
    got = b.get(keys)
    _require(
        isinstance(got, list) and len(got) == len(keys),
        f"get() of {len(keys)} keys returned {len(got) if isinstance(got, list) else got!r} "
        f"values; expected a list of {len(keys)}",
    )
    return [_as_bytes(v, "get()") for v in got]


def _exists(b: Backend, keys: Sequence[ChunkKey]) -> list[bool]:
    got = b.exists(keys)
    _require(
        isinstance(got, list) and len(got) == len(keys) and all(isinstance(x, bool) for x in got),
        f"exists() of {len(keys)} keys returned {got!r}; expected a list of {len(keys)} bools",
    )
    return got


def check_class_attributes(h: _Harness) -> None:
    """name, Options (a frozen dataclass), medium and locality are declared."""
    b = h.fresh()
    cls = type(b)
    _require(
        isinstance(cls.name, str) and bool(cls.name),
        f"{cls.__name__}.name is {cls.name!r}; expected the backend's name",
    )
    opts = cls.Options
    _require(
        dataclasses.is_dataclass(opts)
        and getattr(getattr(opts, "__dataclass_params__", None), "frozen", False),
        f"{cls.__name__}.Options is {opts!r}; expected a frozen dataclass (it is built from YAML)",
    )
    _require(
        isinstance(cls.medium, Medium),
        f"{cls.__name__}.medium is {cls.medium!r}; expected a kvsdk.types.Medium",
    )
    _require(
        isinstance(cls.locality, Locality),
        f"{cls.__name__}.locality is {cls.locality!r}; expected a kvsdk.types.Locality",
    )
    if h.shared:
        _require(
            cls.locality is not Locality.PROCESS,
            f"{cls.__name__} is tested as shared but declares locality PROCESS; "
            "expected NODE or CLUSTER",
        )


def check_round_trip(h: _Harness) -> None:
    """Payloads of every size in PAYLOAD_SIZES come back byte for byte."""
    b = h.fresh()
    keys = [key_for("round-trip", size) for size in PAYLOAD_SIZES]
    values = [payload_for("round-trip", size) for size in PAYLOAD_SIZES]
    _put_all(b, list(zip(keys, values)), f"payloads of {list(PAYLOAD_SIZES)} bytes")
    present = _exists(b, keys)
    _require(
        present == [True] * len(keys),
        f"exists() after put is {present}; expected all True",
    )
    for size, want, got in zip(PAYLOAD_SIZES, values, _get(b, keys)):
        _require(got is not None, f"get() of a stored {size}-byte payload was a miss")
        _require(
            got == want,
            f"get() of a stored {size}-byte payload returned {_show(got)}; expected {_show(want)}",
        )


def check_buffer_types(h: _Harness) -> None:
    """put() takes bytes, bytearray, memoryview and a numpy uint8 row view."""
    b = h.fresh()
    slab = np.frombuffer(payload_for("buffers", 4 * 4096), dtype=np.uint8).reshape(4, 4096).copy()
    inputs: list[tuple[str, Buffer]] = [
        ("bytes", bytes(slab[0])),
        ("bytearray", bytearray(slab[1].tobytes())),
        ("memoryview of bytes", memoryview(slab[2].tobytes())),
        ("memoryview of a numpy uint8 row", memoryview(slab[3])),
    ]
    keys = [key_for("buffers", i) for i in range(len(inputs))]
    for k, (what, value) in zip(keys, inputs):
        _put_all(b, [(k, value)], f"a {what}")
    for i, ((what, _), got) in enumerate(zip(inputs, _get(b, keys))):
        _require(got == slab[i].tobytes(), f"get() after put() of a {what} returned {_show(got)}")


def check_empty_batches(h: _Harness) -> None:
    """Empty batches are answered with empty results."""
    b = h.fresh()
    for op, result, want in (
        ("exists([])", b.exists([]), []),
        ("get([])", b.get([]), []),
        ("put([])", b.put([]), []),
        ("delete([])", b.delete([]), 0),
    ):
        _require(result == want, f"{op} returned {result!r}; expected {want!r}")


def check_missing_keys(h: _Harness) -> None:
    """A key never stored is a miss everywhere, not an error."""
    b = h.fresh()
    keys = [key_for("missing", i) for i in range(3)]
    present = _exists(b, keys)
    _require(present == [False] * 3, f"exists() of missing keys is {present}")
    got = _get(b, keys)
    _require(
        got == [None] * 3,
        f"get() of missing keys returned {[_show(v) for v in got]}; expected None each",
    )
    n = b.delete(keys)
    _require(
        n == 0 and not isinstance(n, bool), f"delete() of missing keys returned {n!r}; expected 0"
    )


def check_batch_order_and_duplicates(h: _Harness) -> None:
    """One answer per key, in order, with duplicates and misses interleaved."""
    b = h.fresh()
    a, c, d, missing = (key_for("order", i) for i in range(4))
    va, vc, vd = (payload_for(f"order{i}", 100 + i) for i in range(3))
    ok = b.put([(a, va), (c, vc), (a, va), (d, vd)])
    _require(ok == [True] * 4, f"put() with a key given twice returned {ok}; expected [True] * 4")
    ask = [d, missing, a, c, a, missing, d]
    want = [vd, None, va, vc, va, None, vd]
    got = _get(b, ask)
    _require(
        got == want,
        "get([d, missing, a, c, a, missing, d]) returned "
        f"[{', '.join(_show(v) for v in got)}]; expected [{', '.join(_show(v) for v in want)}]",
    )
    present = _exists(b, ask)
    _require(
        present == [v is not None for v in want],
        f"exists([d, missing, a, c, a, missing, d]) returned {present}",
    )


def check_delete_counts(h: _Harness) -> None:
    """delete() returns how many distinct stored keys it removed."""
    b = h.fresh()
    keys = [key_for("delete", i) for i in range(4)]
    _put_all(b, [(k, payload_for("delete", 64 + i)) for i, k in enumerate(keys)], "4 keys")
    n = b.delete([keys[0], keys[1], keys[0], key_for("delete-missing")])
    _require(n == 2, f"delete([k0, k1, k0, missing]) of stored k0, k1 returned {n!r}; expected 2")
    present = _exists(b, keys)
    _require(
        present == [False, False, True, True],
        f"exists() after delete is {present}",
    )
    got = _get(b, keys[:2])
    _require(got == [None, None], f"get() of deleted keys returned {[_show(v) for v in got]}")
    n = b.delete(keys[:2])
    _require(n == 0, f"delete() of already deleted keys returned {n!r}; expected 0")


def check_clear(h: _Harness) -> None:
    """clear() drops every entry; the backend stays usable."""
    b = h.fresh()
    keys = [key_for("clear", i) for i in range(5)]
    _put_all(b, [(k, payload_for("clear", 10 + i)) for i, k in enumerate(keys)], "5 keys")
    b.clear()
    present = _exists(b, keys)
    _require(present == [False] * 5, f"exists() after clear() is {present}")
    _require(_get(b, keys) == [None] * 5, "get() after clear() returned data")
    b.clear()  # clearing an empty backend is fine
    _put_all(b, [(keys[0], b"after clear")], "a key after clear()")
    _require(_get(b, keys[:1]) == [b"after clear"], "get() of a key stored after clear() failed")


def check_put_existing_key(h: _Harness) -> None:
    """put() of a stored key returns True and the key stays readable."""
    b = h.fresh()
    k, k2 = key_for("existing"), key_for("existing", 1)
    v, other = payload_for("existing", 500), payload_for("existing-other", 500)
    _put_all(b, [(k, v)], "a key")
    _put_all(b, [(k, v)], "the same key and value again")
    _require(_get(b, [k]) == [v], "get() after putting the same key twice did not return its value")
    _put_all(b, [(k2, v)], "a second key")
    ok = b.put([(k2, other)])
    _require(
        ok == [True], f"put() of a stored key with another value returned {ok}; expected [True]"
    )
    (got,) = _get(b, [k2])
    _require(
        got in (v, other),
        f"get() after re-putting a key returned {_show(got)}; expected the first or the second value",
    )


def check_stats(h: _Harness) -> None:
    """stats() maps names to finite numbers (before and after use)."""
    b = h.fresh()
    for when in ("before use", "after use"):
        stats = b.stats()
        _require(
            isinstance(stats, dict),
            f"stats() {when} returned {type(stats).__name__}; expected a dict",
        )
        for name, value in stats.items():
            _require(isinstance(name, str), f"stats() {when} has a key {name!r}; expected strings")
            _require(
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value),
                f"stats()[{name!r}] {when} is {value!r}; expected a finite number",
            )
        k = key_for("stats")
        b.put([(k, b"x" * 10)])
        b.get([k, key_for("stats", 1)])


def check_namespaces(h: _Harness) -> None:
    """Two namespaces on one location: same key, separate entries, separate clear()."""
    a, b = h.fresh(NAMESPACE_A), h.fresh(NAMESPACE_B)
    shared_key, only_a = key_for("ns"), key_for("ns", 1)
    va, vb = payload_for("ns-a", 300), payload_for("ns-b", 300)
    _put_all(a, [(shared_key, va), (only_a, va)], "two keys in namespace A")
    _require(
        _exists(b, [shared_key, only_a]) == [False, False], "namespace B sees namespace A's keys"
    )
    _require(
        _get(b, [shared_key, only_a]) == [None, None], "namespace B reads namespace A's entries"
    )
    _put_all(b, [(shared_key, vb)], "the same key in namespace B")
    _require(
        _get(a, [shared_key]) == [va], "namespace A's entry changed when B stored the same key"
    )
    _require(
        _get(b, [shared_key]) == [vb], "namespace B did not get its own value for the shared key"
    )
    n = b.delete([only_a])
    _require(n == 0, f"delete() in namespace B of a key only A has returned {n}; expected 0")
    b.clear()
    _require(
        _get(a, [shared_key, only_a]) == [va, va],
        "clear() in namespace B removed namespace A's entries",
    )
    _put_all(b, [(shared_key, vb)], "the shared key in namespace B again")
    a.clear()
    _require(_get(b, [shared_key]) == [vb], "clear() in namespace A removed namespace B's entry")


def check_chunk_format_frames(h: _Harness) -> None:
    """What the backend stores is a kvsdk.chunk_format frame for this namespace and key."""
    raw = _raw(h)
    b = h.fresh()
    k, v = key_for("frame"), payload_for("frame", 4096)
    _put_all(b, [(k, v)], "a key")
    stored = raw.read_raw(b, k)
    _require(stored is not None, "read_raw() found nothing for a key put() reported stored")
    assert stored is not None
    try:
        payload = decode_chunk(stored, namespace_fp=NAMESPACE_A, key=k)
    except CorruptChunk as exc:
        raise AssertionError(
            f"the stored value is not a valid chunk_format frame: {exc.reason}"
        ) from None
    _require(bytes(payload) == v, "the stored frame's payload differs from what was put")
    _require(
        raw.read_raw(b, key_for("frame-missing")) is None, "read_raw() of a missing key is not None"
    )


_Corrupt = Callable[[bytes, ChunkKey, bytes], bytes]
"""``(stored frame, key, payload) -> bad bytes``"""


def _flip(at: int) -> _Corrupt:
    def edit(frame: bytes, key: ChunkKey, value: bytes) -> bytes:
        out = bytearray(frame)
        out[at % len(out)] ^= 0xFF
        return bytes(out)

    return edit


CORRUPTIONS: tuple[tuple[str, _Corrupt], ...] = (
    ("a payload byte flipped", _flip(-1)),
    ("the format version changed", _flip(5)),
    ("the payload length changed", _flip(112)),
    ("a checksum byte flipped", _flip(120)),
    ("the last byte cut off", lambda f, k, v: f[:-1]),
    ("a cut inside the header", lambda f, k, v: f[:100]),
    ("a trailing byte", lambda f, k, v: f + b"\0"),
    ("no bytes at all", lambda f, k, v: b""),
    ("garbage", lambda f, k, v: payload_for("garbage", 777)),
    ("another namespace's frame", lambda f, k, v: encode_chunk(NAMESPACE_B, k, v)),
    ("another key's frame", lambda f, k, v: encode_chunk(NAMESPACE_A, key_for("other"), v)),
    ("a pickled payload", lambda f, k, v: pickle.dumps(v)),
)
"""Ways a stored value goes bad, each of which must read as a miss."""


def check_corrupt_entries_are_misses(h: _Harness) -> None:
    """A corrupt, truncated, foreign or garbage value is a miss, and is deleted."""
    raw = _raw(h)
    b = h.fresh()
    value = payload_for("corrupt", 4096)
    get_into = getattr(b, "get_into", None)
    for i, (what, corrupt) in enumerate(CORRUPTIONS):
        k = key_for("corrupt", i)
        _put_all(b, [(k, value)], "a key")
        frame = raw.read_raw(b, k)
        _require(frame is not None, "read_raw() found nothing for a key put() reported stored")
        assert frame is not None
        bad = corrupt(frame, k, value)
        raw.write_raw(b, k, bad)
        got = _get(b, [k])
        _require(
            got == [None],
            f"get() of a stored value with {what} returned {_show(got[0])}; expected a miss",
        )
        _require(
            raw.read_raw(b, k) is None,
            f"a stored value with {what} was not deleted after get() rejected it",
        )
        if get_into is not None:
            raw.write_raw(b, k, bad)
            ok = get_into([k], [memoryview(bytearray(len(value)))])
            _require(
                ok == [False],
                f"get_into() of a stored value with {what} returned {ok}; expected [False]",
            )
            _require(
                raw.read_raw(b, k) is None,
                f"a stored value with {what} was not deleted after get_into() rejected it",
            )
        _put_all(b, [(k, value)], f"a key whose stored value had {what}")
        _require(_get(b, [k]) == [value], f"a key whose value had {what} could not be stored again")


def check_concurrent_calls(h: _Harness) -> None:
    """THREADS threads calling one instance at once get correct answers."""
    b = h.fresh()
    common = [
        (key_for("threads-common", i), payload_for("threads-common", 1000 + i)) for i in range(8)
    ]
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        own = [
            (key_for(f"threads-{t}", i), payload_for(f"threads-{t}", 2000 + i)) for i in range(16)
        ]
        start.wait(timeout=30)
        for round_ in range(4):
            batch = own[round_ * 4 : round_ * 4 + 4]
            _put_all(b, [*batch, *common], f"thread {t}'s keys and the common keys")
            keys = [k for k, _ in (*batch, *common)]
            want = [v for _, v in (*batch, *common)]
            got = _get(b, keys)
            _require(
                got == want, f"thread {t}, round {round_}: get() returned other bytes than were put"
            )
            _require(
                _exists(b, keys) == [True] * len(keys),
                f"thread {t}: exists() missed keys it stored",
            )
            b.stats()
        n = b.delete([k for k, _ in own[:8]])
        _require(n == 8, f"thread {t}: delete() of 8 of its own keys returned {n}; expected 8")
        got = _get(b, [k for k, _ in own])
        _require(
            got == [None] * 8 + [v for _, v in own[8:]],
            f"thread {t}: after deleting half its keys get() returned the wrong entries",
        )

    with ThreadPoolExecutor(THREADS, thread_name_prefix="kvsdk-conformance") as pool:
        for fut in [pool.submit(work, t) for t in range(THREADS)]:
            fut.result(timeout=120)
    _require(_get(b, [k for k, _ in common]) == [v for _, v in common], "the common keys changed")


def check_close_idempotent(h: _Harness) -> None:
    """close() may be called twice."""
    b = h.fresh()
    b.put([(key_for("close"), b"bye")])
    b.close()
    b.close()


def check_listing(h: _Harness) -> None:
    """iter_keys() yields exactly the stored keys (when supports_listing)."""
    b = h.fresh()
    if not type(b).supports_listing:
        raise CheckSkipped(f"{type(b).__name__}.supports_listing is False")
    keys = [key_for("listing", i) for i in range(6)]
    _put_all(b, [(k, payload_for("listing", i + 1)) for i, k in enumerate(keys)], "6 keys")
    b.delete(keys[:2])
    listed = list(b.iter_keys())
    _require(len(listed) == len(set(listed)), "iter_keys() yielded a key twice")
    _require(
        set(listed) == set(keys[2:]),
        f"iter_keys() yielded {len(listed)} keys; expected the 4 stored "
        f"({len(set(listed) - set(keys[2:]))} unexpected, {len(set(keys[2:]) - set(listed))} missing)",
    )


def check_get_into(h: _Harness) -> None:
    """get_into() fills right-sized buffers; a miss or another size is False."""
    b = h.fresh()
    get_into = getattr(b, "get_into", None)
    if get_into is None:
        raise CheckSkipped(f"{type(b).__name__} has no get_into()")
    k, k2 = key_for("into"), key_for("into", 1)
    v, v2 = payload_for("into", 4096), payload_for("into", 1000)
    _put_all(b, [(k, v), (k2, v2)], "two keys")
    slab = np.zeros((3, 4096), dtype=np.uint8)
    outs = [memoryview(slab[0]), memoryview(slab[1]), memoryview(slab[2])]
    ok = get_into([k, key_for("into-missing"), k2], outs)
    _require(
        ok == [True, False, False],
        f"get_into([stored, missing, stored with 1000 bytes into 4096]) returned {ok}; "
        "expected [True, False, False]",
    )
    _require(slab[0].tobytes() == v, "get_into() reported True but the buffer holds other bytes")
    _require(_get(b, [k2]) == [v2], "an entry get_into() refused for its size is gone")


def check_persistent(h: _Harness) -> None:
    """A new instance on the same location sees what a closed one stored."""
    if not h.persistent:
        raise CheckSkipped("not declared persistent")
    first = h.fresh()
    keys = [key_for("persist", i) for i in range(3)]
    values = [payload_for("persist", 100 * (i + 1)) for i in range(3)]
    _put_all(first, list(zip(keys, values)), "3 keys")
    first.delete(keys[2:])
    first.close()
    second = h.open()
    present = _exists(second, keys)
    _require(
        present == [True, True, False],
        f"a reopened instance's exists() is {present}",
    )
    _require(
        _get(second, keys) == [*values[:2], None],
        "a reopened instance does not return what was stored",
    )


def check_shared(h: _Harness) -> None:
    """Two live instances on one location see each other's puts, deletes and clears."""
    if not h.shared:
        raise CheckSkipped("not declared shared")
    one, two = h.fresh(), h.open()
    k, k2 = key_for("shared"), key_for("shared", 1)
    v = payload_for("shared", 2048)
    _put_all(one, [(k, v), (k2, v)], "two keys in the first instance")
    _require(
        _exists(two, [k, k2]) == [True, True],
        "the second instance does not see the first one's put()",
    )
    _require(
        _get(two, [k]) == [v], "the second instance reads other bytes than the first one stored"
    )
    n = two.delete([k])
    _require(
        n == 1, f"the second instance's delete() of the first one's key returned {n}; expected 1"
    )
    _require(_exists(one, [k]) == [False], "the first instance still sees a key the second deleted")
    _require(_get(one, [k]) == [None], "the first instance still reads a key the second deleted")
    two.clear()
    _require(
        _get(one, [k2]) == [None], "the first instance still reads a key after the second's clear()"
    )


def _raw(h: _Harness) -> RawAccess:
    if h.raw is None:
        raise CheckSkipped("no RawAccess given (needed to inspect and corrupt stored bytes)")
    return h.raw


CHECKS: dict[str, Callable[[_Harness], None]] = {
    "class_attributes": check_class_attributes,
    "round_trip": check_round_trip,
    "buffer_types": check_buffer_types,
    "empty_batches": check_empty_batches,
    "missing_keys": check_missing_keys,
    "batch_order_and_duplicates": check_batch_order_and_duplicates,
    "delete_counts": check_delete_counts,
    "clear": check_clear,
    "put_existing_key": check_put_existing_key,
    "stats": check_stats,
    "namespaces": check_namespaces,
    "chunk_format_frames": check_chunk_format_frames,
    "corrupt_entries_are_misses": check_corrupt_entries_are_misses,
    "concurrent_calls": check_concurrent_calls,
    "close_idempotent": check_close_idempotent,
    "listing": check_listing,
    "get_into": check_get_into,
    "persistent": check_persistent,
    "shared": check_shared,
}
"""Every check, by name, in the order they run."""


@contextmanager
def _harness(
    factory: BackendFactory, persistent: bool, shared: bool, raw: RawAccess | None
) -> Iterator[_Harness]:
    h = _Harness(factory, persistent=persistent, shared=shared, raw=raw)
    try:
        yield h
    except BaseException:
        with suppress(AssertionError):  # the check's own failure is the one to report
            h.close_all()
        raise
    h.close_all()


def run_backend_conformance(
    make_backend: BackendFactory,
    *,
    persistent: bool,
    shared: bool,
    raw: RawAccess | None = None,
    checks: Sequence[str] | None = None,
) -> ConformanceReport:
    """Run every check (or those named in ``checks``) against backends from ``make_backend``.

    Raises :class:`AssertionError` listing each failed check with its reason;
    otherwise returns which checks passed and which were skipped (and why).
    """
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; expected some of {list(CHECKS)}")
    report = ConformanceReport(backend="backend")
    failures: list[str] = []
    for name in names:
        try:
            with _harness(make_backend, persistent, shared, raw) as h:
                try:
                    CHECKS[name](h)
                finally:
                    report.backend = h.backend_name or report.backend
        except CheckSkipped as exc:
            report.skipped[name] = str(exc)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        except Exception as exc:
            failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
        else:
            report.passed.append(name)
    if failures:
        raise AssertionError(
            f"{report.backend}: {len(failures)} of {len(names)} conformance checks failed:\n"
            + "\n".join(f"  - {f}" for f in failures)
        )
    return report


class BackendConformance:
    """A pytest mixin: one test per check. Subclass it as ``Test...``, set
    ``persistent`` / ``shared`` (and ``raw`` to enable the integrity checks)
    and provide a ``backend_factory`` fixture returning a :data:`BackendFactory`."""

    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    raw: ClassVar[RawAccess | None] = None

    def _run(self, name: str, factory: BackendFactory) -> None:
        try:
            with _harness(factory, self.persistent, self.shared, self.raw) as h:
                CHECKS[name](h)
        except CheckSkipped as exc:
            import pytest

            pytest.skip(str(exc))

    def test_declares_name_options_medium_and_locality(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("class_attributes", backend_factory)

    def test_payloads_of_every_size_round_trip(self, backend_factory: BackendFactory) -> None:
        self._run("round_trip", backend_factory)

    def test_put_accepts_every_buffer_type(self, backend_factory: BackendFactory) -> None:
        self._run("buffer_types", backend_factory)

    def test_empty_batches_give_empty_answers(self, backend_factory: BackendFactory) -> None:
        self._run("empty_batches", backend_factory)

    def test_missing_keys_are_misses(self, backend_factory: BackendFactory) -> None:
        self._run("missing_keys", backend_factory)

    def test_batches_keep_order_with_duplicates_and_misses(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("batch_order_and_duplicates", backend_factory)

    def test_delete_counts_distinct_stored_keys(self, backend_factory: BackendFactory) -> None:
        self._run("delete_counts", backend_factory)

    def test_clear_drops_every_entry(self, backend_factory: BackendFactory) -> None:
        self._run("clear", backend_factory)

    def test_put_of_a_stored_key_succeeds(self, backend_factory: BackendFactory) -> None:
        self._run("put_existing_key", backend_factory)

    def test_stats_are_finite_numbers(self, backend_factory: BackendFactory) -> None:
        self._run("stats", backend_factory)

    def test_namespaces_never_see_each_other(self, backend_factory: BackendFactory) -> None:
        self._run("namespaces", backend_factory)

    def test_entries_are_chunk_format_frames(self, backend_factory: BackendFactory) -> None:
        self._run("chunk_format_frames", backend_factory)

    def test_corrupt_or_foreign_entries_are_deleted_misses(
        self, backend_factory: BackendFactory
    ) -> None:
        self._run("corrupt_entries_are_misses", backend_factory)

    def test_concurrent_calls_get_correct_answers(self, backend_factory: BackendFactory) -> None:
        self._run("concurrent_calls", backend_factory)

    def test_close_twice_is_fine(self, backend_factory: BackendFactory) -> None:
        self._run("close_idempotent", backend_factory)

    def test_iter_keys_lists_exactly_the_stored_keys(self, backend_factory: BackendFactory) -> None:
        self._run("listing", backend_factory)

    def test_get_into_fills_right_sized_buffers(self, backend_factory: BackendFactory) -> None:
        self._run("get_into", backend_factory)

    def test_a_reopened_instance_sees_stored_entries(self, backend_factory: BackendFactory) -> None:
        self._run("persistent", backend_factory)

    def test_live_instances_share_entries(self, backend_factory: BackendFactory) -> None:
        self._run("shared", backend_factory)
