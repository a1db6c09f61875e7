"""A directory of the disk tier swapped for a symlink to somewhere else while
the tier runs (someone with write access to the tier's directory): no read,
write or unlink ever goes through it. A key whose frame is planted at the
symlink's target is a miss, counted like a planted file; ``put`` writes
nothing there; ``delete``, eviction, ``clear`` and ``kvsdk clear`` unlink
nothing there; the start-up scan indexes and moves nothing from there. The
same for the namespace directory itself. A shard directory that was removed
is made again on the next write (see docs/security.md)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_disk_deadline import CHUNK, key, payload  # the same keys and payloads

from kvsdk.backend import TierContext
from kvsdk.backends.disk import DiskBackend, DiskOptions
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"symlinked-dirs-model", digest_size=16).digest()
SIZE = CHUNK + HEADER_SIZE
"""Bytes of one chunk file."""


def tier(root: Path, **kw: Any) -> DiskBackend:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    kw.setdefault("shards", 4)
    return DiskBackend(DiskOptions(path=str(root), **kw), ctx)


def shard_of(b: DiskBackend, k: bytes) -> Path:
    return Path(b._path(k)).parent


def keys_in(b: DiskBackend, shard: Path, n: int, start: int = 0) -> list[bytes]:
    """``n`` keys whose files belong in ``shard``."""
    out = [key(i) for i in range(start, start + 10_000) if shard_of(b, key(i)) == shard]
    return out[:n]


def keys_not_in(b: DiskBackend, shard: Path, n: int, start: int = 0) -> list[bytes]:
    out = [key(i) for i in range(start, start + 10_000) if shard_of(b, key(i)) != shard]
    return out[:n]


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (name relative to it) with its contents."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def outside_dir(tmp_path: Path, planted: list[bytes]) -> Path:
    """A directory outside the tier holding valid frames of ``planted`` (as the
    tier would name them) and a stale-looking temp file."""
    out = tmp_path / "outside"
    out.mkdir(mode=0o700)
    for k in planted:
        (out / f"{k.hex()}.kvc").write_bytes(encode_chunk(NS, k, b"\xee" * CHUNK))
    stale = out / ".tmp.left-over"
    stale.write_bytes(b"x")
    os.utime(stale, (1.0, 1.0))
    return out


def swap_for_symlink(d: Path, target: Path) -> None:
    """Replace directory ``d`` (and what it holds) by a symlink to ``target``."""
    shutil.rmtree(d)
    d.symlink_to(target, target_is_directory=True)


# -- a shard directory swapped after start -------------------------------------------------------


Swapped = tuple[DiskBackend, Path, Path, list[bytes], dict[str, bytes]]


@pytest.fixture
def swapped(tmp_path: Path) -> Iterator[Swapped]:
    """A running tier whose shard directory was swapped for a symlink to a
    directory outside holding planted frames of three keys of that shard (two
    of which the tier had stored): (tier, shard, outside, keys, outside's files)."""
    b = tier(tmp_path / "cache")
    k0 = key(0)
    shard = shard_of(b, k0)
    ks = keys_in(b, shard, 3)
    assert b.put([(k, payload(i)) for i, k in enumerate(ks[:2])]) == [True, True]
    out = outside_dir(tmp_path, ks)
    swap_for_symlink(shard, out)
    yield b, shard, out, ks, snapshot(out)
    b.close()


def test_a_key_planted_through_a_symlinked_shard_dir_is_a_miss(swapped: Swapped) -> None:
    b, _shard, out, ks, before = swapped
    assert b.exists(ks) == [False] * 3
    assert b.get(ks) == [None] * 3
    slots = [memoryview(bytearray(CHUNK)) for _ in ks]
    assert b.get_into(ks, slots) == [False] * 3
    assert all(bytes(s) != b"\xee" * CHUNK for s in slots), "nothing read from outside"
    parts = [[memoryview(bytearray(CHUNK // 2)), memoryview(bytearray(CHUNK // 2))] for _ in ks]
    assert b.get_into_parts(ks, parts) == [False] * 3
    s = b.stats()
    assert s["hits"] == 0 and s["rejected"] >= 1 and s["corrupt"] >= 1
    assert snapshot(out) == before


def test_put_through_a_symlinked_shard_dir_writes_nothing_outside(swapped: Swapped) -> None:
    b, shard, out, ks, before = swapped
    fresh = keys_in(b, shard, 3, start=20_000)
    got = b.put([(k, payload(i)) for i, k in enumerate(fresh)])
    got += b.put_parts([(ks[2], [memoryview(payload(7)[:100]), memoryview(payload(7)[100:])])])
    assert snapshot(out) == before, "nothing written outside"
    assert not shard.is_symlink() or got == [False] * 4
    for k, ok in zip([*fresh, ks[2]], got):  # what was stored is inside, and served
        if ok:
            assert Path(b._path(k)).is_file() and not Path(b._path(k)).is_symlink()
    assert b.get(fresh) == [payload(i) if ok else None for i, ok in enumerate(got[:3])]


def test_delete_through_a_symlinked_shard_dir_unlinks_nothing_outside(swapped: Swapped) -> None:
    b, _shard, out, ks, before = swapped
    b.delete(ks)
    assert snapshot(out) == before
    assert b.stats()["entries"] == 0


def test_clear_through_a_symlinked_shard_dir_unlinks_nothing_outside(swapped: Swapped) -> None:
    b, _shard, out, _ks, before = swapped
    b.clear()
    assert snapshot(out) == before
    assert b.stats()["entries"] == 0


def test_eviction_through_a_symlinked_shard_dir_unlinks_nothing_outside(tmp_path: Path) -> None:
    b = tier(tmp_path / "cache", capacity=4 * SIZE)
    shard = shard_of(b, key(0))
    ks = keys_in(b, shard, 2)
    others = keys_not_in(b, shard, 6)
    assert b.put([(k, payload(i)) for i, k in enumerate([*ks, *others[:2]])]) == [True] * 4
    out = outside_dir(tmp_path, ks)
    before = snapshot(out)
    swap_for_symlink(shard, out)
    assert b.put([(k, payload(i)) for i, k in enumerate(others[2:])]) == [True] * 4
    assert b.stats()["evictions"] >= 2
    assert snapshot(out) == before, "eviction unlinked nothing outside"
    b.close()


def test_kvsdk_clear_and_inspect_skip_a_symlinked_shard_dir(swapped: Swapped) -> None:
    _b, shard, out, _ks, before = swapped
    root = shard.parent.parent
    (row,) = DiskBackend.inventory(DiskOptions(path=str(root)))
    assert row["entries"] == 0, "files outside are not counted"
    DiskBackend.wipe(DiskOptions(path=str(root)))
    assert snapshot(out) == before


# -- the namespace directory swapped after start ------------------------------------------------


@pytest.mark.parametrize("shards", [1, 4])
def test_a_symlinked_namespace_dir_is_never_followed(tmp_path: Path, shards: int) -> None:
    root = tmp_path / "cache"
    b = tier(root, shards=shards)
    ks = [key(i) for i in range(6)]
    assert b.put([(k, payload(i)) for i, k in enumerate(ks[:3])]) == [True] * 3
    ns_dir = root / NS.hex()
    layout = {k: Path(b._path(k)).relative_to(ns_dir) for k in ks}
    out = tmp_path / "outside"
    for k, rel in layout.items():  # the same layout outside, with planted frames
        (out / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (out / rel).write_bytes(encode_chunk(NS, k, b"\xee" * CHUNK))
    before = snapshot(out)
    swap_for_symlink(ns_dir, out)

    assert b.exists(ks) == [False] * 6
    assert b.get(ks) == [None] * 6
    assert b.stats()["hits"] == 0 and b.stats()["rejected"] >= 1
    assert snapshot(out) == before
    b.delete(ks[:2])
    b.clear()
    assert snapshot(out) == before
    fresh = [key(i) for i in range(100, 104)]
    got = b.put([(k, payload(i)) for i, k in enumerate(fresh)])
    assert snapshot(out) == before, "nothing written outside"
    assert b.get(fresh) == [payload(i) if ok else None for i, ok in enumerate(got)]
    b.close()


# -- start-up ----------------------------------------------------------------------------------


def test_a_shard_dir_swapped_after_the_check_at_start_is_not_scanned(tmp_path: Path) -> None:
    """The scan after the directory check finds a shard directory swapped for a
    symlink: it indexes nothing from there, moves and removes nothing there."""
    root = tmp_path / "cache"
    first = tier(root)
    shard = shard_of(first, key(0))
    ks = keys_in(first, shard, 3)
    assert first.put([(k, payload(i)) for i, k in enumerate(ks)]) == [True] * 3
    first.close()
    out = outside_dir(tmp_path, [*ks, *keys_not_in(first, shard, 2)])  # misplaced ones too
    before = snapshot(out)

    class SwappedAfterCheck(DiskBackend):
        def _setup(self) -> None:
            super()._setup()
            if not shard.is_symlink():
                swap_for_symlink(shard, out)

    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    b = SwappedAfterCheck(DiskOptions(path=str(root), shards=4), ctx)
    assert b.stats()["entries"] == 0
    assert snapshot(out) == before, "nothing moved or removed outside"
    assert b.get(ks) == [None] * 3
    assert snapshot(out) == before
    b.close()


def test_a_symlinked_dir_of_another_shard_count_is_not_scanned(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier(root).close()
    planted = [key(i) for i in range(3)]
    out = outside_dir(tmp_path, planted)
    before = snapshot(out)
    (root / NS.hex() / "ff").symlink_to(out, target_is_directory=True)  # as shards=256 names
    b = tier(root)
    assert b.stats()["entries"] == 0
    assert b.get(planted) == [None] * 3
    b.clear()
    assert snapshot(out) == before
    b.close()


def test_a_symlinked_shard_dir_at_start_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    b = tier(root)
    shard = shard_of(b, key(0))
    b.close()
    out = outside_dir(tmp_path, [key(0)])
    before = snapshot(out)
    swap_for_symlink(shard, out)
    with pytest.raises(ValueError, match="symlink"):
        tier(root)
    assert snapshot(out) == before


# -- directories that went away ------------------------------------------------------------------


@pytest.mark.parametrize("which", ["shard", "namespace"])
def test_a_removed_directory_is_made_again_on_the_next_write(tmp_path: Path, which: str) -> None:
    root = tmp_path / "cache"
    b = tier(root)
    assert b.put([(key(0), payload(0))]) == [True]
    gone = shard_of(b, key(0)) if which == "shard" else root / NS.hex()
    shutil.rmtree(gone)
    assert b.get([key(0)]) == [None]
    assert b.put([(key(0), payload(0))]) == [True]
    assert Path(b._path(key(0))).is_file() and b.get([key(0)]) == [payload(0)]
    b.close()


def test_a_directory_made_again_by_another_instance_is_read_from(tmp_path: Path) -> None:
    """Another process removed the namespace directory and made it again: this
    tier finds the entries stored there, not the directory it had open."""
    root = tmp_path / "cache"
    a = tier(root)
    assert a.put([(key(0), payload(0))]) == [True]
    shutil.rmtree(root / NS.hex())
    other = tier(root)
    assert other.put([(key(1), payload(1))]) == [True]
    assert a.get([key(1)]) == [payload(1)]
    assert a.put([(key(2), payload(2))]) == [True]
    assert other.get([key(2)]) == [payload(2)]
    a.close()
    other.close()


def test_many_shards_keep_a_bounded_number_of_descriptors_open(tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    b = tier(tmp_path / "cache", shards=4096, capacity=1 << 30)
    ks = [key(i) for i in range(2000)]
    assert all(b.put([(k, payload(1)) for k in ks]))
    assert b.exists(ks) == [True] * len(ks)
    assert open_fds() - before < 600
    b.close()
    assert open_fds() - before < 64


def test_writes_follow_the_path_not_a_directory_moved_away_from_it(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    b = tier(root)
    assert b.put([(key(0), payload(0))]) == [True]
    root.rename(tmp_path / "moved")
    root.mkdir(mode=0o700)
    before = snapshot(tmp_path / "moved")
    assert b.put([(key(1), payload(1))]) == [True]
    assert snapshot(tmp_path / "moved") == before, "nothing written to the moved directory"
    assert Path(b._path(key(1))).is_file() and b.get([key(1)]) == [payload(1)]
    b.close()
