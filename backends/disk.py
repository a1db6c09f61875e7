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
- Every system call has a deadline (``read_timeout``): reads, ``exists`` and
  the start-up check and scan run on the tier's own ``read_workers`` reader
  threads, writes (framing included), deletes and ``clear`` on as many writer
  threads (:mod:`kvsdk.backends.disk_reader`), and the caller waits at most
  that long: a late read or look is a miss and an error, a late write a
  dropped write (its writer thread removes the temp file when the OS returns),
  a start-up without an answer an empty or partial index (the directory check
  is then made before the first operation). Reads go ``READ_STEP`` chunks per
  hand-off to a reader thread (a hand-off costs ~50-100 us; one deadline per
  step), writes ``WRITE_STEP``. A read into a caller's buffer reads the frame
  ``READ_PIECE`` bytes at a time into the reader thread's own buffer, feeds
  each piece to the check (:class:`~kvsdk.chunk_format.PayloadCheck`) and
  copies it on while it is still in the CPU's cache, only while the caller
  still waits: a late read never writes into a slot that may hold another
  chunk by then, and the copy costs about what reading straight into the slot
  did. A frame that fails its check leaves the buffer undefined (a miss).
  ``inventory`` (``kvsdk inspect``) walks each namespace on a thread of its
  own within ``read_timeout`` too.
- Scatter/gather: ``put_parts`` writes a payload given as a list of buffers
  (a page lying in several regions of host memory) with ``pwritev`` calls, and
  ``get_into_parts`` reads one into a list of buffers (the pieces above); the
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
policy updates happen under one lock, never held over a system call; changes
to a final path (publish, unlink) with their index update under a second one,
taken only on the tier's own threads; a look at the file system (``exists``, a
read) applies what it saw to the index only if no such change ran meanwhile.
A caller's thread makes no system call and waits on nothing the file system
can hold beyond the deadline (batches optionally spread over ``io_threads``;
off by default, as it measured slower).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
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
from kvsdk.backends import disk_inventory
from kvsdk.backends.disk_files import (
    ENTRY_RE,
    OPEN_FLAGS,
    SUFFIX,
    check_private_dir,
    check_top_dir,
    copy_at,
    file_size,
    flat_parts,
    pread_full,
    read_whole,
    write_frame,
)
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, DeadlineReader, Handoff
from kvsdk.burst_log import BurstLog
from kvsdk.chunk_format import (
    FP_BYTES,
    HEADER_SIZE,
    CorruptChunk,
    HeaderAfterPayload,
    PayloadCheck,
    UnverifiableChunk,
    as_payload,
    decode_chunk,
)
from kvsdk.config import BYTES
from kvsdk.eviction import EvictionPolicy, LRUPolicy
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp."
STALE_TMP_SECONDS = 3600.0
"""Temp files older than this are left-overs of a crashed writer; removed at start."""
LOOK_STEP = 256
"""``exists`` looks at this many files per hand-off to a reader thread, each step
within ``read_timeout`` (after a step past it, the rest of the call is a miss)."""
READ_STEP = 16
"""Reads one hand-off to a reader thread carries (one deadline each)."""
READ_PIECE = 256 << 10
"""Bytes a reader thread reads, checks and copies on at a time (stays in its cache)."""
WRITE_PIECE = 256 << 10
"""Bytes a writer thread writes, then checksums while they are still in its cache."""
WRITE_STEP = 16
"""Writes per hand-off to a writer thread, each step within ``read_timeout`` (a
long healthy batch is never dropped for its length; after a step past its
deadline the rest of the batch is dropped at once)."""
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


_Item = tuple[ChunkKey, list[memoryview] | None]
"""A read: the key, and the caller's buffers to fill (None: return the payload)."""


def _deliver_read(res: _Read, target: tuple[list[Any], list[_Read]]) -> None:
    target[1].append(res)


def _copy_piece(piece: memoryview, offset: int, item: int, target: tuple[list[Any], Any]) -> None:
    copy_at(piece, offset, target[0][item])


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
    """Seconds any file-system call of this tier may take: one chunk read (open, fstat,
    read, verify), a step of `exists` or of a write (framing included), a delete, the
    start-up check and scan. Past it a read or look is a miss (`read_timeouts`), a
    write is dropped (`put_timeouts`), each counted in the tier's errors, so a hung
    network file system never holds the caller longer."""
    read_workers: int = 4
    """Reader threads of this tier (reads, `exists`, start-up), and as many writer
    threads (writes, deletes, clear); callers wait at most `read_timeout`. A call past
    its deadline keeps its thread until the OS returns; while all of a set are held
    so, its calls fail at once without a system call (`read_stalled`, `put_stalled`),
    logged."""

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
        # Two locks. ``_lock``: the index, policy and counters, in memory only, never
        # held over a system call (a caller's thread takes it). ``_fs_lock``: every
        # change to a chunk's final path with the index update that goes with it
        # (publish, unlink), taken only on the tier's own worker threads, always
        # before ``_lock``. ``_seq`` is odd while such a change is in progress and
        # moves on with each: a look at the file system (exists, a read) applies
        # what it saw to the index only if ``_seq`` did not move meanwhile.
        self._lock = threading.Lock()
        self._fs_lock = threading.Lock()
        self._seq = 0
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
             "put_timeouts", "put_stalled", "corrupt", "unverifiable", "rejected", "read_errors",
             "read_timeouts", "read_stalled", "evictions", "deletes", "errors"), 0
        )  # fmt: skip
        self._pool = (
            ThreadPoolExecutor(options.io_threads, thread_name_prefix="kvsdk-disk")
            if options.io_threads > 1
            else None
        )
        # every system call runs on one of these (callers wait at most read_timeout):
        # reads, exists and the start-up scan on the readers, writes and deletes on the
        # writers (so a backlog of writes never delays a read)
        self._reader = DeadlineReader(options.read_workers, options.read_timeout)
        self._writer = DeadlineReader(
            options.read_workers, options.read_timeout, name="kvsdk-disk-write"
        )
        weakref.finalize(self, self._reader.close)  # a tier dropped without close()
        weakref.finalize(self, self._writer.close)
        self._tls = threading.local()  # each reader thread's scratch buffer
        self._made_dirs: set[str] = set()
        self._checked = False  # the directories checked (or made); else retried first
        self._check_lock = threading.Lock()  # (worker threads only)
        self._start()

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

    # -- start: directories and the scan, each step within read_timeout ----------------
    def _start(self) -> None:
        """Check or create the directories, then index what they hold, oldest
        first. Each step runs on a thread of its own (stopped afterwards, so a
        tier made before a ``fork`` starts its workers afresh in the child) and
        is waited for at most ``read_timeout``: on a file system that does not
        answer the tier starts with what it indexed so far (entries not indexed
        are found when looked up), and the directory check is made again before
        the first operation that reaches the file system."""
        boot = DeadlineReader(1, self.options.read_timeout, name="kvsdk-disk-start")
        try:
            if self._at_start(boot, self._setup, "checking the directories") is TIMED_OUT:
                return
            self._checked = True
            dirs = self._at_start(boot, self._list_dirs, "listing the directories")
            if not isinstance(dirs, list):
                return
            found: list[tuple[float, ChunkKey, int]] = []
            for d in dirs:
                part = self._at_start(boot, partial(self._scan_dir, d), "scanning " + d)
                if not isinstance(part, list):
                    break  # no answer: index what was found so far
                found += part
            found.sort()
            with self._lock:
                for _, key, size in found:
                    self._add_locked(key, size)
                victims = self._evict_locked(0)
            if victims:  # over capacity (a smaller one than last time): the oldest go
                self._at_start(boot, partial(self._unlink_all, victims), "evicting")
        finally:
            boot.close()

    def _at_start(self, boot: DeadlineReader, fn: Callable[[], _R], what: str) -> Any:
        res = boot.run(lambda handoff: None if handoff.abandoned else fn())
        if res is TIMED_OUT or res is STALLED:
            self._count(*(("read_timeouts", "errors") if res is TIMED_OUT else ("read_stalled",)))
            self._burst.warning(
                "start_timeout",
                "disk tier: %s in %s took over %.1f s at start (a hung file system?); the "
                "tier starts with the entries indexed so far",
                what, self._root, self.options.read_timeout,
            )  # fmt: skip
            return TIMED_OUT
        return res

    def _setup(self) -> None:
        top = os.path.abspath(self.options.path)
        try:
            os.makedirs(top, mode=0o700, exist_ok=True)
            check_top_dir(top)
            self._makedirs(self._root)
            for shard in range(self.options.shards if self.options.shards > 1 else 0):
                self._makedirs(os.path.join(self._root, f"{shard:0{self._shard_width}x}"))
        except OSError as exc:
            self._count("errors")
            self._burst.warning("mkdir", "disk tier: cannot create %s (%s); stores will fail",
                                self._root, exc.strerror)  # fmt: skip

    def _ensure_checked(self) -> None:
        """On a worker: the directory check, if the one at start had no answer
        (raises ``ValueError`` for a directory that is not safe to use)."""
        if self._checked:
            return
        with self._check_lock:
            if not self._checked:
                self._setup()
                self._checked = True

    def _list_dirs(self) -> list[str]:
        dirs = [self._root]
        try:
            dirs += [e.path for e in os.scandir(self._root) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        return dirs

    def _scan_dir(self, d: str) -> list[tuple[float, ChunkKey, int]]:
        """The entries of directory ``d`` as (mtime, key, size); stale temp files
        are removed, files written with another shard count moved to their place."""
        found: list[tuple[float, ChunkKey, int]] = []
        now = time.time()
        try:
            entries = list(os.scandir(d))
        except OSError:
            return found
        for e in entries:
            try:
                if e.name.startswith(_TMP_PREFIX):
                    if now - e.stat().st_mtime > STALE_TMP_SECONDS:
                        os.unlink(e.path)
                    continue
                if not ENTRY_RE.match(e.name) or not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
                if not self._plausible_size(st.st_size):
                    continue  # not a frame of this namespace: a miss when asked
                key = bytes.fromhex(e.name[:32])
                want = self._path(key)
                if e.path != want:  # written with another shard count
                    self._makedirs(os.path.dirname(want))
                    with self._final_paths():
                        os.replace(e.path, want)
                found.append((st.st_mtime, key, st.st_size))
            except OSError:
                continue
        return found

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

    def _evict_locked(self, incoming: int) -> list[str]:
        """Choose and forget entries until ``incoming`` more bytes fit; returns
        their paths, which the caller unlinks before it leaves
        :meth:`_final_paths` (so another thread never sees an index entry without
        its file, or a file it could re-index by mistake)."""
        excess = self._used + self._reserved + incoming - self.options.capacity
        if excess <= 0:
            return []
        chosen: list[ChunkKey] = []
        for key in self._policy.candidates():
            chosen.append(key)
            excess -= self._index[key]
            if excess <= 0:
                break
        for key in chosen:
            self._policy.evicted(key)
            self._used -= self._index.pop(key)
        self._counters["evictions"] += len(chosen)
        return [self._path(key) for key in chosen]

    @contextlib.contextmanager
    def _final_paths(self) -> Iterator[None]:
        """Held while a final path changes (on a worker thread): ``_fs_lock``, with
        ``_seq`` odd inside and moved on, so looks made meanwhile are not applied."""
        with self._fs_lock:
            with self._lock:
                self._seq += 1
            try:
                yield
            finally:
                with self._lock:
                    self._seq += 1

    def _unlink_all(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)

    # -- what a look at the file system found -------------------------------------------
    def _settle(self, key: ChunkKey, size: int | None, seq: int) -> bool:
        """Apply what a look at ``key``'s file (begun when ``_seq`` was ``seq``)
        found, ``size`` or None (absent), to the index, unless a final path
        changed meanwhile; True when it is an entry this tier does not index yet
        (stored by another process: :meth:`_adopt` it)."""
        with self._lock:
            if self._seq != seq or seq & 1:
                return False  # a change in between: the next look settles it
            if size is None:
                self._forget_locked(key)
                return False
            return key not in self._index

    def _adopt(self, key: ChunkKey, size: int, seq: int) -> None:
        """Index an entry another process stored (found with ``_seq`` at ``seq``),
        evicting for it, unless a final path changed since. Skipped while another
        change holds ``_fs_lock``: a later look adopts it."""
        if not self._fs_lock.acquire(blocking=False):
            return
        try:
            with self._lock:
                if self._seq != seq or key in self._index:
                    return
                self._seq += 1
                self._add_locked(key, size)
                victims = self._evict_locked(0)
            self._unlink_all(victims)
            with self._lock:
                self._seq += 1
        finally:
            self._fs_lock.release()

    def _remove(self, key: ChunkKey, path: str) -> bool:
        """Forget ``key`` and unlink its file (on a worker); True if either was there."""
        with self._final_paths():
            with self._lock:
                known = self._forget_locked(key)
            try:
                os.unlink(path)
                removed = True
            except OSError:
                removed = False
        return known or removed

    def _missed_deadline(self, res: object, what: str, pool: DeadlineReader, n: int = 1) -> None:
        """Count and log ``n`` operations that got no answer within ``read_timeout``
        (``TIMED_OUT``: misses and errors) or were not made as every thread of
        ``pool`` is blocked (``STALLED``)."""
        kind = "put" if pool is self._writer else "read"
        threads = "writer" if pool is self._writer else "reader"
        if res is TIMED_OUT:
            self._count_n(f"{kind}_timeouts", n)
            self._count_n("errors", n)
            self._burst.warning(
                f"{what}_timeout",
                "disk tier: %s in %s took over %.1f s (a hung file system?): a miss; "
                "%d of %d %s threads still blocked",
                what, self._root, self.options.read_timeout, pool.late,
                self.options.read_workers, threads,
            )  # fmt: skip
        else:
            self._count_n(f"{kind}_stalled", n)
            self._burst.warning(
                f"{what}_stalled",
                "disk tier: all %d %s threads are blocked past their deadline in %s; "
                "a %s is a miss without touching the file system until one returns",
                self.options.read_workers, threads, self._root, what,
            )  # fmt: skip

    # -- Backend ------------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key's file is there (this or another process stored it),
        looked at on a reader thread within ``read_timeout``: past it, or while
        every reader thread is blocked, every key is a miss."""
        keys = list(keys)
        paths = [self._path(k) for k in keys]
        out: list[bool] = []
        for i in range(0, len(keys), LOOK_STEP):
            step = partial(self._exists_task, keys[i : i + LOOK_STEP], paths[i : i + LOOK_STEP])
            res = self._reader.run(step)
            if res is TIMED_OUT or res is STALLED:  # the rest: misses, not attempted
                self._missed_deadline(res, "exists", self._reader)
                return out + [False] * (len(keys) - len(out))
            assert isinstance(res, list)
            out += res
        return out

    def _exists_task(self, keys: list[ChunkKey], paths: list[str], handoff: Handoff) -> list[bool]:
        """On a reader thread: one ``lstat`` per key, applied to the index."""
        out: list[bool] = []
        if handoff.abandoned:
            return out
        self._ensure_checked()
        for key, path in zip(keys, paths):
            if handoff.abandoned:  # the caller gave up: the rest is not looked at
                break
            seq = self._seq
            size = file_size(path)
            if size is not None and not self._plausible_size(size):
                size = None  # not a frame of this namespace: a miss when read
            if self._settle(key, size, seq):
                assert size is not None
                self._adopt(key, size, seq)
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

    def _in_shares(self, fn: Callable[[list[_T]], list[_R]], items: list[_T]) -> list[_R]:
        """``fn`` over ``items`` in order; with ``io_threads``, one contiguous
        share per thread (one task each: fewer hand-offs than a task per item)."""
        if self._pool is None or len(items) < 2:
            return fn(items)
        k = min(self.options.io_threads, len(items))
        cuts = [len(items) * i // k for i in range(k + 1)]
        out: list[_R] = []
        for part in self._pool.map(fn, [items[a:b] for a, b in pairwise(cuts)]):
            out += part
        return out

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
        for j, (key, want) in enumerate(wants):
            res = self._read_task(self._path(key), key, want, handoff, j)
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
        self, path: str, key: ChunkKey, want: int | None, handoff: Handoff, item: int
    ) -> _Read:
        """On a reader thread: read ``path`` (:meth:`_read_file`; the caller's
        buffers are item ``item`` of the handoff's), then make the
        index agree with what was found (a file that is gone is forgotten, one
        another process stored is indexed, a bad one removed)."""
        if handoff.abandoned:  # queued past its deadline: not attempted
            return _Read("abandoned")
        self._ensure_checked()
        seq = self._seq
        res = self._read_file(path, key, want, handoff, item)
        if res.kind == "absent" or res.kind == "open_error":
            self._settle(key, None, seq)
        elif res.kind == "rejected" or res.kind == "corrupt":
            # a symlink, FIFO or huge file, or a frame that fails verification: removed
            # (unlinking a symlink removes the link, not its target)
            if self._remove(key, path) and res.kind == "corrupt":
                self._count("deletes")
        elif res.kind == "ok":
            assert res.st is not None
            touched = False
            with self._lock:
                if key in self._index:
                    self._policy.touch(key)
                    touched = True
            if not touched and self._settle(key, res.st.st_size, seq):
                self._adopt(key, res.st.st_size, seq)  # stored by another process
        return res

    def _read_file(
        self, path: str, key: ChunkKey, want: int | None, handoff: Handoff, item: int
    ) -> _Read:
        """On a reader thread: open, check, read and verify ``path``; with ``want``
        (the caller's buffers' total size), copy a payload of that size into the
        caller's buffers, only if the caller still waits (``handoff.deliver``).
        Touches no index and takes no lock of the tier: it may block for good."""
        try:
            fd = os.open(path, OPEN_FLAGS)
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
        for key, value in items:
            if handoff.abandoned:  # past the deadline: the rest not attempted
                return
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
            outcome = self._write_one(self._path(key), key, frame, parts, HEADER_SIZE + nbytes,
                                      handoff)  # fmt: skip
            if outcome == "abandoned" or not handoff.deliver(partial(_append, outcome)):
                return

    def _write_one(
        self, path: str, key: ChunkKey, frame: HeaderAfterPayload, parts: list[memoryview],
        size: int, handoff: Handoff,
    ) -> str | OSError:  # fmt: skip
        """Reserve room (or find the key stored), write a temporary file, then
        publish it (rename), index it and end the reservation in one step. An
        outcome: stored, present, too_large, no_room, abandoned (the caller gave
        up before the rename), or the ``OSError`` that refused the write."""
        with self._final_paths():
            present = file_size(path)  # ours or another process's
            victims: list[str] = []
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
            self._unlink_all(victims)
        if outcome:
            return outcome
        try:
            return self._write_file(path, frame, parts, key, size, handoff)
        except OSError as exc:
            with self._lock:
                self._reserved -= size
            return exc

    def _write_file(
        self, path: str, frame: HeaderAfterPayload, payload: list[memoryview], key: ChunkKey,
        size: int, handoff: Handoff,
    ) -> str:  # fmt: skip
        """Write a temporary file, then publish it (rename), index it and end the
        reservation of ``size`` bytes in one step (on an error the caller ends
        the reservation). "abandoned" if the caller gave up before the rename:
        the temporary file is removed, the reservation ended, nothing published."""
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
                write_frame(fd, frame, payload, WRITE_PIECE)
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if handoff.abandoned:  # past its deadline: a dropped write
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                with self._lock:
                    self._reserved -= size
                return "abandoned"
            with self._final_paths():
                os.replace(tmp, path)
                with self._lock:
                    self._reserved -= size
                    self._add_locked(key, size)
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
        return "stored"

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Forget and unlink ``keys`` on a writer thread within ``read_timeout``
        (past it: 0, an error; the writer thread finishes when the OS returns)."""
        if not keys:
            return 0
        paths = [self._path(k) for k in keys]
        res = self._writer.run(partial(self._delete_task, list(keys), paths))
        if res is TIMED_OUT or res is STALLED:
            self._missed_deadline(res, "delete", self._writer)
            return 0
        assert isinstance(res, int)
        self._count_n("deletes", res)
        return res

    def _delete_task(self, keys: list[ChunkKey], paths: list[str], handoff: Handoff) -> int:
        if handoff.abandoned:
            return 0
        self._ensure_checked()
        return sum(self._remove(key, path) for key, path in zip(keys, paths))

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
        with self._final_paths():
            with self._lock:
                for key in list(self._index):
                    self._forget_locked(key)
            for d in self._list_dirs():
                try:
                    names = [e.path for e in os.scandir(d) if ENTRY_RE.match(e.name)]
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
                writes_blocked=float(self._writer.late),
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
        """False while every reader thread (or every writer thread) is held by a
        call past its deadline: calls are then misses without touching the file
        system (``read_stalled``, ``put_stalled``), so they say nothing about
        whether it is back."""
        n = self.options.read_workers
        return self._reader.late < n and self._writer.late < n

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- helpers --------------------------------------------------------------------
    def _plausible_size(self, size: int) -> bool:
        """A file of ``size`` bytes can be a frame of this namespace."""
        return size >= HEADER_SIZE and (self._max_frame is None or size <= self._max_frame)

    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counters[name] += 1

    def _count_n(self, name: str, n: int) -> None:
        with self._lock:
            self._counters[name] += n

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        return disk_inventory.inventory(options)

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        return disk_inventory.wipe(options, namespace)

    def __repr__(self) -> str:
        return f"DiskBackend({self._root!r}, capacity={self.options.capacity})"


def _append(item: object, out: list[object]) -> None:
    out.append(item)


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"disk": DiskBackend}
