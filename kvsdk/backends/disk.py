"""``disk``: chunks as self-describing files in a local directory.

Layout: ``<path>/<namespace_hex>/<shard>/<key_hex>.kvc``, each file one
:mod:`kvsdk.chunk_format` frame. Directories are created ``0700``, files ``0600``.

Files are untrusted (see ``docs/security.md``). At start the tier refuses a
``path`` that is not this user's or that others can write to, and a
namespace or shard directory that is a symlink, not this user's, or open to
group or others. Every read opens with ``O_NOFOLLOW | O_NONBLOCK`` (a planted
symlink fails to open, a FIFO opens without blocking), checks with ``fstat``
that it is a regular file no larger than the largest frame this namespace
writes, and only then reads: a FIFO, a symlink or a huge sparse file is a
miss (counted as ``rejected`` and ``corrupt``, the entry removed) without a
byte read. With a
deployment secret (``TierContext.frame_key``) frames carry a MAC, and a frame
without one is dropped as corrupt.

Contract with the tiered store (bytes in, bytes out; framing is ours):

- ``put([(key, payload)])`` takes the raw chunk payload (bytes-like or a
  numpy array), frames it (namespace, key, dtype, shape, checksum) and writes
  it atomically: a temp file in the same directory, then ``os.replace``. A
  reader never sees a partial file. A key already on disk is not rewritten
  (keys are content hashes). Returns per item whether it is stored; a full
  disk, permission error or read-only mount makes that item ``False``,
  counted in ``stats()``, never an exception.
- ``get(keys)`` returns the verified payload (a ``memoryview``, flat bytes) or
  ``None``. A frame that fails verification is a miss: counted, and the file
  deleted. ``get_into(keys, slots)`` does the same into caller buffers (no
  allocation): the fast way to promote into a host tier.
- Every read has a deadline (``read_timeout``): it runs on the tier's own
  ``read_workers`` threads (:mod:`kvsdk.backends.disk_reader`) and the caller
  waits at most that long; a late read is a miss and an error, and a read
  into a caller's buffer is verified in the reader thread's own buffer and
  copied over only while the caller still waits (one memory copy; a late read
  never writes into a slot that may hold another chunk by then).
- Scatter/gather: ``put_parts`` writes a payload given as a list of buffers
  (a page lying in several regions of host memory) with one ``writev``, and
  ``get_into_parts`` reads one into a list of buffers with ``readv``; the
  checksum is computed over the parts in order, so the frame on disk is the
  same as ``put`` of the joined bytes and is verified the same way.
- ``exists`` / ``get`` look at the file system, not only at the index, so
  entries written by another process sharing the directory are found, and
  entries it evicted are misses.

The index (key -> file size, in LRU order) is kept in memory: hits move an
entry to the front without a system call. It is rebuilt from the directory at
start, oldest ``mtime`` first; so that the order roughly survives restarts, a
hit also refreshes the file's ``mtime``, but at most once per
``MTIME_REFRESH_SECONDS`` per file (the ``fstat`` every read does tells its
age, so a hot file costs no extra call). Capacity is enforced over the
entries this instance knows of (its scan, its writes, the other processes'
entries it has seen).

Thread-safe: the tiered store calls it from several I/O threads. Index and
policy updates happen under one lock; file I/O happens outside it (optionally
spread over ``io_threads`` per batch; off by default, as it measured slower).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import count, pairwise
from typing import Any, TypeVar

from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.backends.disk_files import (
    check_private_dir,
    check_top_dir,
    file_size,
    flat_parts,
    read_whole,
    readv_all,
    same_file,
    scatter_into,
    write_all,
)
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, DeadlineReader, Handoff
from kvsdk.burst_log import BurstLog
from kvsdk.chunk_format import (
    FP_BYTES,
    HEADER_SIZE,
    CorruptChunk,
    UnverifiableChunk,
    as_payload,
    decode_chunk,
    encode_header,
    parse_header,
)
from kvsdk.config import BYTES
from kvsdk.eviction import EvictionPolicy, LRUPolicy
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
_ENTRY_RE = re.compile(r"^[0-9a-f]{32}\.kvc$")
_TMP_PREFIX = ".tmp."
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
STALE_TMP_SECONDS = 3600.0
"""Temp files older than this are left-overs of a crashed writer; removed at start."""
MTIME_REFRESH_SECONDS = 60.0
"""A hit refreshes a file's ``mtime`` (LRU order across restarts) when it is older."""
_ERRNO_STAT = {errno.ENOSPC: "enospc", errno.EACCES: "eacces", errno.EPERM: "eacces",
               errno.EROFS: "erofs", errno.EDQUOT: "enospc"}  # fmt: skip
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class _Read:
    """What a reader thread found: ``kind`` (ok, absent, open_error, rejected,
    read_error, unverifiable, corrupt, abandoned) and its details."""

    kind: str
    detail: str = ""
    st: os.stat_result | None = None
    payload: memoryview | None = None
    fits: bool = True


@dataclass(frozen=True)
class DiskOptions:
    path: str
    """Directory for the cache (created if missing); may be shared by processes."""
    capacity: int = field(default=64 << 30, metadata=BYTES)
    """Bytes of chunk files this tier keeps (e.g. ``200GiB``); LRU beyond that."""
    fsync: bool = False
    """``fsync`` each file and its directory before it counts as stored."""
    shards: int = 256
    """Subdirectories per namespace (keeps directories small); created at start."""
    io_threads: int = 1
    """Threads for per-file I/O within one batch (1: none). The tiered store already
    runs batches on several threads; on a small machine more threads measured slower."""
    read_timeout: float = 5.0
    """Seconds one chunk read (open, fstat, read, verify) may take; past that it is a
    miss, counted in `read_timeouts` and in the tier's errors, so a hung network file
    system never holds the caller longer."""
    read_workers: int = 4
    """Threads of this tier that make its reads (callers wait at most `read_timeout`).
    A read past its deadline keeps its thread until the OS returns; while all of them
    are held so, reads are misses without a system call (`read_stalled`), logged."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: expected a directory path")
        if not 1 <= self.shards <= 65536:
            raise ValueError(f"shards: got {self.shards}; expected 1 to 65536")
        if self.io_threads < 1:
            raise ValueError(f"io_threads: got {self.io_threads}; expected at least 1")
        if not 0 < self.read_timeout < 86400:
            raise ValueError(
                f"read_timeout: got {self.read_timeout}; expected seconds, more than 0 "
                "(every read has a deadline)"
            )
        if not 1 <= self.read_workers <= 256:
            raise ValueError(f"read_workers: got {self.read_workers}; expected 1 to 256")


class DiskBackend(Backend):
    name = "disk"
    Options = DiskOptions
    medium = Medium.DISK
    locality = Locality.NODE
    supports_listing = True
    supports_get_into = True
    supports_scatter_gather = True

    def __init__(self, options: DiskOptions, context: TierContext) -> None:
        if len(context.namespace_fp) != FP_BYTES:
            raise ValueError("disk tier: the namespace fingerprint must be 16 bytes")
        self.options = options
        self._ns = context.namespace_fp
        self._mac = context.frame_key
        self._max_frame = HEADER_SIZE + context.chunk_bytes if context.chunk_bytes > 0 else None
        self._root = os.path.join(os.path.abspath(options.path), context.namespace_fp.hex())
        self._shard_width = len(f"{options.shards - 1:x}")
        self._lock = threading.Lock()
        self._index: dict[ChunkKey, int] = {}  # key -> file size
        self._reserved = 0  # bytes of writes in flight
        self._used = 0  # bytes in the index
        factory = context.policy_factory
        self._policy: EvictionPolicy = (
            factory(capacity=max(1, options.capacity // max(1, context.chunk_bytes)))
            if factory
            else LRUPolicy()
        )
        self._tmp_names = count()
        self._burst = BurstLog(log)
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "puts", "put_skipped_present", "put_failures", "put_enospc",
             "put_eacces", "put_erofs", "put_other_errors", "put_too_large", "put_no_room",
             "corrupt", "unverifiable", "rejected", "read_errors", "read_timeouts",
             "read_stalled", "evictions", "deletes", "errors"), 0
        )  # fmt: skip
        self._pool = (
            ThreadPoolExecutor(options.io_threads, thread_name_prefix="kvsdk-disk")
            if options.io_threads > 1
            else None
        )
        self._reader = DeadlineReader(options.read_workers, options.read_timeout)
        weakref.finalize(self, self._reader.close)  # a tier dropped without close()
        self._tls = threading.local()  # each reader thread's scratch buffer
        self._made_dirs: set[str] = set()
        top = os.path.abspath(options.path)
        try:
            os.makedirs(top, mode=0o700, exist_ok=True)
            check_top_dir(top)
            self._makedirs(self._root)
            for shard in range(options.shards if options.shards > 1 else 0):
                self._makedirs(os.path.join(self._root, f"{shard:0{self._shard_width}x}"))
        except OSError as exc:
            self._count("errors")
            self._burst.warning("mkdir", "disk tier: cannot create %s (%s); stores will fail",
                                self._root, exc.strerror)  # fmt: skip
        self._scan()

    # -- paths -------------------------------------------------------------------------
    def _shard_dir(self, key_hex: str) -> str:
        if self.options.shards == 1:
            return self._root
        shard = int(key_hex[:8], 16) % self.options.shards
        return os.path.join(self._root, f"{shard:0{self._shard_width}x}")

    def _path(self, key: ChunkKey) -> str:
        key_hex = key.hex()
        return os.path.join(self._shard_dir(key_hex), key_hex + SUFFIX)

    def _makedirs(self, path: str) -> None:
        """Create ``path`` (0700) or check the one there: a directory, not a
        symlink, this user's, closed to group and others (``ValueError`` otherwise)."""
        if path in self._made_dirs:
            return
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            check_private_dir(path)
        self._made_dirs.add(path)

    # -- start-up scan ----------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the directory, oldest first; drop stale temp files."""
        found: list[tuple[float, ChunkKey, int]] = []
        now = time.time()
        dirs = [self._root]
        try:
            dirs += [e.path for e in os.scandir(self._root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.name.startswith(_TMP_PREFIX):
                        if now - e.stat().st_mtime > STALE_TMP_SECONDS:
                            os.unlink(e.path)
                        continue
                    if not _ENTRY_RE.match(e.name) or not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                    if not self._plausible_size(st.st_size):
                        continue  # not a frame of this namespace: a miss when asked
                    key = bytes.fromhex(e.name[:32])
                    want = self._path(key)
                    if e.path != want:  # written with another shard count
                        self._makedirs(os.path.dirname(want))
                        os.replace(e.path, want)
                    found.append((st.st_mtime, key, st.st_size))
                except OSError:
                    continue
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._add_locked(key, size)
            self._evict_locked(0)

    # -- index (call with the lock held) --------------------------------------------------
    def _add_locked(self, key: ChunkKey, size: int) -> None:
        old = self._index.get(key)
        if old is None:
            self._policy.insert(key)
        else:
            self._used -= old
            self._policy.touch(key)
        self._index[key] = size
        self._used += size

    def _forget_locked(self, key: ChunkKey) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        self._policy.remove(key)
        return True

    def _evict_locked(self, incoming: int) -> None:
        """Evict until ``incoming`` more bytes fit. Files are unlinked here, under
        the lock, like every change to a final path: another thread never sees
        an index entry without its file or a file it could re-index by mistake."""
        excess = self._used + self._reserved + incoming - self.options.capacity
        if excess <= 0:
            return
        chosen: list[ChunkKey] = []
        for key in self._policy.candidates():
            chosen.append(key)
            excess -= self._index[key]
            if excess <= 0:
                break
        for key in chosen:
            self._policy.evicted(key)
            self._used -= self._index.pop(key)
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))
        self._counters["evictions"] += len(chosen)

    def _unlink_all(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` over ``items`` in order; with ``io_threads``, one contiguous
        share per thread (one task each: fewer hand-offs than a task per item)."""
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        k = min(self.options.io_threads, len(items))
        cuts = [len(items) * i // k for i in range(k + 1)]
        shares = [items[a:b] for a, b in pairwise(cuts)]
        out: list[_R] = []
        for part in self._pool.map(lambda share: [fn(x) for x in share], shares):
            out += part
        return out

    # -- Backend ------------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = []
        for key in keys:
            with self._lock:  # the file and the index agree under the lock
                size = file_size(self._path(key))
                if size is not None and not self._plausible_size(size):
                    size = None  # not a frame of this namespace: a miss when read
                if size is None:
                    self._forget_locked(key)
                elif key not in self._index:  # stored by another process
                    self._add_locked(key, size)
                    self._evict_locked(0)
            out.append(size is not None)
        return out

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        return self._map(self._load, [(k, None) for k in keys])

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Like :meth:`get`, but each verified payload is copied into ``outs[i]``
        (a writable buffer it must fill exactly, e.g. a host-tier slot): no
        allocation. Where the answer is False the destination's contents are
        undefined; an entry of another size is a miss."""
        items = [(k, [o]) for k, o in zip(keys, outs)]
        return [v is not None for v in self._map(self._load, items)]

    def get_into_parts(
        self, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """Like :meth:`get_into`, each verified payload copied into the buffers
        ``outs[i]`` in order (their sizes must add up to the payload's)."""
        items = [(k, list(parts)) for k, parts in zip(keys, outs)]
        return [v is not None for v in self._map(self._load, items)]

    def _load(self, item: tuple[ChunkKey, list[memoryview] | None]) -> memoryview | None:
        """The verified payload of ``key`` (copied into ``outs`` when given; then
        ``outs[0]`` or an empty view stands for the hit), or None for a miss.
        The file is read on the tier's reader threads within ``read_timeout``."""
        key, outs = item
        path = self._path(key)
        want = None if outs is None else sum(o.nbytes for o in outs)
        res = self._reader.run(partial(self._read_file, path, key, want), outs)
        if res is TIMED_OUT:
            self._count("read_timeouts", "errors", "misses")
            self._burst.warning(
                "read_timeout",
                "disk tier: a read in %s took over %.1f s (a hung file system?): a miss; "
                "%d of %d reader threads still blocked",
                self._root, self.options.read_timeout, self._reader.late,
                self.options.read_workers,
            )  # fmt: skip
            return None
        if res is STALLED:
            self._count("read_stalled", "misses")
            self._burst.warning(
                "read_stalled",
                "disk tier: all %d reader threads are blocked past their deadline in %s; "
                "reads are misses without touching the file system until one returns",
                self.options.read_workers, self._root,
            )  # fmt: skip
            return None
        assert isinstance(res, _Read)
        if res.kind == "absent" or res.kind == "open_error":
            if res.kind == "open_error":
                self._count("read_errors", "errors")
                self._burst.warning("read", "disk tier: cannot open %s: %s", path, res.detail)
            with self._lock:
                if file_size(path) is None:  # (not published by a put meanwhile)
                    self._forget_locked(key)
            self._count("misses")
            return None
        if res.kind == "abandoned":  # the caller timed out meanwhile (never here in order)
            self._count("misses")
            return None
        if res.kind == "rejected":
            self._reject(key, path, res.detail)
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
            self.delete([key])
            return None
        assert res.kind == "ok" and res.st is not None
        with self._lock:
            if key in self._index:
                self._policy.touch(key)
            elif same_file(path, res.st):  # stored by another process (not deleted meanwhile)
                self._add_locked(key, res.st.st_size)
                self._evict_locked(0)
            self._counters["hits" if res.fits else "misses"] += 1
        if not res.fits:
            return None
        if outs is None:
            return res.payload
        return outs[0] if outs else memoryview(b"")

    def _read_file(self, path: str, key: ChunkKey, want: int | None, handoff: Handoff) -> _Read:
        """On a reader thread: open, check, read and verify ``path``; with ``want``
        (the caller's buffers' total size), copy a payload of that size into the
        caller's buffers, only if the caller still waits (``handoff.deliver``).
        Touches no index and takes no lock of the tier: it may block for good."""
        if handoff.abandoned:  # queued past its deadline: not attempted
            return _Read("abandoned")
        try:
            fd = os.open(path, _OPEN_FLAGS)
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
                data = self._scratch(size)
                readv_all(fd, [data])
            if time.time() - st.st_mtime > MTIME_REFRESH_SECONDS:
                with contextlib.suppress(OSError):  # read-only mount: fine
                    os.utime(fd)  # LRU order that survives restarts (coarse)
        except OSError as exc:
            return _Read("read_error", exc.strerror or str(exc))
        finally:
            os.close(fd)
        try:
            payload = decode_chunk(data, namespace_fp=self._ns, key=key, mac_key=self._mac)
        except UnverifiableChunk as exc:
            return _Read("unverifiable", exc.reason)
        except CorruptChunk as exc:
            return _Read("corrupt", exc.reason)
        if want is None:
            return _Read("ok", st=st, payload=payload)
        fits = payload.nbytes == want
        if fits and not handoff.deliver(partial(scatter_into, payload)):
            return _Read("abandoned")
        return _Read("ok", st=st, fits=fits)

    def _scratch(self, size: int) -> memoryview:
        """This reader thread's own buffer of ``size`` bytes (kept between reads,
        so its pages are already faulted in; ``read_workers`` of them at most)."""
        buf: bytearray | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            self._tls.buf = buf
        return memoryview(buf)[:size]

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._map(self._put_one, items)

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        """Like :meth:`put` of the joined parts (the same frame on disk), written
        with one ``writev`` from the parts as they are: no join, no copy."""
        return self._map(self._put_one, [(k, flat_parts(parts)) for k, parts in items])

    def _put_one(self, item: tuple[ChunkKey, Any]) -> bool:
        key, value = item
        if isinstance(value, list):  # from put_parts: flat byte views
            parts: list[memoryview] = value
            nbytes = sum(p.nbytes for p in parts)
            header = encode_header(self._ns, key, parts, "|u1", (nbytes,), mac_key=self._mac)
        else:
            flat, dtype, shape = as_payload(value)
            parts, nbytes = [flat], flat.nbytes
            header = encode_header(self._ns, key, flat, dtype, shape, mac_key=self._mac)
        size = len(header) + nbytes
        path = self._path(key)
        with self._lock:
            present = file_size(path)  # ours or another process's
            if present is not None:
                if key in self._index:
                    self._policy.touch(key)
                else:
                    self._add_locked(key, present)
                    self._evict_locked(0)
                self._counters["put_skipped_present"] += 1
                return True
            if size > self.options.capacity or not self._plausible_size(size):
                self._counters["put_too_large"] += 1
                self._counters["put_failures"] += 1
                return False
            self._evict_locked(size)
            if self._used + self._reserved + size > self.options.capacity:
                self._counters["put_no_room"] += 1  # the rest is writes in flight
                self._counters["put_failures"] += 1
                return False
            self._reserved += size
        try:
            self._write_file(path, header, parts, key, size)
        except OSError as exc:
            kind = _ERRNO_STAT.get(exc.errno or 0, "other_errors")
            self._count(f"put_{kind}", "put_failures", "errors")
            self._burst.warning(
                f"put_{kind}", "disk tier: store refused in %s: %s", self._root, exc.strerror
            )
            with self._lock:
                self._reserved -= size
            return False
        return True

    def _write_file(
        self, path: str, header: bytes, payload: list[memoryview], key: ChunkKey, size: int
    ) -> None:
        """Write a temporary file, then publish it (rename), index it and end the
        reservation of ``size`` bytes in one step under the lock (on an error the
        caller ends the reservation)."""
        directory = os.path.dirname(path)
        try:
            self._makedirs(directory)
        except ValueError as exc:  # someone else's directory where ours belongs
            raise OSError(errno.EACCES, str(exc)) from None
        tmp = os.path.join(
            directory,
            f"{_TMP_PREFIX}{os.path.basename(path)}.{os.getpid()}.{next(self._tmp_names)}",
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                write_all(fd, [memoryview(header), *payload])
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, path)
                self._reserved -= size
                self._add_locked(key, size)
                self._counters["puts"] += 1
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.options.fsync:
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            with self._lock:
                known = self._forget_locked(key)
                try:
                    os.unlink(self._path(key))
                    removed = True
                except OSError:
                    removed = False
            n += known or removed
        self._count_n("deletes", n)
        return n

    def clear(self) -> None:
        # under the lock, as every change to a final path: a put finishing meanwhile
        # either lands before (and is cleared) or after (and stays indexed)
        with self._lock:
            for key in list(self._index):
                self._forget_locked(key)
            dirs = [self._root]
            try:
                dirs += [e.path for e in os.scandir(self._root) if e.is_dir(follow_symlinks=False)]
            except OSError:
                return
            for d in dirs:
                try:
                    names = [e.path for e in os.scandir(d) if _ENTRY_RE.match(e.name)]
                except OSError:
                    continue
                self._unlink_all(names)

    def iter_keys(self) -> Iterator[ChunkKey]:
        with self._lock:
            return iter(list(self._index))

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counters.items()}
            out.update(
                entries=float(len(self._index)),
                bytes_used=float(self._used),
                bytes_reserved=float(self._reserved),
                reads_blocked=float(self._reader.late),
                capacity_bytes=float(self.options.capacity),
            )
        return out

    def capacity_bytes(self) -> int:
        return self.options.capacity

    def corrupt_count(self) -> int:
        with self._lock:
            return self._counters["corrupt"]

    def error_count(self) -> int:
        with self._lock:
            return self._counters["errors"]

    def available(self) -> bool:
        """False while every reader thread is held by a read past its deadline:
        reads are then misses without touching the file system (``read_stalled``),
        so they say nothing about whether it is back."""
        return self._reader.late < self.options.read_workers

    def close(self) -> None:
        self._reader.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- helpers --------------------------------------------------------------------
    def _plausible_size(self, size: int) -> bool:
        """A file of ``size`` bytes can be a frame of this namespace."""
        return size >= HEADER_SIZE and (self._max_frame is None or size <= self._max_frame)

    def _reject(self, key: ChunkKey, path: str, what: str) -> None:
        """``path`` cannot be a frame (a symlink, a FIFO, too big): a miss, and
        the entry removed (unlinking a symlink removes the link, not its target)."""
        self._count("rejected", "corrupt", "misses")
        self._burst.warning("rejected", "disk tier: dropping %s: %s", path, what)
        with self._lock:
            self._forget_locked(key)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counters[name] += 1

    def _count_n(self, name: str, n: int) -> None:
        with self._lock:
            self._counters[name] += n

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        root = os.path.abspath(options.path)
        out: list[dict[str, Any]] = []
        try:
            namespaces = sorted(
                (e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)),
                key=lambda e: e.name,
            )
        except OSError:
            return out
        for ns in namespaces:
            entries = size = 0
            sample: str | None = None
            for dirpath, _dirs, files in os.walk(ns.path):
                for name in files:
                    if name.startswith("."):
                        continue  # temp files of writes in progress
                    path = os.path.join(dirpath, name)
                    try:
                        size += os.stat(path).st_size
                    except OSError:
                        continue
                    entries += 1
                    sample = sample or path
            row: dict[str, Any] = {"namespace": ns.name, "entries": entries, "bytes": size}
            if sample is not None:
                try:
                    fd = os.open(sample, _OPEN_FLAGS)
                    with open(fd, "rb") as fh:
                        st = os.fstat(fd)
                        if not stat.S_ISREG(st.st_mode):
                            raise CorruptChunk("not a regular file")
                        h = parse_header(fh.read(HEADER_SIZE), st.st_size - HEADER_SIZE)
                    row["format_version"] = h.version
                    row["dtype"], row["shape"] = h.dtype, list(h.shape)
                except (OSError, CorruptChunk) as exc:
                    row["sample_error"] = str(exc)
            out.append(row)
        return out

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        """Unlink every chunk file under ``path`` (or under its ``namespace``
        directory); directories and anything not named like a chunk stay."""
        root = os.path.abspath(options.path)
        try:
            dirs = [
                e.path
                for e in os.scandir(root)
                if e.is_dir(follow_symlinks=False) and namespace in (None, e.name)
            ]
        except FileNotFoundError:
            return 0
        n = 0
        for ns_dir in dirs:
            for dirpath, _dirs, files in os.walk(ns_dir):
                for name in files:
                    if _ENTRY_RE.match(name):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(dirpath, name))
                            n += 1
        return n

    def __repr__(self) -> str:
        return f"DiskBackend({self._root!r}, capacity={self.options.capacity})"


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"disk": DiskBackend}
