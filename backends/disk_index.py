"""The disk tier's index of its chunk files: where each key's file lives, what
the tier holds (key -> file size, in the eviction policy's order), the bytes
used and reserved, eviction, the locking that keeps the index in step with the
files, and the tier's counters (kept under the index lock).

Two locks. ``_lock``: the index, policy and counters, in memory only, never
held over a system call (a caller's thread takes it). ``_fs_lock``: every
change to a chunk's final path with the index update that goes with it
(publish, unlink), taken only on the tier's own worker threads, always before
``_lock``. ``_seq`` is odd while such a change is in progress and moves on
with each: a look at the file system (exists, a read) applies what it saw to
the index only if ``_seq`` did not move meanwhile.

Every file is reached by its name relative to a descriptor of its directory
(:mod:`~kvsdk.backends.disk_dirs`, one :class:`~kvsdk.backends.disk_dirs.DirWalk`
per step of work), never by a path: a symlink swapped in for a directory of
the tier is never followed."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator, Sequence

from kvsdk.backends.disk_dirs import DirFds, DirWalk
from kvsdk.backends.disk_files import SUFFIX
from kvsdk.backends.disk_options import DiskOptions
from kvsdk.burst_log import BurstLog
from kvsdk.chunk_format import HEADER_SIZE
from kvsdk.eviction import EvictionPolicy
from kvsdk.types import ChunkKey


class DiskIndex:
    """The index part of the disk tier (a base of
    :class:`~kvsdk.backends.disk.DiskBackend`, which sets these attributes)."""

    options: DiskOptions
    _ns: bytes
    """The namespace fingerprint every frame of this tier carries."""
    _mac: bytes | None
    """The namespace's frame MAC key (None: frames carry a checksum only)."""
    _max_frame: int | None
    """The largest frame this namespace writes (None: no limit known)."""
    _root: str
    """This namespace's directory (for messages: files are reached through ``_dirs``)."""
    _dirs: DirFds
    """The open directories every file is reached through."""
    _shard_names: list[str]
    """Each shard directory's name, by number (none with one shard)."""
    _burst: BurstLog
    _lock: threading.Lock
    _fs_lock: threading.Lock
    _seq: int
    _index: dict[ChunkKey, int]
    """key -> file size."""
    _reserved: int
    """Bytes of writes in flight."""
    _used: int
    """Bytes in the index."""
    _policy: EvictionPolicy
    _counters: dict[str, int]

    # -- where a key's file is ---------------------------------------------------------
    def _where(self, key: ChunkKey) -> tuple[str | None, str]:
        """The shard directory of ``key``'s file (None: the namespace directory
        itself, with one shard) and the file's name in it."""
        name = key.hex() + SUFFIX
        if not self._shard_names:
            return None, name
        return self._shard_names[int.from_bytes(key[:4], "big") % len(self._shard_names)], name

    def _path(self, key: ChunkKey) -> str:
        """``key``'s file as a path, for messages (never opened by it)."""
        shard, name = self._where(key)
        return os.path.join(self._dirs.path(shard), name)

    def _look(self, walk: DirWalk, key: ChunkKey) -> int | None:
        """The size of ``key``'s file if it is a regular file (None: absent, or a
        symlink, FIFO, ..., or its directory is not one to use)."""
        shard, name = self._where(key)
        try:
            st = walk.at(shard, lambda fd: os.lstat(name, dir_fd=fd))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _dir_rejected(self, path: str, detail: str) -> None:
        """Something other than a directory of this tier's where one belongs
        (:mod:`~kvsdk.backends.disk_dirs`): counted like a planted chunk file."""
        self._count("rejected", "corrupt")
        self._burst.warning("rejected_dir", "disk tier: %s: %s", path, detail)

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

    def _evict_locked(self, incoming: int) -> list[ChunkKey]:
        """Choose and forget entries until ``incoming`` more bytes fit; returns
        their keys, whose files the caller unlinks before it leaves
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
        return chosen

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

    def _unlink_all(self, keys: Sequence[ChunkKey], walk: DirWalk | None = None) -> None:
        """Unlink the files of ``keys`` (in ``walk``, or in a walk of its own)."""
        if walk is None:
            with self._dirs.walk() as own:
                self._unlink_all(keys, own)
            return
        for key in keys:
            self._unlink(walk, key)

    def _unlink(self, walk: DirWalk, key: ChunkKey) -> bool:
        """Unlink ``key``'s file; True if it was there."""
        shard, name = self._where(key)
        try:
            walk.at(shard, lambda fd: os.unlink(name, dir_fd=fd))
        except OSError:
            return False
        return True

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

    def _adopt(self, walk: DirWalk, key: ChunkKey, size: int, seq: int) -> None:
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
            self._unlink_all(victims, walk)
            with self._lock:
                self._seq += 1
        finally:
            self._fs_lock.release()

    def _remove(self, walk: DirWalk, key: ChunkKey) -> bool:
        """Forget ``key`` and unlink its file (on a worker); True if either was there."""
        with self._final_paths():
            with self._lock:
                known = self._forget_locked(key)
            removed = self._unlink(walk, key)
        return known or removed

    # -- sizes and counters ---------------------------------------------------------------
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
