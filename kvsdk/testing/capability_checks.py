"""The conformance checks of declared capabilities: ``get_into``, scatter/gather,
the local index (``may_contain``),
I/O, ``capacity_bytes`` and ``corrupt_count``. A flag a backend sets must be
backed by its own method; the base class's defaults must work for everyone."""

from __future__ import annotations

import numpy as np

from kvsdk.backend import Backend
from kvsdk.testing.harness import Harness, get_all, key_for, payload_for, put_all, require


def check_get_into(h: Harness) -> None:
    """get_into() (native when supports_get_into) fills right-sized buffers; a
    miss or another size is False."""
    b = h.fresh()
    cls = type(b)
    require(
        cls.get_into is not Backend.get_into or not cls.supports_get_into,
        f"{cls.__name__}.supports_get_into is True but get_into() is the base class's copy",
    )
    get_into = b.get_into
    k, k2 = key_for("into"), key_for("into", 1)
    v, v2 = payload_for("into", 4096), payload_for("into", 1000)
    put_all(b, [(k, v), (k2, v2)], "two keys")
    slab = np.zeros((3, 4096), dtype=np.uint8)
    outs = [memoryview(slab[0]), memoryview(slab[1]), memoryview(slab[2])]
    ok = get_into([k, key_for("into-missing"), k2], outs)
    require(
        ok == [True, False, False],
        f"get_into([stored, missing, stored with 1000 bytes into 4096]) returned {ok}; "
        "expected [True, False, False]",
    )
    require(slab[0].tobytes() == v, "get_into() reported True but the buffer holds other bytes")
    require(get_all(b, [k2]) == [v2], "an entry get_into() refused for its size is gone")


def check_scatter_gather(h: Harness) -> None:
    """put_parts() / get_into_parts() (native when supports_scatter_gather) move a
    payload given as parts; parts of another total size are a miss."""
    b = h.fresh()
    cls = type(b)
    require(
        not cls.supports_scatter_gather
        or (cls.put_parts is not Backend.put_parts
            and cls.get_into_parts is not Backend.get_into_parts),
        f"{cls.__name__}.supports_scatter_gather is True but put_parts() / get_into_parts() "
        "are the base class's copies",
    )  # fmt: skip
    k, k2 = key_for("parts"), key_for("parts", 1)
    v = payload_for("parts", 3000)
    views = [memoryview(v)[:1000], memoryview(v)[1000:1024], memoryview(v)[1024:]]
    ok = b.put_parts([(k, views), (k2, [memoryview(v)])])
    require(ok == [True, True], f"put_parts() of two payloads returned {ok}; expected all True")
    require(get_all(b, [k]) == [v], "get() of a payload stored by put_parts() returned other bytes")
    out = np.zeros(3000, dtype=np.uint8)
    parts = [out[:7].data, out[7:2500].data, out[2500:].data]
    short = [memoryview(bytearray(1000)), memoryview(bytearray(1000))]
    got = b.get_into_parts([k2, key_for("parts-missing"), k], [parts, short, short])
    require(
        got == [True, False, False],
        f"get_into_parts([stored, missing, stored into 2000 of 3000 bytes]) returned {got}; "
        "expected [True, False, False]",
    )
    require(out.tobytes() == v, "get_into_parts() reported True but the parts hold other bytes")


def check_capacity_and_counters(h: Harness) -> None:
    """capacity_bytes() is a positive int or None; corrupt_count() a non-negative int."""
    b = h.fresh()
    cap = b.capacity_bytes()
    require(
        cap is None or (isinstance(cap, int) and cap > 0),
        f"capacity_bytes() is {cap!r}; expected a positive int or None",
    )
    n = b.corrupt_count()
    require(isinstance(n, int) and n >= 0, f"corrupt_count() is {n!r}; expected an int >= 0")


def check_local_index(h: Harness) -> None:
    """may_contain() answers one bool per key, from memory; with
    supports_local_index, never False for a key this instance stored (its own
    writes are in its index at once), and the base class's says True for all."""
    b = h.fresh()
    cls = type(b)
    require(
        cls.may_contain is not Backend.may_contain or not cls.supports_local_index,
        f"{cls.__name__}.supports_local_index is True but may_contain() is the base class's",
    )
    stored = [key_for("index", i) for i in range(4)]
    put_all(b, [(k, payload_for("index", 512)) for k in stored], "four keys")
    absent = key_for("index-never-stored")
    said = b.may_contain([*stored, absent])
    require(
        isinstance(said, list) and len(said) == len(stored) + 1,
        f"may_contain() of 5 keys returned {said!r}; expected 5 bools",
    )
    require(
        all(said[: len(stored)]),
        f"may_contain() said {said[: len(stored)]} for keys this instance just stored; "
        "a local index must never say False for them",
    )
    if not b.supports_local_index:
        require(said[-1], "without a local index may_contain() must say True for every key")
