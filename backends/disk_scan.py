"""The disk tier's start: its directories checked (or created) and scanned
to rebuild the index, oldest ``mtime`` first, each step within
``read_timeout``; the directory check made again before the first operation
when the one at start got no answer; the directories made on the way."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from kvsdk.backends.disk_dirs import open_dir
from kvsdk.backends.disk_files import ENTRY_RE, SUFFIX, TMP_PREFIX
from kvsdk.backends.disk_index import DiskIndex
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, DeadlineReader
from kvsdk.types import ChunkKey

STALE_TMP_SECONDS = 3600.0
"""Temp files older than this are left-overs of a crashed writer; removed at start."""
_R = TypeVar("_R")


class DiskScan(DiskIndex):
    """The start-up part of the disk tier (a base of
    :class:`~kvsdk.backends.disk.DiskBackend`, which calls :meth:`_start`)."""

    _checked: bool
    """The directories checked (or made); else retried first."""
    _check_lock: threading.Lock
    """(worker threads only)"""

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
                where = "scanning " + self._dirs.path(d)
                part = self._at_start(boot, partial(self._scan_dir, d), where)
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
        """Make or check the tier's directories (``ValueError`` for one that is
        not safe to use; one that cannot be made is counted and logged)."""
        try:
            self._dirs.setup(self._shard_names)
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

    def _list_dirs(self) -> list[str | None]:
        """The directories that may hold chunk files: the namespace directory
        (None) and each directory in it (a symlink there is not one)."""
        with self._dirs.walk() as walk:
            try:
                fd = walk.checked_fd(None)
                if fd is None:
                    return []
                return [None, *[e.name for e in os.scandir(fd) if e.is_dir(follow_symlinks=False)]]
            except OSError:
                return []

    def _scan_dir(self, name: str | None) -> list[tuple[float, ChunkKey, int]]:
        """The entries of directory ``name`` (None: the namespace directory) as
        (mtime, key, size); stale temp files are removed, files written with
        another shard count moved to their place. The directory is opened
        without following a symlink, and each entry reached through it."""
        found: list[tuple[float, ChunkKey, int]] = []
        now = time.time()
        with self._dirs.walk() as walk:
            try:
                ns = walk.checked_fd(None)
                if ns is None:
                    return found
                fd = ns if name is None else open_dir(name, ns)
            except OSError:
                return found  # gone, or swapped for a symlink: not followed
            try:
                try:
                    entries = list(os.scandir(fd))
                except OSError:
                    return found
                for e in entries:
                    try:
                        if e.name.startswith(TMP_PREFIX):
                            if now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                                os.unlink(e.name, dir_fd=fd)
                            continue
                        if not ENTRY_RE.match(e.name) or not e.is_file(follow_symlinks=False):
                            continue
                        st = e.stat(follow_symlinks=False)
                        if not self._plausible_size(st.st_size):
                            continue  # not a frame of this namespace: a miss when asked
                        key = bytes.fromhex(e.name[: -len(SUFFIX)])
                        want, _ = self._where(key)
                        if want != name:  # written with another shard count
                            to = walk.make(want)
                            with self._final_paths():
                                os.replace(e.name, e.name, src_dir_fd=fd, dst_dir_fd=to)
                        found.append((st.st_mtime, key, st.st_size))
                    except OSError:
                        continue
            finally:
                if fd != ns:
                    os.close(fd)
        return found
