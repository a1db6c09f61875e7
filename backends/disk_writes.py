"""The disk tier's writes: ``put`` and ``put_parts`` (a frame written to a
temporary file on a writer thread, then published by rename; room reserved,
and evicted for, first), ``delete`` and ``clear``, each step within
``read_timeout``; a full disk, a permission error or a late write is a
dropped write, counted, never an exception."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from kvsdk.backend import Buffer
from kvsdk.backends.disk_dirs import DirWalk, open_dir
from kvsdk.backends.disk_files import ENTRY_RE, TMP_PREFIX, flat_parts, write_frame
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, Handoff
from kvsdk.backends.disk_scan import DiskScan
from kvsdk.backends.disk_workers import DiskWorkers
from kvsdk.chunk_format import HEADER_SIZE, HeaderAfterPayload, as_payload
from kvsdk.types import ChunkKey

WRITE_PIECE = 256 << 10
"""Bytes a writer thread writes, then checksums while they are still in its cache."""
WRITE_STEP = 16
"""Writes per hand-off to a writer thread, each step within ``read_timeout`` (a
long healthy batch is never dropped for its length; after a step past its
deadline the rest of the batch is dropped at once)."""
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a temporary file is made: new, never through a symlink."""
_ERRNO_STAT = {errno.ENOSPC: "enospc", errno.EACCES: "eacces", errno.EPERM: "eacces",
               errno.EROFS: "erofs", errno.EDQUOT: "enospc"}  # fmt: skip


class DiskWrites(DiskScan, DiskWorkers):
    """The write part of the disk tier (a base of :class:`~kvsdk.backends.disk.DiskBackend`)."""

    _tmp_names: Iterator[int]
    """Numbers for this process's temporary file names."""

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._put_batch(list(items))

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        """Like :meth:`put` of the joined parts (the same frame on disk), written
        from the parts as they are (``pwritev``): no join, no copy."""
        return self._put_batch([(k, flat_parts(parts)) for k, parts in items])

    def _put_batch(self, items: list[tuple[ChunkKey, Any]]) -> list[bool]:
        """The items framed and written on writer threads (with ``io_threads``, one
        contiguous share per thread), each share within ``read_timeout``."""
        return self._in_shares(self._put_share, items) if items else []

    def _put_share(self, items: list[tuple[ChunkKey, Any]]) -> list[bool]:
        """Frame and write ``items`` in order on a writer thread, ``WRITE_STEP``
        at a time; the caller waits at most ``read_timeout`` for each step. The
        items not done by then are dropped writes (False, ``put_timeouts``): no
        writer thread starts them, and the one writing removes its temp file and
        ends its reservation when the OS returns (or, if the deadline passed
        during the final rename, indexes the complete frame it published)."""
        out: list[bool] = []
        for i in range(0, len(items), WRITE_STEP):
            done: list[str | OSError] = []  # outcomes, delivered while the caller waits
            res = self._writer.run(partial(self._write_task, items[i : i + WRITE_STEP]), done)
            out += [self._put_outcome(outcome) for outcome in done]
            if res is TIMED_OUT or res is STALLED:
                dropped = len(items) - len(out)
                if dropped:
                    self._missed_deadline(res, "write", self._writer, dropped)
                    self._count_n("put_failures", dropped)
                return out + [False] * dropped
        return out

    def _put_outcome(self, res: str | OSError) -> bool:
        if res == "stored":
            self._count("puts")
            return True
        if res == "present":
            self._count("put_skipped_present")
            return True
        if res in ("too_large", "no_room"):
            self._count(f"put_{res}", "put_failures")
            return False
        assert isinstance(res, OSError)
        kind = _ERRNO_STAT.get(res.errno or 0, "other_errors")
        self._count(f"put_{kind}", "put_failures", "errors")
        self._burst.warning(
            f"put_{kind}", "disk tier: store refused in %s: %s", self._root, res.strerror
        )
        return False

    def _write_task(self, items: list[tuple[ChunkKey, Any]], handoff: Handoff) -> None:
        """On a writer thread: write each item's frame (its payload ``WRITE_PIECE``
        bytes at a time, each piece checksummed or MAC'd on this thread right
        after it was written, while still in its cache; the header last), handing
        each outcome to the caller while it waits; stops when it gave up."""
        with self._dirs.walk() as walk:
            for key, value in items:
                if handoff.abandoned:  # past the deadline: the rest not attempted
                    return
                outcome = self._frame_and_write(walk, key, value, handoff)
                if outcome == "abandoned" or not handoff.deliver(partial(_append, outcome)):
                    return

    def _frame_and_write(
        self, walk: DirWalk, key: ChunkKey, value: Any, handoff: Handoff
    ) -> str | OSError:
        """Frame ``value`` (a payload, or flat byte views from ``put_parts``) and
        write it as ``key``'s file (:meth:`_write_one`)."""
        self._ensure_checked()
        shape: tuple[int, ...]
        if isinstance(value, list):  # from put_parts: flat byte views
            parts: list[memoryview] = value
            nbytes = sum(p.nbytes for p in parts)
            dtype, shape = "|u1", (nbytes,)  # as join() of the parts would be
        else:
            flat, dtype, shape = as_payload(value)
            parts, nbytes = [flat], flat.nbytes
        frame = HeaderAfterPayload(self._ns, key, nbytes, dtype, shape, mac_key=self._mac)
        return self._write_one(walk, key, frame, parts, HEADER_SIZE + nbytes, handoff)

    def _write_one(
        self, walk: DirWalk, key: ChunkKey, frame: HeaderAfterPayload, parts: list[memoryview],
        size: int, handoff: Handoff,
    ) -> str | OSError:  # fmt: skip
        """Reserve room (or find the key stored), write a temporary file, then
        publish it (rename), index it and end the reservation in one step. An
        outcome: stored, present, too_large, no_room, abandoned (the caller gave
        up before the rename), or the ``OSError`` that refused the write."""
        with self._final_paths():
            present = self._look(walk, key)  # ours or another process's
            victims: list[ChunkKey] = []
            with self._lock:
                if present is not None:
                    if key in self._index:
                        self._policy.touch(key)
                    else:
                        self._add_locked(key, present)
                        victims = self._evict_locked(0)
                    outcome = "present"
                elif size > self.options.capacity or not self._plausible_size(size):
                    outcome = "too_large"
                else:
                    victims = self._evict_locked(size)
                    if self._used + self._reserved + size > self.options.capacity:
                        outcome = "no_room"  # the rest is writes in flight
                    else:
                        self._reserved += size
                        outcome = ""
            self._unlink_all(victims, walk)
        if outcome:
            return outcome
        try:
            return self._write_file(walk, frame, parts, key, size, handoff)
        except OSError as exc:
            with self._lock:
                self._reserved -= size
            return exc

    def _write_file(
        self, walk: DirWalk, frame: HeaderAfterPayload, payload: list[memoryview], key: ChunkKey,
        size: int, handoff: Handoff,
    ) -> str:  # fmt: skip
        """Write a temporary file, then publish it (rename), index it and end the
        reservation of ``size`` bytes in one step (on an error the caller ends
        the reservation). "abandoned" if the caller gave up before the rename:
        the temporary file is removed, the reservation ended, nothing published.
        Both names are in the directory's descriptor (made if missing; someone
        else's directory where ours belongs refuses the write, ``EACCES``)."""
        shard, name = self._where(key)
        dfd = walk.make(shard)
        tmp = f"{TMP_PREFIX}{name}.{os.getpid()}.{next(self._tmp_names)}"
        fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dfd)
        try:
            try:
                write_frame(fd, frame, payload, WRITE_PIECE)
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if handoff.abandoned:  # past its deadline: a dropped write
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                with self._lock:
                    self._reserved -= size
                return "abandoned"
            with self._final_paths():
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                with self._lock:
                    self._reserved -= size
                    self._add_locked(key, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if self.options.fsync:
            os.fsync(dfd)
        return "stored"

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Forget and unlink ``keys`` on a writer thread within ``read_timeout``
        (past it: 0, an error; the writer thread finishes when the OS returns)."""
        if not keys:
            return 0
        res = self._writer.run(partial(self._delete_task, list(keys)))
        if res is TIMED_OUT or res is STALLED:
            self._missed_deadline(res, "delete", self._writer)
            return 0
        assert isinstance(res, int)
        self._count_n("deletes", res)
        return res

    def _delete_task(self, keys: list[ChunkKey], handoff: Handoff) -> int:
        if handoff.abandoned:
            return 0
        self._ensure_checked()
        with self._dirs.walk() as walk:
            return sum(self._remove(walk, key) for key in keys)

    def clear(self) -> None:
        """Drop every entry of this namespace, on a writer thread within
        ``read_timeout`` (``TimeoutError`` past it; the thread finishes later)."""
        res = self._writer.run(self._clear_task)
        if res is TIMED_OUT or res is STALLED:
            self._missed_deadline(res, "clear", self._writer)
            raise TimeoutError(
                f"disk tier: clearing {self._root} took over {self.options.read_timeout:.1f} s "
                "(a hung file system?)"
            )

    def _clear_task(self, handoff: Handoff) -> None:
        # one change to the final paths: a put finishing meanwhile either lands
        # before (and is cleared) or after (and stays indexed)
        if handoff.abandoned:
            return
        self._ensure_checked()
        with self._final_paths(), self._dirs.walk() as walk:
            with self._lock:
                for key in list(self._index):
                    self._forget_locked(key)
            try:
                ns = walk.checked_fd(None)
                if ns is None:
                    return  # no namespace directory: nothing of ours
                subs = [e.name for e in os.scandir(ns) if e.is_dir(follow_symlinks=False)]
            except OSError:
                return  # (or one not to use)
            _unlink_entries(ns)
            for sub in subs:
                try:
                    fd = open_dir(sub, ns)  # a symlink swapped in meanwhile: not followed
                except OSError:
                    continue
                try:
                    _unlink_entries(fd)
                finally:
                    os.close(fd)


def _unlink_entries(dfd: int) -> None:
    """Unlink every entry named like a chunk file in directory ``dfd``."""
    try:
        names = [e.name for e in os.scandir(dfd) if ENTRY_RE.match(e.name)]
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)


def _append(item: object, out: list[object]) -> None:
    out.append(item)
