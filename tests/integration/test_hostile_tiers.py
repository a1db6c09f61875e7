"""Shared tiers written by someone else: a hostile writer with access to the
disk directory and the Redis database, and files that try to hang or exhaust
a worker (see docs/security.md).

- With a deployment secret, a writer who knows the prompt plants frames in
  every way it can (its own namespace name, overwriting the entries it can
  see, copying one entry over another, editing a payload): the engine's store
  loads none of them, and every chunk it serves equals the reference.
- Without a secret, the same planted frames load: the documented behaviour.
- A FIFO, a symlink, a 100 GiB sparse file where a chunk file belongs: each a
  miss within a deadline, no I/O thread left blocked; a cache directory of
  another user, or open to others, is refused at start.
- A read that hangs (a network file system gone): a miss after ``read_timeout``,
  the reader threads bounded, no late write into the caller's slot, and the
  entries hit again once the file system is back.
- A huge value planted in Redis costs at most one frame on the wire.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_tiering import (  # the tier chains and the way an adapter drives a store
    CHUNK,
    HIT,
    MISS,
    Chain,
    chains,
    pump,
    read,
    redis_client,
    redis_server,
    resolve,
    save,
)

from kvsdk.backend import TierContext
from kvsdk.backends.disk import DiskBackend, DiskOptions
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.chunk_format import HEADER_SIZE, encode_chunk, parse_header
from kvsdk.keys import GroupLayout, Namespace, chunk_keys, token_chunk_hashes
from kvsdk.trust import DeploymentSecret

pytestmark = pytest.mark.integration
__all__ = ["chains", "redis_server"]  # fixtures used here

SECRET = DeploymentSecret(b"hostile-writer-test-deployment-secret")
PROMPT = list(range(7, 7 + 32 * 6))  # a prompt the attacker knows: six 32-token chunks
DEADLINE_S = 5.0


def victim_namespace(secret: DeploymentSecret | None) -> Namespace:
    return Namespace(
        model="hostile-model",
        dtype="float32",
        groups=(GroupLayout((2, CHUNK // 2), "uint8"),),
        tokens_per_chunk=32,
        secret=secret,
    )


def prompt_keys(ns: Namespace) -> list[bytes]:
    """What an engine computes for PROMPT (an engine's prefix hash is public)."""
    return chunk_keys(ns.fingerprint, token_chunk_hashes(PROMPT, 32), 0)


def reference(i: int) -> bytes:
    return bytes([i % 251]) * CHUNK


EVIL = b"\xee" * CHUNK


def plant_everything(chain: Chain, victim: Namespace) -> int:
    """Everything a writer without the secret can do; returns how many entries it
    changed. It knows the prompt, lists the directory and the database, reads
    every frame."""
    unkeyed = victim_namespace(None)
    changed = 0
    if chain.disk_dir is not None:
        changed += plant_on_disk(chain.disk_dir, victim, unkeyed)
    if chain.redis is not None:
        changed += plant_in_redis(chain, victim, unkeyed)
    return changed


def plant_computable(disk_dir: Path, unkeyed: Namespace) -> None:
    """Valid frames under the namespace and keys a writer without the secret computes."""
    for k in prompt_keys(unkeyed):
        frame = encode_chunk(unkeyed.public_fp, k, EVIL)
        shard = disk_dir / unkeyed.hex / "00"
        for d in (disk_dir, shard.parent, shard):
            d.mkdir(exist_ok=True, mode=0o700)
            d.chmod(0o700)
        (shard / f"{k.hex()}.kvc").write_bytes(frame)


def plant_on_disk(disk_dir: Path, victim: Namespace, unkeyed: Namespace) -> int:
    plant_computable(disk_dir, unkeyed)
    # every entry it can see in the victim's namespace: overwritten
    changed = 0
    files = sorted((disk_dir / victim.hex).rglob("*.kvc"))
    for n, f in enumerate(files):
        frame = f.read_bytes()
        h = parse_header(frame)
        if n % 3 == 0:  # a valid unkeyed frame for that very namespace name and key
            f.write_bytes(encode_chunk(h.namespace_fp, h.key, EVIL))
        elif n % 3 == 1:  # the MAC'd frame of another key, copied over this one
            f.write_bytes(files[(n + 1) % len(files)].read_bytes())
        else:  # the payload edited, the MAC kept
            f.write_bytes(frame[:HEADER_SIZE] + EVIL)
        changed += 1
    return changed


def plant_in_redis(chain: Chain, victim: Namespace, unkeyed: Namespace) -> int:
    assert chain.redis is not None
    client = redis_client(chain.redis)
    for k in prompt_keys(unkeyed):
        client.set(f"kvsdk:{unkeyed.hex}:{k.hex()}", encode_chunk(unkeyed.public_fp, k, EVIL))
    changed = 0
    for rk in client.scan_iter(match=f"kvsdk:{victim.hex}:*".encode()):
        frame = client.get(rk)
        h = parse_header(frame)
        client.set(rk, encode_chunk(h.namespace_fp, h.key, EVIL))
        changed += 1
    client.close()
    return changed


@pytest.mark.parametrize("name", ["cpu-disk", "cpu-redis", "cpu-disk-redis"])
def test_with_a_secret_no_planted_frame_loads(name: str, chains: Callable[..., Chain]) -> None:
    chain = chains(name)
    victim = victim_namespace(SECRET)
    keys = prompt_keys(victim)
    assert set(keys).isdisjoint(prompt_keys(victim_namespace(None)))
    writer = chain.store(victim)
    save(writer, {k: reference(i) for i, k in enumerate(keys)})
    pump(writer)
    tiers = (chain.disk_dir is not None) + (chain.redis is not None)
    assert plant_everything(chain, victim) == tiers * len(keys)  # every entry it can see

    store = chain.store(victim)
    answers = resolve(store, keys)
    assert all(HIT not in a and a[-1] is MISS for a in answers.values()), answers
    first = chain.tier(store, DiskBackend if chain.disk_dir is not None else RedisBackend)
    assert first.stats()["corrupt"] == len(keys)

    # the engine recomputes and stores again; then every load is the reference
    save(store, {k: reference(i) for i, k in enumerate(keys)})
    pump(store)
    fresh = chain.store(victim)
    answers = resolve(fresh, keys)
    assert all(a[-1] is HIT for a in answers.values())
    assert [read(fresh, k) for k in keys] == [reference(i) for i in range(len(keys))]


def test_without_a_secret_planted_frames_load(chains: Callable[..., Chain]) -> None:
    """The documented behaviour without a secret: shared tiers trust their writers."""
    chain = chains("cpu-disk")
    victim = victim_namespace(None)
    keys = prompt_keys(victim)
    assert chain.disk_dir is not None
    plant_computable(chain.disk_dir, victim)
    store = chain.store(victim)
    answers = resolve(store, keys)
    assert all(a[-1] is HIT for a in answers.values())
    assert read(store, keys[0]) == EVIL


# -- files that try to hang or exhaust a worker ---------------------------------------------------

NS = victim_namespace(None).public_fp
KEY = chunk_keys(NS, [b"k" * 32], 0)[0]


def disk_tier(path: Path, **kw: Any) -> DiskBackend:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    return DiskBackend(DiskOptions(path=str(path), shards=1, **kw), ctx)


def entry(root: Path) -> Path:
    return root / NS.hex() / f"{KEY.hex()}.kvc"


def within_deadline(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread that must finish within DEADLINE_S (else it is stuck)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), "an I/O thread is stuck"
    return out[0]


def plant_fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


def plant_symlink_to_a_fifo(p: Path) -> None:
    fifo = p.parent.parent / "elsewhere.fifo"
    os.mkfifo(fifo, 0o600)
    p.symlink_to(fifo)


def plant_symlink_to_a_valid_frame(p: Path) -> None:
    target = p.parent.parent / "elsewhere.kvc"
    target.write_bytes(encode_chunk(NS, KEY, b"x" * CHUNK))
    p.symlink_to(target)


def plant_sparse_100_gib(p: Path) -> None:
    with p.open("wb") as fh:
        fh.truncate(100 << 30)


def plant_directory(p: Path) -> None:
    p.mkdir()


@pytest.mark.parametrize(
    "plant",
    [
        plant_fifo,
        plant_symlink_to_a_fifo,
        plant_symlink_to_a_valid_frame,
        plant_sparse_100_gib,
        plant_directory,
    ],
)
def test_a_planted_file_is_a_prompt_miss(tmp_path: Path, plant: Callable[[Path], None]) -> None:
    root = tmp_path / "cache"
    disk_tier(root).close()  # creates the directories
    plant(entry(root))
    start = time.monotonic()
    b = within_deadline(lambda: disk_tier(root))  # the start-up scan passes it by
    assert b.stats()["entries"] == 0
    (row,) = within_deadline(lambda: DiskBackend.inventory(DiskOptions(path=str(root))))
    if plant is plant_sparse_100_gib:  # a regular file: counted, its header unreadable
        assert row["entries"] == 1 and "sample_error" in row
    else:
        assert row["entries"] == 0, "not a regular file: not counted"
    assert within_deadline(lambda: b.exists([KEY])) == [False]
    assert within_deadline(lambda: b.get([KEY])) == [None]
    slot = memoryview(bytearray(CHUNK))
    assert within_deadline(lambda: b.get_into([KEY], [slot])) == [False]
    assert time.monotonic() - start < DEADLINE_S
    assert b.put([(KEY, b"y" * CHUNK)]) in ([True], [False])  # no exception either way
    b.close()


def test_a_sparse_file_is_rejected_without_being_read(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    disk_tier(root).close()
    plant_sparse_100_gib(entry(root))
    b = disk_tier(root)
    assert within_deadline(lambda: b.get([KEY])) == [None]
    assert b.stats()["rejected"] == 1 and b.stats()["read_errors"] == 0
    assert not entry(root).exists(), "the planted file is removed"
    b.close()


def test_symlink_target_is_never_touched(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    disk_tier(root).close()
    target = tmp_path / "precious"
    target.write_bytes(encode_chunk(NS, KEY, b"x" * CHUNK))
    entry(root).symlink_to(target)
    b = disk_tier(root)
    assert b.get([KEY]) == [None]
    assert target.exists() and not entry(root).is_symlink()
    b.close()


def test_cache_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    root.chmod(0o777)
    with pytest.raises(ValueError, match=r"mode 0777.*chmod go-w"):
        disk_tier(root)


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_namespace_dir_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "cache"
    (root / NS.hex()).mkdir(parents=True, mode=0o700)
    (root / NS.hex()).chmod(mode)
    with pytest.raises(ValueError, match=f"mode {mode:04o}"):
        disk_tier(root)


def test_namespace_dir_symlink_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (tmp_path / "theirs").mkdir(mode=0o700)
    (root / NS.hex()).symlink_to(tmp_path / "theirs")
    with pytest.raises(ValueError, match="symlink"):
        disk_tier(root)


def test_dirs_of_another_user_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(This user stands in for "another": kvsdk sees a uid that is not its own.)"""
    root = tmp_path / "cache"
    disk_tier(root).close()
    owner = os.stat(root).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(ValueError, match=rf"belongs to uid {owner}"):
        disk_tier(root)


def test_a_huge_redis_value_costs_one_frame_on_the_wire(redis_server: Any) -> None:
    import redis

    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    b = RedisBackend(RedisOptions(url=redis_server.url), ctx)
    client = redis.Redis.from_url(redis_server.url)
    huge = 64 << 20
    client.setrange(f"kvsdk:{NS.hex()}:{KEY.hex()}", huge - 1, b"\0")

    def sent() -> int:
        return int(client.info("stats")["total_net_output_bytes"])

    before = sent()
    assert b.get([KEY]) == [None]
    assert sent() - before < 4 * (HEADER_SIZE + CHUNK)
    assert b.stats()["oversized"] == 1
    assert client.exists(f"kvsdk:{NS.hex()}:{KEY.hex()}") == 0
    b.close()
    client.close()


def test_a_mode_0600_file_layout_is_what_kvsdk_creates(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    b = disk_tier(root)
    assert b.put([(KEY, b"z" * CHUNK)]) == [True]
    assert stat.S_IMODE(os.stat(root / NS.hex()).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(entry(root)).st_mode) == 0o600
    b.close()


class HungFiles:
    """Reads of the chosen files block until :meth:`release`, as on an NFS mount
    whose server went away and came back. No Linux file reachable without root
    (a FIFO, a lease, /proc) blocks a ``read`` of a regular file once ``open``
    with ``O_NONBLOCK`` succeeded, so the block is injected at the one seam the
    disk tier reads through, the ``os.read``/``readv``/``pread``/``preadv``
    system calls, for those files only; everything else (files, frames,
    threads) is real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: set[str] = set()
        self.gate = threading.Event()
        self.blocked = 0
        real_read, real_readv, real_pread, real_preadv = os.read, os.readv, os.pread, os.preadv

        def hung(fd: int) -> bool:
            try:
                return os.readlink(f"/proc/self/fd/{fd}") in self.paths
            except OSError:
                return False

        def read(fd: int, n: int) -> bytes:
            self._wait(hung(fd))
            return real_read(fd, n)

        def readv(fd: int, buffers: Any) -> int:
            self._wait(hung(fd))
            return real_readv(fd, buffers)

        def pread(fd: int, n: int, offset: int) -> bytes:
            self._wait(hung(fd))
            return real_pread(fd, n, offset)

        def preadv(fd: int, buffers: Any, offset: int) -> int:
            self._wait(hung(fd))
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "read", read)
        monkeypatch.setattr(os, "readv", readv)
        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(os, "preadv", preadv)

    def _wait(self, is_hung: bool) -> None:
        if is_hung and not self.gate.is_set():
            self.blocked += 1
            self.gate.wait()

    def release(self) -> None:
        self.gate.set()


def chunk_key(i: int) -> bytes:
    return bytes([i]) * 16


def new_reader_threads(before: set[threading.Thread]) -> int:
    """Disk reader threads alive now that were not before."""
    return sum(
        t.name.startswith("kvsdk-disk-read") and t not in before for t in threading.enumerate()
    )


@pytest.mark.parametrize("into", [True, False], ids=["get_into", "get"])
def test_a_hung_read_is_a_miss_within_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool
) -> None:
    """Each hung read is a miss after ``read_timeout``, counted as an error; the
    tier's reader threads stay at ``read_workers`` (once all are held, reads
    are misses at once); a late read never writes into the caller's slot; when
    the file system comes back, the same entries hit."""
    threads_before = set(threading.enumerate())
    b = disk_tier(tmp_path / "cache", read_timeout=0.5, read_workers=2)
    payloads = {i: bytes([i]) * CHUNK for i in range(1, 5)}
    assert b.put([(chunk_key(i), p) for i, p in payloads.items()]) == [True] * 4
    hang = HungFiles(monkeypatch)
    hang.paths = {os.path.realpath(b._path(chunk_key(i))) for i in (1, 2, 3)}

    def read(i: int, slot: memoryview) -> bool:
        if into:
            return bool(b.get_into([chunk_key(i)], [slot])[0])
        got = b.get([chunk_key(i)])[0]
        return got is not None and bytes(got) == payloads[i]

    slots = {i: memoryview(bytearray(CHUNK)) for i in payloads}
    for i in (1, 2):  # each waits its deadline, then a miss
        start = time.monotonic()
        assert within_deadline(lambda i=i: read(i, slots[i])) is False
        assert 0.45 <= time.monotonic() - start < 0.5 + 2.0
    assert b.stats()["read_timeouts"] == 2 and b.error_count() == 2
    assert b.stats()["reads_blocked"] == 2
    start = time.monotonic()  # both workers held: a miss at once, no new thread
    assert within_deadline(lambda: read(3, slots[3])) is False
    assert time.monotonic() - start < 0.2
    assert within_deadline(lambda: read(4, slots[4])) is False  # even an entry that is fine
    assert b.stats()["read_stalled"] == 2 and hang.blocked == 2
    assert not b.available()  # its misses now do not ask the file system
    assert new_reader_threads(threads_before) == 2
    for i in (1, 2):  # the callers gave up: their slots are someone else's now
        slots[i][:] = b"\xab" * CHUNK
    hang.release()
    deadline = time.monotonic() + DEADLINE_S
    while b.stats()["reads_blocked"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.stats()["reads_blocked"] == 0 and b.available()
    for i in (1, 2):
        assert bytes(slots[i]) == b"\xab" * CHUNK, "a late read wrote into a slot"
    for i in payloads:  # the file system is back: every entry hits
        assert within_deadline(lambda i=i: read(i, slots[i])) is True
        if into:
            assert bytes(slots[i]) == payloads[i]
    assert b.stats()["read_timeouts"] == 2
    b.close()


def test_one_hung_file_leaves_the_other_readers_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = disk_tier(tmp_path / "cache", read_timeout=0.5, read_workers=2)
    assert b.put([(chunk_key(i), bytes([i]) * CHUNK) for i in (1, 2)]) == [True, True]
    hang = HungFiles(monkeypatch)
    hang.paths = {os.path.realpath(b._path(chunk_key(1)))}
    slot = memoryview(bytearray(CHUNK))
    assert within_deadline(lambda: b.get_into([chunk_key(1)], [slot])) == [False]
    assert b.available()  # one of two reader threads is free
    for _ in range(3):  # the other thread serves, every time
        assert within_deadline(lambda: b.get_into([chunk_key(2)], [slot])) == [True]
        assert bytes(slot) == bytes([2]) * CHUNK
    hang.release()
    b.close()


def test_read_timeout_must_be_a_positive_deadline(tmp_path: Path) -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="read_timeout"):
            disk_tier(tmp_path / "cache", read_timeout=bad)
    with pytest.raises(ValueError, match="read_workers"):
        disk_tier(tmp_path / "cache", read_workers=0)


def test_a_late_read_holds_no_reference_to_the_callers_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the caller gave up, the blocked reader keeps no view of its buffer
    (else a shared-memory slab with a hung read could not be closed)."""
    b = disk_tier(tmp_path / "cache", read_timeout=0.3, read_workers=1)
    assert b.put([(chunk_key(1), b"\x01" * CHUNK)]) == [True]
    hang = HungFiles(monkeypatch)
    hang.paths = {os.path.realpath(b._path(chunk_key(1)))}
    buf = bytearray(CHUNK)
    assert within_deadline(lambda: b.get_into([chunk_key(1)], [memoryview(buf)])) == [False]
    assert b.stats()["reads_blocked"] == 1
    buf.extend(b"x")  # BufferError if anything still holds a view of it
    hang.release()
    b.close()
