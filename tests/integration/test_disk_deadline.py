"""Every system call of the disk tier has a deadline, not only reads: ``exists``,
writes, deletes, the start-up directory check and scan, and ``inventory``
(``kvsdk inspect``) each answer within ``read_timeout`` on a file system that
stops answering (a miss, a dropped write, a clear error), the caller's thread is
never stuck, the tier's threads stay a fixed set, and once the file system is
back the tier serves again by itself (see docs/security.md).

No file reachable without root blocks ``lstat``, ``scandir``, ``pwritev`` or
``rename``, so, as in test_hostile_tiers.py, the block is injected at the
system calls the tier makes, for the chosen real paths only (:class:`Hang`);
everything else (files, frames, threads, locks) is real.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsdk.backend import TierContext
from kvsdk.backends.disk import LOOK_STEP, WRITE_STEP, DiskBackend, DiskOptions
from kvsdk.chunk_format import HEADER_SIZE

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"deadline-model", digest_size=16).digest()
CHUNK = 4096
TIMEOUT = 0.5
"""The tiers' ``read_timeout`` here."""
STUCK_S = 5.0
"""A call that has not returned after this long is stuck."""


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int) -> bytes:
    return bytes([i % 251]) * CHUNK


def tier(root: Path, **kw: Any) -> DiskBackend:
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=CHUNK)
    kw.setdefault("read_timeout", TIMEOUT)
    kw.setdefault("read_workers", 2)
    return DiskBackend(DiskOptions(path=str(root), shards=4, **kw), ctx)


def _fd_path(fd: int) -> str:
    """The path descriptor ``fd`` has open ("" if none)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Hang:
    """The chosen ``os`` functions block, for paths containing one of
    :attr:`parts`, until :meth:`release`: an NFS server gone, then back.
    Functions taking a file descriptor match on the path it has open."""

    FD_CALLS = ("read", "readv", "pread", "preadv", "writev", "pwritev", "fsync")

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
        self.parts: set[str] = set()
        self.gate = threading.Event()
        self.blocked = 0
        self._lock = threading.Lock()
        for name in names:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def hung(*args: Any, **kw: Any) -> Any:
            target = args[0] if args else kw.get("path", ".")
            if name in self.FD_CALLS or isinstance(target, int):
                where = _fd_path(target)
            else:
                where = os.fsdecode(os.fspath(target)) if target is not None else "."
                dir_fd = kw.get("dir_fd", kw.get("src_dir_fd"))
                if dir_fd is not None:  # a name in a directory's descriptor
                    where = os.path.join(_fd_path(dir_fd), where)
            if any(p in where for p in self.parts) and not self.gate.is_set():
                with self._lock:
                    self.blocked += 1
                self.gate.wait()
            return real(*args, **kw)

        return hung

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def hang(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Hang]]:
    made: list[Hang] = []

    def make(*names: str) -> Hang:
        made.append(Hang(monkeypatch, *names))
        return made[-1]

    yield make
    for h in made:  # never leave a thread blocked behind
        h.release()


def within(limit: float, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` on a thread of its own: its result (or what it raised, raised
    again here) and the seconds it took; fails if it has not returned after
    STUCK_S (the caller's thread would be stuck) or took ``limit`` or more."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=call, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(STUCK_S)
    assert not t.is_alive(), "the caller's thread is stuck"
    took = time.monotonic() - start
    assert took < limit, f"took {took:.2f} s, over {limit} s"
    if errors:
        raise errors[0]
    return out[0], took


def settle(b: DiskBackend) -> None:
    """Wait until no thread of ``b`` is blocked past its deadline."""
    deadline = time.monotonic() + STUCK_S
    while time.monotonic() < deadline:
        s = b.stats()
        if not s["reads_blocked"] and not s["writes_blocked"]:
            return
        time.sleep(0.01)
    raise AssertionError("the tier's threads did not return")


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp.*")]


# -- exists ------------------------------------------------------------------------------


def test_a_hung_exists_is_a_miss_within_its_deadline(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    """A hung ``lstat`` is a miss after ``read_timeout``, counted as an error;
    lookups of other keys still answer (a look holds no lock of the tier);
    once every reader thread is held, lookups are misses at once; when the
    file system is back every key is found again."""
    b = tier(tmp_path)
    assert b.put([(key(i), payload(i)) for i in range(4)]) == [True] * 4
    h = hang("lstat")
    h.parts = {key(0).hex(), key(1).hex()}
    got, took = within(TIMEOUT + 1.5, lambda: b.exists([key(0)]))
    assert got == [False] and took >= TIMEOUT * 0.9
    assert b.stats()["read_timeouts"] == 1 and b.error_count() == 1
    got, _ = within(TIMEOUT, lambda: b.exists([key(2), key(3)]))  # the other reader thread
    assert got == [True, True]
    assert within(TIMEOUT + 1.5, lambda: b.exists([key(1)]))[0] == [False]
    assert b.stats()["reads_blocked"] == 2 and not b.available()
    got, took = within(0.2, lambda: b.exists([key(2)]))  # stalled: no system call at all
    assert got == [False] and b.stats()["read_stalled"] == 1 and h.blocked == 2
    h.release()
    settle(b)
    assert b.available()
    assert within(TIMEOUT, lambda: b.exists([key(i) for i in range(4)]))[0] == [True] * 4
    assert b.stats()["entries"] == 4 and b.stats()["read_timeouts"] == 2
    b.close()


# -- writes ------------------------------------------------------------------------------


def test_a_hung_write_is_dropped_within_its_deadline_and_its_temp_file_removed(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    """A write whose ``pwritev`` hangs is a dropped write after ``read_timeout``
    (False, ``put_timeouts``), the rest of its batch is not attempted; other
    writes and reads go on meanwhile; when the file system is back the writer
    thread removes its temp file and ends the reservation, nothing of the
    dropped batch is published, and the same key can be stored again."""
    b = tier(tmp_path)
    h = hang("pwritev")
    h.parts = {key(1).hex()}
    batch = [(key(i), payload(i)) for i in (0, 1, 2)]
    got, took = within(TIMEOUT + 1.5, lambda: b.put(batch))
    assert got == [True, False, False] and took >= TIMEOUT * 0.9
    s = b.stats()
    assert s["put_timeouts"] == 2 and s["put_failures"] == 2 and b.error_count() == 2
    assert s["writes_blocked"] == 1 and s["bytes_reserved"] == CHUNK + HEADER_SIZE
    assert within(TIMEOUT, lambda: b.put([(key(3), payload(3))]))[0] == [True]
    assert within(TIMEOUT, lambda: b.get([key(0), key(3)]))[0] == [payload(0), payload(3)]
    assert len(temp_files(tmp_path)) == 1
    h.release()
    settle(b)
    s = b.stats()
    assert s["bytes_reserved"] == 0 and s["entries"] == 2 and s["puts"] == 2
    assert temp_files(tmp_path) == [], "the writer thread removed its temp file"
    assert b.exists([key(1), key(2)]) == [False, False], "nothing of a dropped write lands"
    assert b.put([(key(1), payload(1)), (key(2), payload(2))]) == [True, True]
    assert b.get([key(1), key(2)]) == [payload(1), payload(2)]
    b.close()


def test_writes_stall_at_once_while_every_writer_thread_is_held(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    b = tier(tmp_path, read_workers=1)
    h = hang("pwritev")
    h.parts = {key(1).hex()}
    assert within(TIMEOUT + 1.5, lambda: b.put([(key(1), payload(1))]))[0] == [False]
    got, _ = within(0.2, lambda: b.put([(key(2), payload(2))]))  # no thread left: at once
    assert got == [False] and b.stats()["put_stalled"] == 1 and not b.available()
    assert within(TIMEOUT, lambda: b.exists([key(2)]))[0] == [False]  # reads still answer
    h.release()
    settle(b)
    assert b.available() and b.put([(key(2), payload(2))]) == [True]
    b.close()


def test_a_long_batch_has_a_deadline_per_step_and_drops_the_rest_at_once(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    """A batch of several steps waits ``read_timeout`` for the step that hangs,
    not for each item after it: what was done stands, the rest is a miss."""
    b = tier(tmp_path)
    n = 2 * WRITE_STEP + 5
    stuck = WRITE_STEP + 3  # in the second step
    h = hang("pwritev")
    h.parts = {key(stuck).hex()}
    got, took = within(TIMEOUT + 1.5, lambda: b.put([(key(i), payload(i)) for i in range(n)]))
    assert got == [True] * stuck + [False] * (n - stuck) and took >= TIMEOUT * 0.9
    assert b.stats()["put_timeouts"] == n - stuck and b.error_count() == n - stuck
    h.release()
    settle(b)
    m = LOOK_STEP + 40
    everything = [key(i) for i in range(m)]
    assert b.exists(everything) == [True] * stuck + [False] * (m - stuck)
    h = hang("lstat")
    h.parts = {key(LOOK_STEP + 1).hex()}  # in the second step of looks
    got, took = within(TIMEOUT + 1.5, lambda: b.exists(everything))
    assert got == [True] * stuck + [False] * (m - stuck) and took >= TIMEOUT * 0.9
    assert b.stats()["read_timeouts"] == 1
    h.release()
    b.close()


def test_a_rename_past_the_deadline_publishes_the_whole_frame_later(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    """The deadline passes while the final rename hangs: the caller hears False
    in time; lookups and reads of other keys are not held up by the writer
    holding the tier's file lock; the frame, complete, lands when the rename
    returns, and is indexed (accounting exact)."""
    b = tier(tmp_path)
    assert b.put([(key(0), payload(0))]) == [True]
    h = hang("replace")
    h.parts = {key(1).hex()}
    assert within(TIMEOUT + 1.5, lambda: b.put([(key(1), payload(1))]))[0] == [False]
    assert within(TIMEOUT, lambda: b.exists([key(0)]))[0] == [True]
    assert within(TIMEOUT, lambda: b.get([key(0)]))[0] == [payload(0)]
    h.release()
    settle(b)
    s = b.stats()
    assert s["bytes_reserved"] == 0 and s["entries"] == 2
    assert s["bytes_used"] == 2 * (CHUNK + HEADER_SIZE)
    assert b.get([key(1)]) == [payload(1)] and temp_files(tmp_path) == []
    b.close()


def test_a_hung_delete_answers_within_its_deadline(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    b = tier(tmp_path)
    assert b.put([(key(i), payload(i)) for i in range(2)]) == [True, True]
    h = hang("unlink")
    h.parts = {key(0).hex()}
    assert within(TIMEOUT + 1.5, lambda: b.delete([key(0)]))[0] == 0
    assert b.error_count() == 1
    with pytest.raises(TimeoutError, match="clearing"):  # its writer thread is held too
        within(TIMEOUT + 1.5, b.clear)
    h.release()
    settle(b)
    assert b.exists([key(0), key(1)]) == [False, False] and b.stats()["entries"] == 0
    b.close()


# -- start-up ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["namespace", "shard"])
def test_a_hung_start_up_scan_starts_the_tier_within_its_deadline(
    tmp_path: Path, hang: Callable[..., Hang], where: str
) -> None:
    """The scan of a directory that does not answer ends after ``read_timeout``:
    the tier starts with what it indexed so far, serves, and finds the other
    entries when they are looked up once the file system is back."""
    first = tier(tmp_path)
    assert first.put([(key(i), payload(i)) for i in range(8)]) == [True] * 8
    first.close()
    ns_dir = tmp_path / NS.hex()
    h = hang("scandir")
    h.parts = {str(ns_dir) if where == "namespace" else os.path.dirname(first._path(key(7)))}
    b, took = within(TIMEOUT + 1.5, lambda: tier(tmp_path))
    assert took >= TIMEOUT * 0.9 and h.blocked == 1
    assert b.stats()["read_timeouts"] == 1 and b.error_count() == 1
    indexed = b.stats()["entries"]
    assert indexed < 8 if where == "shard" else indexed == 0
    assert b.put([(key(100), payload(100))]) == [True]  # serves meanwhile
    h.release()
    assert b.exists([key(i) for i in range(8)]) == [True] * 8
    assert b.get([key(7)]) == [payload(7)] and b.stats()["entries"] == 9
    b.close()


def test_a_hung_directory_check_at_start_is_made_before_the_first_operation(
    tmp_path: Path, hang: Callable[..., Hang]
) -> None:
    """A start-up whose directory check gets no answer does not skip it: the
    first operation that reaches the file system makes it (here it finds the
    directory opened to others meanwhile, and refuses)."""
    tier(tmp_path / "cache").close()
    h = hang("stat")
    h.parts = {str(tmp_path / "cache")}
    b, _ = within(TIMEOUT + 1.5, lambda: tier(tmp_path / "cache"))
    assert b.stats()["read_timeouts"] == 1
    (tmp_path / "cache").chmod(0o777)
    h.release()
    with pytest.raises(ValueError, match="chmod go-w"):
        b.put([(key(1), payload(1))])
    (tmp_path / "cache").chmod(0o700)
    fresh = tier(tmp_path / "cache")
    assert fresh.put([(key(1), payload(1))]) == [True]
    b.close()
    fresh.close()


def timeout_of(fn: Callable[[], Any]) -> TimeoutError | None:
    """The ``TimeoutError`` ``fn()`` raised, or None if it returned."""
    try:
        fn()
    except TimeoutError as exc:
        return exc
    return None


# -- inventory (kvsdk inspect) ---------------------------------------------------------------


@pytest.mark.parametrize("call", ["read", "lstat", "scandir"])
def test_inventory_of_a_hung_file_system_is_an_error_within_its_deadline(
    tmp_path: Path, hang: Callable[..., Hang], call: str
) -> None:
    """The header read, the walk over a namespace's files and the listing of
    namespaces each answer within ``read_timeout`` or raise ``TimeoutError``
    naming the path (``kvsdk inspect`` then reports the tier unreachable)."""
    b = tier(tmp_path)
    assert b.put([(key(i), payload(i)) for i in range(3)]) == [True] * 3
    b.close()
    opts = DiskOptions(path=str(tmp_path), read_timeout=TIMEOUT)
    (row,) = DiskBackend.inventory(opts)
    assert row["entries"] == 3 and row["format_version"] >= 1
    h = hang(call)
    h.parts = {NS.hex()} if call != "scandir" else {str(tmp_path)}

    err, took = within(TIMEOUT + 1.5, lambda: timeout_of(lambda: DiskBackend.inventory(opts)))
    assert isinstance(err, TimeoutError) and "did not answer within 0.5 s" in str(err)
    assert str(tmp_path) in str(err) and took >= TIMEOUT * 0.9
    h.release()
    time.sleep(0.05)
    (row,) = DiskBackend.inventory(opts)
    assert row["entries"] == 3 and "sample_error" not in row


@pytest.mark.parametrize("call", ["unlink", "scandir"])
def test_a_wipe_of_a_hung_file_system_is_an_error_within_its_deadline(
    tmp_path: Path, hang: Callable[..., Hang], call: str
) -> None:
    """``kvsdk clear --yes`` (``wipe``) answers within ``read_timeout`` or raises
    ``TimeoutError`` naming the path; once the file system answers it removes
    every chunk file."""
    b = tier(tmp_path)
    assert b.put([(key(i), payload(i)) for i in range(3)]) == [True] * 3
    b.close()
    opts = DiskOptions(path=str(tmp_path), read_timeout=TIMEOUT)
    h = hang(call)
    h.parts = {NS.hex()}

    err, took = within(TIMEOUT + 1.5, lambda: timeout_of(lambda: DiskBackend.wipe(opts)))
    assert isinstance(err, TimeoutError) and "did not answer within 0.5 s" in str(err)
    assert NS.hex() in str(err) and took >= TIMEOUT * 0.9
    h.release()
    time.sleep(0.05)
    DiskBackend.wipe(opts)  # what the hung call left, if it had not finished by now
    (row,) = DiskBackend.inventory(opts)
    assert row["entries"] == 0


def test_inventory_counts_only_regular_files_and_never_blocks_on_a_fifo(tmp_path: Path) -> None:
    b = tier(tmp_path)
    assert b.put([(key(1), payload(1))]) == [True]
    b.close()
    shard = next(p for p in (tmp_path / NS.hex()).iterdir() if any(p.iterdir()))
    os.mkfifo(shard / f"{key(2).hex()}.kvc", 0o600)
    (shard / f"{key(3).hex()}.kvc").symlink_to(tmp_path / "elsewhere")
    (row,), _ = within(TIMEOUT, lambda: DiskBackend.inventory(DiskOptions(path=str(tmp_path))))
    assert row["entries"] == 1 and row["bytes"] == CHUNK + HEADER_SIZE
