"""The disk tier's reads: ``exists``, ``get``, ``get_into`` and
``get_into_parts``. Each file is opened without following a symlink (by its
name in its directory's descriptor: no directory is reached through a
symlink either), checked
with ``fstat``, read and verified on a reader thread within ``read_timeout``;
a payload is copied into a caller's buffers only while the caller still
waits; what a read found is applied to the index (a file gone is forgotten,
one another process stored is indexed, a bad one removed)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvsdk.backend import Buffer
from kvsdk.backends.disk_dirs import DirWalk, UnsafeDir
from kvsdk.backends.disk_files import OPEN_FLAGS, copy_at, pread_full, read_whole
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, Handoff
from kvsdk.backends.disk_scan import DiskScan
from kvsdk.backends.disk_workers import DiskWorkers
from kvsdk.chunk_format import (
    HEADER_SIZE,
    CorruptChunk,
    PayloadCheck,
    UnverifiableChunk,
    decode_chunk,
)
from kvsdk.types import ChunkKey

LOOK_STEP = 256
"""``exists`` looks at this many files per hand-off to a reader thread, each step
within ``read_timeout`` (after a step past it, the rest of the call is a miss)."""
READ_STEP = 16
"""Reads one hand-off to a reader thread carries (one deadline each)."""
READ_PIECE = 256 << 10
"""Bytes a reader thread reads, checks and copies on at a time (stays in its cache)."""
MTIME_REFRESH_SECONDS = 60.0
"""A hit refreshes a file's ``mtime`` (LRU order across restarts) when it is older."""


@dataclass(frozen=True)
class _Read:
    """What a reader thread found: ``kind`` (ok, absent, open_error, rejected,
    read_error, unverifiable, corrupt, abandoned) and its details."""

    kind: str
    detail: str = ""
    st: os.stat_result | None = None
    payload: memoryview | None = None
    fits: bool = True


_Item = tuple[ChunkKey, list[memoryview] | None]
"""A read: the key, and the caller's buffers to fill (None: return the payload)."""


def _deliver_read(res: _Read, target: tuple[list[Any], list[_Read]]) -> None:
    target[1].append(res)


def _copy_piece(piece: memoryview, offset: int, item: int, target: tuple[list[Any], Any]) -> None:
    copy_at(piece, offset, target[0][item])


class DiskReads(DiskScan, DiskWorkers):
    """The read part of the disk tier (a base of :class:`~kvsdk.backends.disk.DiskBackend`)."""

    _tls: threading.local
    """Each reader thread's scratch buffer."""

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key's file is there (this or another process stored it),
        looked at on a reader thread within ``read_timeout``: past it, or while
        every reader thread is blocked, every key is a miss."""
        keys = list(keys)
        out: list[bool] = []
        for i in range(0, len(keys), LOOK_STEP):
            step = partial(self._exists_task, keys[i : i + LOOK_STEP])
            res = self._reader.run(step)
            if res is TIMED_OUT or res is STALLED:  # the rest: misses, not attempted
                self._missed_deadline(res, "exists", self._reader)
                return out + [False] * (len(keys) - len(out))
            assert isinstance(res, list)
            out += res
        return out

    def _exists_task(self, keys: list[ChunkKey], handoff: Handoff) -> list[bool]:
        """On a reader thread: one ``lstat`` per key, applied to the index."""
        out: list[bool] = []
        if handoff.abandoned:
            return out
        self._ensure_checked()
        with self._dirs.walk() as walk:
            for key in keys:
                if handoff.abandoned:  # the caller gave up: the rest is not looked at
                    break
                seq = self._seq
                size = self._look(walk, key)
                if size is not None and not self._plausible_size(size):
                    size = None  # not a frame of this namespace: a miss when read
                if self._settle(key, size, seq):
                    assert size is not None
                    self._adopt(walk, key, size, seq)
                out.append(size is not None)
        return out

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        return self._load_all([(k, None) for k in keys])

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Like :meth:`get`, but each verified payload is copied into ``outs[i]``
        (a writable buffer it must fill exactly, e.g. a host-tier slot): no
        allocation. Where the answer is False the destination's contents are
        undefined; an entry of another size is a miss."""
        items: list[_Item] = [(k, [o]) for k, o in zip(keys, outs)]
        return [v is not None for v in self._load_all(items)]

    def get_into_parts(
        self, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """Like :meth:`get_into`, each verified payload copied into the buffers
        ``outs[i]`` in order (their sizes must add up to the payload's)."""
        items: list[_Item] = [(k, list(parts)) for k, parts in zip(keys, outs)]
        return [v is not None for v in self._load_all(items)]

    def _load_all(self, items: list[_Item]) -> list[Any]:
        """Each item's verified payload (``(key, None)``) or hit (``(key, outs)``:
        copied into ``outs``; then ``outs[0]`` or an empty view), None for a miss."""
        return self._in_shares(self._load_share, items)

    def _load_share(self, items: list[_Item]) -> list[Any]:
        """Read ``items`` in order on a reader thread, ``READ_STEP`` at a time (one
        hand-off each); the caller waits at most ``read_timeout`` for each step,
        and the reads of a step not done by then are misses (not attempted, or
        abandoned while their worker stays blocked)."""
        out: list[Any] = []
        for i in range(0, len(items), READ_STEP):
            step = items[i : i + READ_STEP]
            done: list[_Read] = []  # outcomes, delivered while the caller waits
            outs = [o for _, o in step]
            wants = [(k, None if o is None else sum(b.nbytes for b in o)) for k, o in step]
            res = self._reader.run(partial(self._read_step, wants), (outs, done))
            out += [self._loaded(k, o, r) for (k, o), r in zip(step, done)]
            if res is TIMED_OUT or res is STALLED:
                missed = len(step) - len(done)
                self._missed_deadline(res, "read", self._reader, missed)
                self._count_n("misses", missed)
                out += [None] * missed
        return out

    def _read_step(self, wants: list[tuple[ChunkKey, int | None]], handoff: Handoff) -> None:
        """On a reader thread: read each ``(key, size of the caller's buffers or
        None)``, handing each outcome to the caller while it waits; stops when
        it gave up. Holds no view of the caller's buffers (only the handoff)."""
        with self._dirs.walk() as walk:
            for j, (key, want) in enumerate(wants):
                res = self._read_task(walk, key, want, handoff, j)
                if res.kind == "abandoned" or not handoff.deliver(partial(_deliver_read, res)):
                    return

    def _loaded(self, key: ChunkKey, outs: list[memoryview] | None, res: _Read) -> Any:
        """The caller's side of one read: counts and logs ``res``; the payload,
        the hit (``outs[0]`` or an empty view) or None."""
        path = self._path(key)
        if res.kind == "absent" or res.kind == "open_error":
            if res.kind == "open_error":
                self._count("read_errors", "errors")
                self._burst.warning("read", "disk tier: cannot open %s: %s", path, res.detail)
            self._count("misses")
            return None
        if res.kind == "rejected":
            self._count("rejected", "corrupt", "misses")
            self._burst.warning("rejected", "disk tier: dropping %s: %s", path, res.detail)
            return None
        if res.kind == "read_error":
            self._count("read_errors", "misses", "errors")
            self._burst.warning("read", "disk tier: cannot read %s: %s", path, res.detail)
            return None
        if res.kind == "unverifiable":
            self._count("unverifiable", "misses")
            self._burst.warning("unverifiable", "disk tier: %s: %s", path, res.detail)
            return None
        if res.kind == "corrupt":
            self._count("corrupt", "misses")
            self._burst.warning("corrupt", "disk tier: dropping %s: %s", path, res.detail)
            return None
        assert res.kind == "ok"
        self._count("hits" if res.fits else "misses")
        if not res.fits:
            return None
        if outs is None:
            return res.payload
        return outs[0] if outs else memoryview(b"")

    def _read_task(
        self, walk: DirWalk, key: ChunkKey, want: int | None, handoff: Handoff, item: int
    ) -> _Read:
        """On a reader thread: read ``key``'s file (:meth:`_read_file`; the caller's
        buffers are item ``item`` of the handoff's), then make the
        index agree with what was found (a file that is gone is forgotten, one
        another process stored is indexed, a bad one removed)."""
        if handoff.abandoned:  # queued past its deadline: not attempted
            return _Read("abandoned")
        self._ensure_checked()
        seq = self._seq
        res = self._read_file(walk, key, want, handoff, item)
        if res.kind == "absent" or res.kind == "open_error":
            self._settle(key, None, seq)
        elif res.kind == "rejected" or res.kind == "corrupt":
            # a symlink, FIFO or huge file, or a frame that fails verification: removed
            # (unlinking a symlink removes the link, not its target)
            if self._remove(walk, key) and res.kind == "corrupt":
                self._count("deletes")
        elif res.kind == "ok":
            assert res.st is not None
            touched = False
            with self._lock:
                if key in self._index:
                    self._policy.touch(key)
                    touched = True
            if not touched and self._settle(key, res.st.st_size, seq):
                self._adopt(walk, key, res.st.st_size, seq)  # stored by another process
        return res

    def _read_file(
        self, walk: DirWalk, key: ChunkKey, want: int | None, handoff: Handoff, item: int
    ) -> _Read:
        """On a reader thread: open, check, read and verify ``key``'s file; with
        ``want`` (the caller's buffers' total size), copy a payload of that size
        into the caller's buffers, only if the caller still waits
        (``handoff.deliver``). Touches no index and holds no lock of the tier over
        a system call: it may block for good."""
        shard, name = self._where(key)
        try:
            fd = walk.at(shard, lambda dfd: os.open(name, OPEN_FLAGS, dir_fd=dfd))
        except UnsafeDir:
            return _Read("absent")  # its directory is not one to use (counted where found)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink where a frame belongs: never followed
                return _Read("rejected", "a symlink")
            if exc.errno == errno.ENOENT:
                return _Read("absent")
            return _Read("open_error", exc.strerror or str(exc))
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                return _Read("rejected", "not a regular file")
            if not self._plausible_size(size):
                return _Read("rejected", f"{size} bytes, not a frame size of this namespace")
            if want is None:
                data = memoryview(read_whole(fd, size))
            else:
                res = self._stream_into(fd, size, key, want, handoff, item)
            if time.time() - st.st_mtime > MTIME_REFRESH_SECONDS:
                with contextlib.suppress(OSError):  # read-only mount: fine
                    os.utime(fd)  # LRU order that survives restarts (coarse)
        except OSError as exc:
            return _Read("read_error", exc.strerror or str(exc))
        finally:
            os.close(fd)
        if want is not None:
            return res if res.kind != "ok" else _Read("ok", st=st, fits=res.fits)
        try:
            payload = decode_chunk(data, namespace_fp=self._ns, key=key, mac_key=self._mac)
        except UnverifiableChunk as exc:
            return _Read("unverifiable", exc.reason)
        except CorruptChunk as exc:
            return _Read("corrupt", exc.reason)
        return _Read("ok", st=st, payload=payload)

    def _stream_into(
        self, fd: int, size: int, key: ChunkKey, want: int, handoff: Handoff, item: int
    ) -> _Read:
        """Read the frame in ``fd`` (``size`` bytes) a piece at a time into this
        thread's scratch buffer, feed each piece to the check and copy it on into
        the caller's buffers while it is still in the CPU's cache (under
        ``handoff.deliver``: the system call never runs there, only the copy).
        A frame that fails its check leaves the caller's buffers undefined, as a
        miss may. The payload is verified in full even when it does not fit."""
        head = os.pread(fd, HEADER_SIZE, 0)
        try:
            check = PayloadCheck(head, size - HEADER_SIZE, namespace_fp=self._ns, key=key,
                                 mac_key=self._mac)  # fmt: skip
        except UnverifiableChunk as exc:
            return _Read("unverifiable", exc.reason)
        except CorruptChunk as exc:
            return _Read("corrupt", exc.reason)
        length = check.header.length
        fits = length == want
        scratch = self._scratch(min(READ_PIECE, max(length, 1)))
        offset = 0
        while offset < length:
            piece = scratch[: min(len(scratch), length - offset)]
            got = pread_full(fd, piece, HEADER_SIZE + offset)
            check.update(piece[:got])
            if got < len(piece):  # the file shrank under us
                break
            if fits and not handoff.deliver(partial(_copy_piece, piece, offset, item)):
                return _Read("abandoned")
            offset += got
        try:
            check.finish()
        except CorruptChunk as exc:
            return _Read("corrupt", exc.reason)
        return _Read("ok", fits=fits)

    def _scratch(self, size: int) -> memoryview:
        """This reader thread's own buffer of ``size`` bytes (kept between reads,
        so its pages are already faulted in; ``read_workers`` of them at most)."""
        buf: bytearray | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            self._tls.buf = buf
        return memoryview(buf)[:size]
