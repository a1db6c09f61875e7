"""The disk tier against a real file system: persistence, sharing, integrity, failures."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing as mp
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis_server import missing_tool

from kvsdk import plugins_manager
from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.backends.disk import (
    MTIME_REFRESH_SECONDS,
    READ_PIECE,
    STALE_TMP_SECONDS,
    DiskBackend,
    DiskOptions,
)
from kvsdk.backends.disk_files import copy_at
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk
from kvsdk.config import load_config
from kvsdk.eviction import ARCPolicy

NS = hashlib.blake2b(b"model-a", digest_size=16).digest()
NS_B = hashlib.blake2b(b"model-b", digest_size=16).digest()
CHUNK = 4096
LARGEST = 64 << 10
"""The largest payload the tests' tiers take (``TierContext.chunk_bytes``)."""


def ctx(ns: bytes = NS, chunk_bytes: int = CHUNK, **kw: Any) -> TierContext:
    return TierContext(namespace_fp=ns, namespace_hex=ns.hex(), chunk_bytes=chunk_bytes, **kw)


def disk(path: Path | str, ns: bytes = NS, **options: Any) -> DiskBackend:
    return DiskBackend(DiskOptions(path=str(path), **options), ctx(ns, LARGEST))


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def entry_file(root: Path, k: bytes) -> Path:
    (found,) = [p for p in files(root) if p.name == k.hex() + ".kvc"]
    return found


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[DiskBackend]:
    b = disk(tmp_path / "cache")
    yield b
    b.close()


# -- basics ------------------------------------------------------------------------------


def test_put_get_exists_delete_round_trip(backend: DiskBackend) -> None:
    keys = [key(i) for i in range(6)]
    assert backend.put([(k, payload(i)) for i, k in enumerate(keys)]) == [True] * 6
    assert backend.exists([*keys, key(99)]) == [True] * 6 + [False]
    got = backend.get([key(99), *keys])
    assert got[0] is None
    assert [bytes(v) for v in got[1:] if v is not None] == [payload(i) for i in range(6)]
    assert backend.delete(keys[:2]) == 2
    assert backend.exists(keys[:3]) == [False, False, True]
    s = backend.stats()
    assert s["entries"] == 4 and s["puts"] == 6 and s["hits"] == 6 and s["misses"] == 1
    assert s["bytes_used"] == 4 * (CHUNK + HEADER_SIZE)


def test_numpy_and_memoryview_payloads_come_back_as_flat_bytes(backend: DiskBackend) -> None:
    arr = np.arange(512, dtype=np.float32).reshape(8, 64)
    slab = np.zeros((2, 256), dtype=np.uint8)
    slab[1] = 7
    assert backend.put([(key(1), arr), (key(2), memoryview(slab[1]))]) == [True, True]
    a, b = backend.get([key(1), key(2)])
    assert a is not None and b is not None
    np.testing.assert_array_equal(np.frombuffer(a, dtype=np.float32).reshape(8, 64), arr)
    assert bytes(b) == bytes([7]) * 256


def test_clear_drops_only_this_namespace(tmp_path: Path) -> None:
    a, b = disk(tmp_path, NS), disk(tmp_path, NS_B)
    a.put([(key(1), payload(1))])
    b.put([(key(1), payload(2))])
    a.clear()
    assert a.exists([key(1)]) == [False] and a.stats()["entries"] == 0
    assert b.get([key(1)])[0] == payload(2)


def test_permissions_atomic_names_and_layout(tmp_path: Path) -> None:
    b = disk(tmp_path / "c", shards=16)
    b.put([(key(i), payload(i)) for i in range(20)])
    root = tmp_path / "c" / NS.hex()
    for d in [tmp_path / "c", root, *[p for p in root.iterdir() if p.is_dir()]]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    fs = files(tmp_path / "c")
    assert len(fs) == 20 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in fs)
    assert all(f.suffix == ".kvc" and f.parent.parent == root for f in fs)
    assert len({f.parent for f in fs}) > 1


def test_registered_through_the_backends_hook_and_config(tmp_path: Path) -> None:
    assert plugins_manager.backends()["disk"] is DiskBackend
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu"},
                {"backend": "disk", "path": str(tmp_path), "capacity": "1MiB", "fsync": True},
            ]
        }
    )
    opts = cfg.tiers[1].options
    assert isinstance(opts, DiskOptions) and opts.capacity == 1 << 20 and opts.fsync
    b = DiskBackend(opts, ctx())
    assert b.put([(key(1), b"durable")]) == [True] and b.get([key(1)])[0] == b"durable"


def test_put_of_a_present_key_is_not_rewritten(backend: DiskBackend, tmp_path: Path) -> None:
    backend.put([(key(1), payload(1))])
    f = entry_file(tmp_path / "cache", key(1))
    inode = f.stat().st_ino
    assert backend.put([(key(1), payload(1))]) == [True]
    assert f.stat().st_ino == inode and backend.stats()["put_skipped_present"] == 1


def test_get_into_reads_straight_into_destination_slots(backend: DiskBackend) -> None:
    backend.put([(key(i), payload(i)) for i in range(3)])
    backend.put([(key(9), payload(9, 100))])  # another size: cannot fill a slot
    slab = np.zeros((5, CHUNK), dtype=np.uint8)
    ok = backend.get_into([key(0), key(1), key(2), key(7), key(9)], [r.data for r in slab])
    assert ok == [True, True, True, False, False]
    assert [slab[i].tobytes() for i in range(3)] == [payload(i) for i in range(3)]
    assert backend.exists([key(9)]) == [True], "a valid entry of another size is kept"


def test_get_into_a_corrupt_entry_is_false_and_deleted(tmp_path: Path) -> None:
    b = disk(tmp_path)
    b.put([(key(1), payload(1))])
    f = entry_file(tmp_path, key(1))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(data)
    slot = np.zeros(CHUNK, dtype=np.uint8)
    assert b.get_into([key(1)], [slot.data]) == [False]
    assert not f.exists() and b.stats()["corrupt"] == 1


# -- scatter/gather (put_parts / get_into_parts) ----------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[memoryview]:
    """``data`` as separate buffers (copies) cut at ``cuts``."""
    edges = [0, *cuts, len(data)]
    return [memoryview(bytearray(data[a:b])) for a, b in itertools.pairwise(edges)]


def scattered(sizes: list[int], gap: int = 64) -> tuple[np.ndarray, list[memoryview]]:
    """Writable regions of these sizes inside one larger buffer, with gaps
    between them (like a page's K and V regions in a host pool)."""
    pool = np.full(sum(sizes) + gap * (len(sizes) + 1), 0xEE, dtype=np.uint8)
    views, off = [], gap
    for n in sizes:
        views.append(pool[off : off + n].data)
        off += n + gap
    return pool, views


def test_put_parts_writes_the_same_frame_as_put_of_the_joined_bytes(tmp_path: Path) -> None:
    b = disk(tmp_path, shards=1)
    b.put_parts([(key(1), split(payload(1), [100, 1000, 3000]))])
    b.put([(key(2), payload(2))])
    f1, f2 = entry_file(tmp_path, key(1)), entry_file(tmp_path, key(2))
    assert f1.read_bytes() == encode_chunk(NS, key(1), payload(1))
    assert f2.read_bytes() == encode_chunk(NS, key(2), payload(2))
    assert b.get([key(1)]) == [payload(1)]
    # typed (non-byte) views are taken as their bytes
    words = np.frombuffer(payload(3), dtype=np.uint16)
    b.put_parts([(key(3), [memoryview(words[:512]), memoryview(words[512:])])])
    assert b.get([key(3)]) == [payload(3)] and b.stats()["puts"] == 3
    assert b.put_parts([(key(1), split(payload(1), [5]))]) == [True]  # present: not rewritten
    assert b.stats()["put_skipped_present"] == 1


def test_get_into_parts_reads_into_scattered_regions(tmp_path: Path) -> None:
    b = disk(tmp_path, io_threads=2)
    b.put([(key(i), payload(i)) for i in range(3)])
    sizes = [1024, 1024, 2048]
    pools, outs = zip(*(scattered(sizes) for _ in range(5)))
    ok = b.get_into_parts([key(0), key(1), key(2), key(7), key(1)], [*outs[:4], outs[4][:2]])
    assert ok == [True, True, True, False, False]  # missing; parts of another total size
    for i in range(3):
        assert b"".join(bytes(v) for v in outs[i]) == payload(i)
        gaps = np.ones(pools[i].size, dtype=bool)
        for v in outs[i]:
            start = np.frombuffer(v, dtype=np.uint8).ctypes.data - pools[i].ctypes.data
            gaps[start : start + v.nbytes] = False
        assert (pools[i][gaps] == 0xEE).all(), "nothing written outside the regions"
    assert b.exists([key(1)]) == [True], "a valid entry of another size is kept"
    assert b.stats()["hits"] == 3 and b.stats()["corrupt"] == 0


def test_more_parts_than_one_system_call_takes(tmp_path: Path) -> None:
    b = disk(tmp_path)
    n = 2500  # > IOV_MAX (1024): several pwritev / readv calls
    data = payload(5, 4 * n)
    assert b.put_parts([(key(5), split(data, list(range(4, 4 * n, 4))))]) == [True]
    assert b.get([key(5)]) == [data]
    _, outs = scattered([4] * n, gap=4)
    assert b.get_into_parts([key(5)], [outs]) == [True]
    assert b"".join(bytes(v) for v in outs) == data


def test_pieces_land_at_their_byte_offsets_inside_typed_buffers() -> None:
    """``copy_at`` (a read piece copied on into the caller's parts): pieces of
    odd sizes land at the right byte offsets, also in parts that are not byte-typed."""
    data = payload(6, 3000)
    a, b = np.zeros(700, dtype=np.uint16), np.zeros(1600, dtype=np.uint8)
    for at in range(0, len(data), 333):
        copy_at(memoryview(data)[at : at + 333], at, [memoryview(a), memoryview(b)])
    assert a.tobytes() + b.tobytes() == data


def test_a_payload_of_many_read_pieces_comes_back_whole_and_checked(tmp_path: Path) -> None:
    """Larger than ``READ_PIECE``: read, checked and copied on a piece at a
    time, into one slot or scattered typed parts; a bit flipped in the last
    piece is a miss (and the file deleted)."""
    size = 2 * READ_PIECE + 1003
    b = DiskBackend(DiskOptions(path=str(tmp_path)), ctx(chunk_bytes=size))
    data = [payload(i, size) for i in (1, 2)]
    assert b.put([(key(i + 1), d) for i, d in enumerate(data)]) == [True, True]
    slot = memoryview(bytearray(size))
    assert b.get_into([key(1)], [slot]) == [True] and bytes(slot) == data[0]
    words = np.zeros(READ_PIECE // 2 + 7, dtype=np.uint16)
    rest = np.zeros(size - words.nbytes, dtype=np.uint8)
    assert b.get_into_parts([key(2)], [[memoryview(words), memoryview(rest)]]) == [True]
    assert words.tobytes() + rest.tobytes() == data[1]
    f = entry_file(tmp_path, key(1))
    frame = bytearray(f.read_bytes())
    frame[-2] ^= 0x10
    f.write_bytes(frame)
    assert b.get_into([key(1), key(2)], [slot, memoryview(bytearray(size))]) == [False, True]
    assert not f.exists() and b.stats()["corrupt"] == 1


def test_get_into_parts_a_corrupted_part_is_a_miss_and_deleted(tmp_path: Path) -> None:
    b = disk(tmp_path)
    b.put_parts([(key(i), split(payload(i), [1024, 2048])) for i in (1, 2)])
    f = entry_file(tmp_path, key(1))
    data = bytearray(f.read_bytes())
    data[HEADER_SIZE + 1500] ^= 0x01  # inside the second part
    f.write_bytes(data)
    outs = [scattered([1024, 1024, 2048])[1] for _ in range(2)]
    assert b.get_into_parts([key(1), key(2)], outs) == [False, True]
    assert b"".join(bytes(v) for v in outs[1]) == payload(2)
    assert not f.exists() and b.stats()["corrupt"] == 1 and b.exists([key(1)]) == [False]


def test_get_into_parts_a_truncated_file_is_a_miss_and_deleted(tmp_path: Path) -> None:
    b = disk(tmp_path)
    b.put([(key(1), payload(1))])
    f = entry_file(tmp_path, key(1))
    os.truncate(f, HEADER_SIZE + 3000)
    _, outs = scattered([1024, 3072])
    assert b.get_into_parts([key(1)], [outs]) == [False]
    assert not f.exists() and b.stats()["corrupt"] == 1


def test_get_into_parts_a_file_shrinking_during_the_read_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size the read trusts comes from ``fstat``; a file truncated right
    after it (another process) leaves parts unfilled, and the checksum fails."""
    b = disk(tmp_path)
    b.put([(key(1), payload(1)), (key(2), payload(2))])
    f = entry_file(tmp_path, key(1))
    real_fstat = os.fstat

    def fstat_then_shrink(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if st.st_size == f.stat().st_size and os.path.samestat(st, f.stat()):
            os.truncate(f, HEADER_SIZE + 2000)  # after the size was read
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_shrink)
    _, outs = scattered([1024, 3072])
    assert b.get_into_parts([key(1)], [outs]) == [False]
    monkeypatch.undo()
    assert not f.exists() and b.stats()["corrupt"] == 1
    _, outs = scattered([1024, 3072])
    assert b.get_into_parts([key(2)], [outs]) == [True]


def test_get_into_parts_a_frame_of_another_key_is_a_miss(tmp_path: Path) -> None:
    b = disk(tmp_path)
    b.put([(key(1), payload(1))])
    f = entry_file(tmp_path, key(1))
    f.write_bytes(encode_chunk(NS, key(7), payload(1)))  # right size, wrong key
    _, outs = scattered([2048, 2048])
    assert b.get_into_parts([key(1)], [outs]) == [False]
    assert not f.exists() and b.stats()["corrupt"] == 1


class DictBackend(Backend):
    """A backend without scatter/gather I/O: the base class's defaults apply."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.data for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        self.data.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def clear(self) -> None:
        self.data.clear()


def test_backend_defaults_join_and_split_the_parts() -> None:
    b = DictBackend()
    assert b.put_parts([(key(1), split(payload(1), [7, 2000]))]) == [True]
    assert b.data[key(1)] == payload(1)
    _, outs = scattered([96, 4000])
    _, short = scattered([96, 3999])
    assert b.get_into_parts([key(1), key(2), key(1)], [outs, outs, short]) == [True, False, False]
    assert b"".join(bytes(v) for v in outs) == payload(1)


def test_hits_refresh_the_mtime_only_of_files_not_touched_lately(tmp_path: Path) -> None:
    b = disk(tmp_path)
    b.put([(key(i), payload(i)) for i in range(2)])
    recent, old = time.time() - 10, time.time() - MTIME_REFRESH_SECONDS - 100
    os.utime(entry_file(tmp_path, key(0)), (recent, recent))
    os.utime(entry_file(tmp_path, key(1)), (old, old))
    _, outs = scattered([CHUNK])
    assert b.get([key(0)]) == [payload(0)] and b.get_into_parts([key(1)], [outs]) == [True]
    assert entry_file(tmp_path, key(0)).stat().st_mtime == pytest.approx(recent)
    assert entry_file(tmp_path, key(1)).stat().st_mtime > time.time() - 60


# -- capacity and restart ---------------------------------------------------------------------


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    size = CHUNK + HEADER_SIZE
    b = disk(tmp_path, capacity=4 * size)
    b.put([(key(i), payload(i)) for i in range(4)])
    b.get([key(0)])  # 0 becomes most recent; 1 is the LRU victim
    b.put([(key(4), payload(4))])
    assert b.exists([key(i) for i in range(5)]) == [True, False, True, True, True]
    assert len(files(tmp_path)) == 4 and b.stats()["evictions"] == 1
    assert b.stats()["bytes_used"] <= 4 * size
    assert b.put([(key(9), payload(9, 5 * size))]) == [False]  # never fits
    assert b.stats()["put_too_large"] == 1


def test_policy_factory_from_context_is_used(tmp_path: Path) -> None:
    made: list[int] = []

    def factory(capacity: int) -> ARCPolicy:
        made.append(capacity)
        return ARCPolicy(capacity)

    b = DiskBackend(
        DiskOptions(path=str(tmp_path), capacity=10 * CHUNK), ctx(policy_factory=factory)
    )
    assert made == [10]
    b.put([(key(i), payload(i)) for i in range(12)])
    assert b.stats()["bytes_used"] <= 10 * CHUNK


def test_restart_sees_entries_and_keeps_lru_order(tmp_path: Path) -> None:
    size = CHUNK + HEADER_SIZE
    first = disk(tmp_path, capacity=10 * size)
    for i in range(4):
        first.put([(key(i), payload(i))])
        os.utime(entry_file(tmp_path, key(i)), (1000 + i, 1000 + i))
    first.get([key(0)])  # a hit refreshes the file's mtime: 0 is now the newest
    first.close()
    second = disk(tmp_path, capacity=10 * size)
    assert second.stats()["entries"] == 4
    assert second.exists([key(i) for i in range(4)]) == [True] * 4  # (a get would touch)
    second.close()
    third = disk(tmp_path, capacity=3 * size)  # smaller: the oldest go at start
    assert third.exists([key(i) for i in range(4)]) == [True, False, True, True]


def test_restart_with_other_shard_count_moves_files(tmp_path: Path) -> None:
    disk(tmp_path, shards=256).put([(key(i), payload(i)) for i in range(10)])
    b = disk(tmp_path, shards=4)
    assert all(v is not None for v in b.get([key(i) for i in range(10)]))
    assert {f.parent.name for f in files(tmp_path)} <= {"0", "1", "2", "3"}


def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    disk(tmp_path).put([(key(1), payload(1))])
    shard = entry_file(tmp_path, key(1)).parent
    old, fresh = shard / ".tmp.old", shard / ".tmp.fresh"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - STALE_TMP_SECONDS - 5,) * 2)
    disk(tmp_path)
    assert not old.exists() and fresh.exists()


# -- integrity -----------------------------------------------------------------------------------


def corrupt_and_check(tmp_path: Path, damage: Any) -> DiskBackend:
    b = disk(tmp_path)
    b.put([(key(1), payload(1)), (key(2), payload(2))])
    f = entry_file(tmp_path, key(1))
    damage(f)
    got = b.get([key(1), key(2)])
    assert got[0] is None and got[1] == payload(2)
    assert not f.exists(), "the bad entry is deleted"
    assert b.stats()["corrupt"] == 1 and b.exists([key(1)]) == [False]
    return b


def test_flipped_payload_byte_is_a_miss_and_deleted(tmp_path: Path) -> None:
    def flip(f: Path) -> None:
        data = bytearray(f.read_bytes())
        data[HEADER_SIZE + 100] ^= 0x01
        f.write_bytes(data)

    corrupt_and_check(tmp_path, flip)


def test_flipped_header_byte_is_a_miss_and_deleted(tmp_path: Path) -> None:
    def flip(f: Path) -> None:
        data = bytearray(f.read_bytes())
        data[50] ^= 0x80  # inside the shape
        f.write_bytes(data)

    corrupt_and_check(tmp_path, flip)


def test_truncated_file_is_a_miss_and_deleted(tmp_path: Path) -> None:
    corrupt_and_check(tmp_path, lambda f: os.truncate(f, HEADER_SIZE + 10))


def test_empty_and_garbage_files_are_misses(tmp_path: Path) -> None:
    corrupt_and_check(tmp_path, lambda f: f.write_bytes(b""))
    corrupt_and_check(tmp_path / "2", lambda f: f.write_bytes(os.urandom(5000)))


def test_frame_of_another_namespace_or_key_is_a_miss(tmp_path: Path) -> None:
    corrupt_and_check(tmp_path, lambda f: f.write_bytes(encode_chunk(NS_B, key(1), payload(1))))
    corrupt_and_check(tmp_path / "2", lambda f: f.write_bytes(encode_chunk(NS, key(7), payload(1))))


def test_foreign_namespace_file_planted_in_our_directory(tmp_path: Path) -> None:
    other = disk(tmp_path, NS_B)
    other.put([(key(1), payload(1))])
    src = entry_file(tmp_path / NS_B.hex(), key(1))
    mine = disk(tmp_path, NS, shards=1)
    dst = tmp_path / NS.hex() / (key(1).hex() + ".kvc")
    dst.write_bytes(src.read_bytes())
    assert mine.get([key(1)]) == [None] and not dst.exists()
    assert other.get([key(1)])[0] == payload(1)


# -- sharing between processes ----------------------------------------------------------------------

N_SHARED = 24


def _writer(path: str, seed: int, rounds: int) -> dict[str, float]:
    b = disk(path, io_threads=2)
    for r in range(rounds):
        order = np.random.default_rng(seed * 100 + r).permutation(N_SHARED)
        assert all(b.put([(key(int(i)), payload(int(i), 20_000)) for i in order]))
        b.delete([key(int(i)) for i in order[:4]])  # forces rewrites next round
    stats: dict[str, float] = b.stats()
    return stats


def _reader(path: str, seconds: float) -> tuple[int, int]:
    b = disk(path)
    hits = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for i, v in enumerate(b.get([key(i) for i in range(N_SHARED)])):
            if v is not None:
                assert bytes(v) == payload(i, 20_000)
                hits += 1
    return hits, int(b.stats()["corrupt"])


def test_two_processes_writing_the_same_keys_and_a_reader(tmp_path: Path) -> None:
    fork = mp.get_context("fork")
    with fork.Pool(3) as pool:
        reader = pool.apply_async(_reader, (str(tmp_path), 2.0))
        writers = [pool.apply_async(_writer, (str(tmp_path), s, 15)) for s in (1, 2)]
        stats = [w.get(timeout=60) for w in writers]
        hits, corrupt = reader.get(timeout=60)
    assert corrupt == 0 and hits > 0
    assert all(s["put_failures"] == 0 for s in stats)
    assert not [f for f in files(tmp_path) if f.name.startswith(".tmp")]
    fresh = disk(tmp_path)
    for i, v in enumerate(fresh.get([key(i) for i in range(N_SHARED)])):
        assert v is None or bytes(v) == payload(i, 20_000)
    assert fresh.stats()["corrupt"] == 0


def test_entries_stored_by_another_instance_after_start_are_found(tmp_path: Path) -> None:
    early = disk(tmp_path)
    late_writer = disk(tmp_path)
    late_writer.put([(key(1), payload(1)), (key(2), payload(2))])
    assert early.exists([key(1)]) == [True]
    assert early.get([key(2)])[0] == payload(2)
    assert early.stats()["entries"] == 2
    late_writer.delete([key(1)])  # evicted elsewhere: a miss here, index follows
    assert early.get([key(1)]) == [None] and early.stats()["entries"] == 1


def test_threads_hammering_one_instance_keep_accounting_exact(tmp_path: Path) -> None:
    b = disk(tmp_path, capacity=30 * (CHUNK + HEADER_SIZE))
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                i = int(rng.integers(0, 60))
                op = rng.integers(0, 3)
                if op == 0:
                    b.put([(key(i), payload(i))])
                elif op == 1:
                    v = b.get([key(i)])[0]
                    assert v is None or bytes(v) == payload(i)
                else:
                    b.delete([key(i)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = b.stats()
    on_disk = files(tmp_path)
    assert s["bytes_reserved"] == 0 and s["corrupt"] == 0
    assert s["entries"] == len(on_disk) and s["bytes_used"] == sum(
        f.stat().st_size for f in on_disk
    )
    assert s["bytes_used"] <= 30 * (CHUNK + HEADER_SIZE)


# -- failures: full disk, read-only, permission denied ---------------------------------------------


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        missing_tool(
            f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_refuses_stores_and_keeps_serving(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "256k") as mnt:
        b = disk(mnt, capacity=1 << 30)  # capacity far above what the disk holds
        results = b.put([(key(i), payload(i, 40_000)) for i in range(12)])
        assert any(results) and not all(results)
        s = b.stats()
        assert s["put_enospc"] == results.count(False) and s["put_failures"] == s["put_enospc"]
        assert s["bytes_reserved"] == 0
        assert not [f for f in files(mnt) if f.name.startswith(".tmp")], "no temp file left"
        stored = [key(i) for i, ok in enumerate(results) if ok]
        assert all(v is not None for v in b.get(stored))
        b.delete(stored[:2])  # room again: stores succeed again
        assert b.put([(key(50), payload(50, 40_000))]) == [True]
        b.close()


def test_read_only_mount_refuses_stores_but_serves_what_is_there(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "1m") as mnt:
        disk(mnt).put([(key(1), payload(1))])
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        b = disk(mnt)
        assert b.put([(key(2), payload(2))]) == [False]
        assert b.stats()["put_erofs"] == 1
        assert b.get([key(1)])[0] == payload(1)
        assert b.exists([key(1), key(2)]) == [True, False]


def _unprivileged_put(path: str, q: Any) -> None:
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    b = disk(path)
    q.put((b.put([(key(1), payload(1))]), b.stats()["put_eacces"], b.get([key(1)])))


def test_permission_denied_refuses_stores(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    if os.geteuid() != 0:
        locked.chmod(0o500)
    fork = mp.get_context("fork")
    q = fork.Queue()
    p = fork.Process(target=_unprivileged_put, args=(str(locked), q))
    p.start()
    ok, eacces, got = q.get(timeout=30)
    p.join(timeout=30)
    assert ok == [False] and eacces == 1 and got == [None]
