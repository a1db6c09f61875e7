"""The conformance checks, one function per behaviour, and :data:`CHECKS` naming them."""

from __future__ import annotations

import dataclasses
import math
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvsdk.backend import Buffer
from kvsdk.chunk_format import CorruptChunk, decode_chunk, encode_chunk
from kvsdk.testing.capability_checks import (
    check_capacity_and_counters,
    check_get_into,
    check_local_index,
    check_scatter_gather,
)
from kvsdk.testing.harness import (
    NAMESPACE_A,
    NAMESPACE_B,
    PAYLOAD_SIZES,
    THREADS,
    CheckSkipped,
    Harness,
    exists_all,
    get_all,
    key_for,
    payload_for,
    put_all,
    raw_access,
    require,
    show,
)
from kvsdk.types import ChunkKey, Locality, Medium


def check_class_attributes(h: Harness) -> None:
    """name, Options (a frozen dataclass), medium and locality are declared."""
    b = h.fresh()
    cls = type(b)
    require(
        isinstance(cls.name, str) and bool(cls.name),
        f"{cls.__name__}.name is {cls.name!r}; expected the backend's name",
    )
    opts = cls.Options
    require(
        dataclasses.is_dataclass(opts)
        and getattr(getattr(opts, "__dataclass_params__", None), "frozen", False),
        f"{cls.__name__}.Options is {opts!r}; expected a frozen dataclass (it is built from YAML)",
    )
    require(
        isinstance(cls.medium, Medium),
        f"{cls.__name__}.medium is {cls.medium!r}; expected a kvsdk.types.Medium",
    )
    require(
        isinstance(cls.locality, Locality),
        f"{cls.__name__}.locality is {cls.locality!r}; expected a kvsdk.types.Locality",
    )
    for flag in ("supports_listing", "supports_get_into", "supports_scatter_gather"):
        value = getattr(cls, flag)
        require(isinstance(value, bool), f"{cls.__name__}.{flag} is {value!r}; expected a bool")
    if h.shared:
        require(
            cls.locality is not Locality.PROCESS,
            f"{cls.__name__} is tested as shared but declares locality PROCESS; "
            "expected NODE or CLUSTER",
        )


def check_round_trip(h: Harness) -> None:
    """Payloads of every size in PAYLOAD_SIZES come back byte for byte."""
    b = h.fresh()
    keys = [key_for("round-trip", size) for size in PAYLOAD_SIZES]
    values = [payload_for("round-trip", size) for size in PAYLOAD_SIZES]
    put_all(b, list(zip(keys, values)), f"payloads of {list(PAYLOAD_SIZES)} bytes")
    present = exists_all(b, keys)
    require(
        present == [True] * len(keys),
        f"exists() after put is {present}; expected all True",
    )
    for size, want, got in zip(PAYLOAD_SIZES, values, get_all(b, keys)):
        require(got is not None, f"get() of a stored {size}-byte payload was a miss")
        require(
            got == want,
            f"get() of a stored {size}-byte payload returned {show(got)}; expected {show(want)}",
        )


def check_buffer_types(h: Harness) -> None:
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
        put_all(b, [(k, value)], f"a {what}")
    for i, ((what, _), got) in enumerate(zip(inputs, get_all(b, keys))):
        require(got == slab[i].tobytes(), f"get() after put() of a {what} returned {show(got)}")


def check_empty_batches(h: Harness) -> None:
    """Empty batches are answered with empty results."""
    b = h.fresh()
    for op, result, want in (
        ("exists([])", b.exists([]), []),
        ("get([])", b.get([]), []),
        ("put([])", b.put([]), []),
        ("delete([])", b.delete([]), 0),
    ):
        require(result == want, f"{op} returned {result!r}; expected {want!r}")


def check_missing_keys(h: Harness) -> None:
    """A key never stored is a miss everywhere, not an error."""
    b = h.fresh()
    keys = [key_for("missing", i) for i in range(3)]
    present = exists_all(b, keys)
    require(present == [False] * 3, f"exists() of missing keys is {present}")
    got = get_all(b, keys)
    require(
        got == [None] * 3,
        f"get() of missing keys returned {[show(v) for v in got]}; expected None each",
    )
    n = b.delete(keys)
    require(
        n == 0 and not isinstance(n, bool), f"delete() of missing keys returned {n!r}; expected 0"
    )


def check_batch_order_and_duplicates(h: Harness) -> None:
    """One answer per key, in order, with duplicates and misses interleaved."""
    b = h.fresh()
    a, c, d, missing = (key_for("order", i) for i in range(4))
    va, vc, vd = (payload_for(f"order{i}", 100 + i) for i in range(3))
    ok = b.put([(a, va), (c, vc), (a, va), (d, vd)])
    require(ok == [True] * 4, f"put() with a key given twice returned {ok}; expected [True] * 4")
    ask = [d, missing, a, c, a, missing, d]
    want = [vd, None, va, vc, va, None, vd]
    got = get_all(b, ask)
    require(
        got == want,
        "get([d, missing, a, c, a, missing, d]) returned "
        f"[{', '.join(show(v) for v in got)}]; expected [{', '.join(show(v) for v in want)}]",
    )
    present = exists_all(b, ask)
    require(
        present == [v is not None for v in want],
        f"exists([d, missing, a, c, a, missing, d]) returned {present}",
    )


def check_delete_counts(h: Harness) -> None:
    """delete() returns how many distinct stored keys it removed."""
    b = h.fresh()
    keys = [key_for("delete", i) for i in range(4)]
    put_all(b, [(k, payload_for("delete", 64 + i)) for i, k in enumerate(keys)], "4 keys")
    n = b.delete([keys[0], keys[1], keys[0], key_for("delete-missing")])
    require(n == 2, f"delete([k0, k1, k0, missing]) of stored k0, k1 returned {n!r}; expected 2")
    present = exists_all(b, keys)
    require(
        present == [False, False, True, True],
        f"exists() after delete is {present}",
    )
    got = get_all(b, keys[:2])
    require(got == [None, None], f"get() of deleted keys returned {[show(v) for v in got]}")
    n = b.delete(keys[:2])
    require(n == 0, f"delete() of already deleted keys returned {n!r}; expected 0")


def check_clear(h: Harness) -> None:
    """clear() drops every entry; the backend stays usable."""
    b = h.fresh()
    keys = [key_for("clear", i) for i in range(5)]
    put_all(b, [(k, payload_for("clear", 10 + i)) for i, k in enumerate(keys)], "5 keys")
    b.clear()
    present = exists_all(b, keys)
    require(present == [False] * 5, f"exists() after clear() is {present}")
    require(get_all(b, keys) == [None] * 5, "get() after clear() returned data")
    b.clear()  # clearing an empty backend is fine
    put_all(b, [(keys[0], b"after clear")], "a key after clear()")
    require(get_all(b, keys[:1]) == [b"after clear"], "get() of a key stored after clear() failed")


def check_put_existing_key(h: Harness) -> None:
    """put() of a stored key returns True and the key stays readable."""
    b = h.fresh()
    k, k2 = key_for("existing"), key_for("existing", 1)
    v, other = payload_for("existing", 500), payload_for("existing-other", 500)
    put_all(b, [(k, v)], "a key")
    put_all(b, [(k, v)], "the same key and value again")
    require(
        get_all(b, [k]) == [v], "get() after putting the same key twice did not return its value"
    )
    put_all(b, [(k2, v)], "a second key")
    ok = b.put([(k2, other)])
    require(
        ok == [True], f"put() of a stored key with another value returned {ok}; expected [True]"
    )
    (got,) = get_all(b, [k2])
    require(
        got in (v, other),
        f"get() after re-putting a key returned {show(got)}; expected the first or the second value",
    )


def check_stats(h: Harness) -> None:
    """stats() maps names to finite numbers (before and after use)."""
    b = h.fresh()
    for when in ("before use", "after use"):
        stats = b.stats()
        require(
            isinstance(stats, dict),
            f"stats() {when} returned {type(stats).__name__}; expected a dict",
        )
        for name, value in stats.items():
            require(isinstance(name, str), f"stats() {when} has a key {name!r}; expected strings")
            require(
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value),
                f"stats()[{name!r}] {when} is {value!r}; expected a finite number",
            )
        k = key_for("stats")
        b.put([(k, b"x" * 10)])
        b.get([k, key_for("stats", 1)])


def check_namespaces(h: Harness) -> None:
    """Two namespaces on one location: same key, separate entries, separate clear()."""
    a, b = h.fresh(NAMESPACE_A), h.fresh(NAMESPACE_B)
    shared_key, only_a = key_for("ns"), key_for("ns", 1)
    va, vb = payload_for("ns-a", 300), payload_for("ns-b", 300)
    put_all(a, [(shared_key, va), (only_a, va)], "two keys in namespace A")
    require(
        exists_all(b, [shared_key, only_a]) == [False, False], "namespace B sees namespace A's keys"
    )
    require(
        get_all(b, [shared_key, only_a]) == [None, None], "namespace B reads namespace A's entries"
    )
    put_all(b, [(shared_key, vb)], "the same key in namespace B")
    require(
        get_all(a, [shared_key]) == [va], "namespace A's entry changed when B stored the same key"
    )
    require(
        get_all(b, [shared_key]) == [vb], "namespace B did not get its own value for the shared key"
    )
    n = b.delete([only_a])
    require(n == 0, f"delete() in namespace B of a key only A has returned {n}; expected 0")
    b.clear()
    require(
        get_all(a, [shared_key, only_a]) == [va, va],
        "clear() in namespace B removed namespace A's entries",
    )
    put_all(b, [(shared_key, vb)], "the shared key in namespace B again")
    a.clear()
    require(get_all(b, [shared_key]) == [vb], "clear() in namespace A removed namespace B's entry")


def check_chunk_format_frames(h: Harness) -> None:
    """What the backend stores is a kvsdk.chunk_format frame for this namespace and key."""
    raw = raw_access(h)
    b = h.fresh()
    k, v = key_for("frame"), payload_for("frame", 4096)
    put_all(b, [(k, v)], "a key")
    stored = raw.read_raw(b, k)
    require(stored is not None, "read_raw() found nothing for a key put() reported stored")
    assert stored is not None
    try:
        payload = decode_chunk(stored, namespace_fp=NAMESPACE_A, key=k)
    except CorruptChunk as exc:
        raise AssertionError(
            f"the stored value is not a valid chunk_format frame: {exc.reason}"
        ) from None
    require(bytes(payload) == v, "the stored frame's payload differs from what was put")
    require(
        raw.read_raw(b, key_for("frame-missing")) is None,
        "read_raw() of a missing key is not None",
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


def check_corrupt_entries_are_misses(h: Harness) -> None:
    """A corrupt, truncated, foreign or garbage value is a miss, and is deleted."""
    raw = raw_access(h)
    b = h.fresh()
    value = payload_for("corrupt", 4096)
    for i, (what, corrupt) in enumerate(CORRUPTIONS):
        k = key_for("corrupt", i)
        put_all(b, [(k, value)], "a key")
        frame = raw.read_raw(b, k)
        require(frame is not None, "read_raw() found nothing for a key put() reported stored")
        assert frame is not None
        bad = corrupt(frame, k, value)
        raw.write_raw(b, k, bad)
        before = b.corrupt_count()
        got = get_all(b, [k])
        require(
            got == [None],
            f"get() of a stored value with {what} returned {show(got[0])}; expected a miss",
        )
        require(
            raw.read_raw(b, k) is None,
            f"a stored value with {what} was not deleted after get() rejected it",
        )
        after = b.corrupt_count()
        require(
            isinstance(after, int) and after > before,
            f"corrupt_count() was {before} before and {after!r} after get() rejected a stored "
            f"value with {what}; expected it to grow",
        )
        raw.write_raw(b, k, bad)
        ok = b.get_into([k], [memoryview(bytearray(len(value)))])
        require(
            ok == [False],
            f"get_into() of a stored value with {what} returned {ok}; expected [False]",
        )
        require(
            raw.read_raw(b, k) is None,
            f"a stored value with {what} was not deleted after get_into() rejected it",
        )
        put_all(b, [(k, value)], f"a key whose stored value had {what}")
        require(
            get_all(b, [k]) == [value], f"a key whose value had {what} could not be stored again"
        )


def check_concurrent_calls(h: Harness) -> None:
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
            put_all(b, [*batch, *common], f"thread {t}'s keys and the common keys")
            keys = [k for k, _ in (*batch, *common)]
            want = [v for _, v in (*batch, *common)]
            got = get_all(b, keys)
            require(
                got == want, f"thread {t}, round {round_}: get() returned other bytes than were put"
            )
            require(
                exists_all(b, keys) == [True] * len(keys),
                f"thread {t}: exists() missed keys it stored",
            )
            b.stats()
        n = b.delete([k for k, _ in own[:8]])
        require(n == 8, f"thread {t}: delete() of 8 of its own keys returned {n}; expected 8")
        got = get_all(b, [k for k, _ in own])
        require(
            got == [None] * 8 + [v for _, v in own[8:]],
            f"thread {t}: after deleting half its keys get() returned the wrong entries",
        )

    with ThreadPoolExecutor(THREADS, thread_name_prefix="kvsdk-conformance") as pool:
        for fut in [pool.submit(work, t) for t in range(THREADS)]:
            fut.result(timeout=120)
    require(get_all(b, [k for k, _ in common]) == [v for _, v in common], "the common keys changed")


def check_close_idempotent(h: Harness) -> None:
    """close() may be called twice."""
    b = h.fresh()
    b.put([(key_for("close"), b"bye")])
    b.close()
    b.close()


def check_listing(h: Harness) -> None:
    """iter_keys() yields exactly the stored keys (when supports_listing)."""
    b = h.fresh()
    if not type(b).supports_listing:
        raise CheckSkipped(f"{type(b).__name__}.supports_listing is False")
    keys = [key_for("listing", i) for i in range(6)]
    put_all(b, [(k, payload_for("listing", i + 1)) for i, k in enumerate(keys)], "6 keys")
    b.delete(keys[:2])
    listed = list(b.iter_keys())
    require(len(listed) == len(set(listed)), "iter_keys() yielded a key twice")
    require(
        set(listed) == set(keys[2:]),
        f"iter_keys() yielded {len(listed)} keys; expected the 4 stored "
        f"({len(set(listed) - set(keys[2:]))} unexpected, {len(set(keys[2:]) - set(listed))} missing)",
    )


def check_persistent(h: Harness) -> None:
    """A new instance on the same location sees what a closed one stored."""
    if not h.persistent:
        raise CheckSkipped("not declared persistent")
    first = h.fresh()
    keys = [key_for("persist", i) for i in range(3)]
    values = [payload_for("persist", 100 * (i + 1)) for i in range(3)]
    put_all(first, list(zip(keys, values)), "3 keys")
    first.delete(keys[2:])
    first.close()
    second = h.open()
    present = exists_all(second, keys)
    require(
        present == [True, True, False],
        f"a reopened instance's exists() is {present}",
    )
    require(
        get_all(second, keys) == [*values[:2], None],
        "a reopened instance does not return what was stored",
    )


def check_shared(h: Harness) -> None:
    """Two live instances on one location see each other's puts, deletes and clears."""
    if not h.shared:
        raise CheckSkipped("not declared shared")
    one, two = h.fresh(), h.open()
    k, k2 = key_for("shared"), key_for("shared", 1)
    v = payload_for("shared", 2048)
    put_all(one, [(k, v), (k2, v)], "two keys in the first instance")
    require(
        exists_all(two, [k, k2]) == [True, True],
        "the second instance does not see the first one's put()",
    )
    require(
        get_all(two, [k]) == [v], "the second instance reads other bytes than the first one stored"
    )
    n = two.delete([k])
    require(
        n == 1, f"the second instance's delete() of the first one's key returned {n}; expected 1"
    )
    require(
        exists_all(one, [k]) == [False], "the first instance still sees a key the second deleted"
    )
    require(get_all(one, [k]) == [None], "the first instance still reads a key the second deleted")
    two.clear()
    require(
        get_all(one, [k2]) == [None],
        "the first instance still reads a key after the second's clear()",
    )


CHECKS: dict[str, Callable[[Harness], None]] = {
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
    "scatter_gather": check_scatter_gather,
    "capacity_and_counters": check_capacity_and_counters,
    "local_index": check_local_index,
    "persistent": check_persistent,
    "shared": check_shared,
}
"""Every check, by name, in the order they run."""
