"""``disk``: chunks as self-describing files in a local directory.

Layout: ``<path>/<namespace_hex>/<shard>/<key_hex>.kvc``, each file one
:mod:`kvsdk.chunk_format` frame. Directories are created ``0700``, files ``0600``.

Files are untrusted (see ``docs/security.md``). At start the tier refuses a
``path`` that is not this user's or that others can write to, and a
namespace or shard directory that is a symlink, not this user's, or open to
group or others. Every file is reached by its name relative to a descriptor
of its directory, and every directory below ``path`` is opened ``O_NOFOLLOW |
O_DIRECTORY`` relative to its parent's (:mod:`~kvsdk.backends.disk_dirs`): a
symlink swapped in for the namespace or a shard directory while the tier runs
is never followed (a miss, counted as ``rejected`` and ``corrupt``, the link
removed; a write makes the directory again). Every read opens with
``O_NOFOLLOW | O_NONBLOCK`` (a planted symlink fails to open, a FIFO opens
without blocking), checks with ``fstat`` that it is a regular file no larger
than the largest frame this namespace writes, and only then reads: a FIFO, a
symlink or a huge sparse file is a miss (counted as ``rejected`` and
``corrupt``, the entry removed) without a byte read. With a
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

Its parts, one module each: :mod:`~kvsdk.backends.disk_options` (the options),
:mod:`~kvsdk.backends.disk_index` (the index, eviction and the two locks),
:mod:`~kvsdk.backends.disk_dirs` (the directories, held open),
:mod:`~kvsdk.backends.disk_scan` (the directories and the start-up scan),
:mod:`~kvsdk.backends.disk_workers` (the reader and writer threads, each a
:class:`~kvsdk.backends.disk_reader.DeadlineReader`),
:mod:`~kvsdk.backends.disk_reads` and :mod:`~kvsdk.backends.disk_writes`, on the
file primitives of :mod:`~kvsdk.backends.disk_files`;
:mod:`~kvsdk.backends.disk_inventory` is ``kvsdk inspect`` and ``kvsdk clear``.
This module puts them together as :class:`DiskBackend` and registers it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from typing import Any

from kvsdk.backend import Backend, TierContext
from kvsdk.backends import disk_inventory
from kvsdk.backends.disk_dirs import DirFds, dir_fd_limit
from kvsdk.backends.disk_options import DiskOptions
from kvsdk.backends.disk_reader import DeadlineReader
from kvsdk.backends.disk_reads import (
    LOOK_STEP,
    MTIME_REFRESH_SECONDS,
    READ_PIECE,
    READ_STEP,
    DiskReads,
)
from kvsdk.backends.disk_scan import STALE_TMP_SECONDS
from kvsdk.backends.disk_writes import WRITE_PIECE, WRITE_STEP, DiskWrites
from kvsdk.burst_log import BurstLog
from kvsdk.chunk_format import FP_BYTES, HEADER_SIZE
from kvsdk.eviction import LRUPolicy
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

__all__ = [
    "LOOK_STEP",
    "MTIME_REFRESH_SECONDS",
    "READ_PIECE",
    "READ_STEP",
    "STALE_TMP_SECONDS",
    "WRITE_PIECE",
    "WRITE_STEP",
    "DiskBackend",
    "DiskOptions",
    "kvsdk_backends",
]

log = logging.getLogger(__name__)


class DiskBackend(DiskReads, DiskWrites, Backend):
    """The ``disk`` tier: its reads, writes, start-up scan and index (the bases),
    set up and put together."""

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
        top = os.path.abspath(options.path)
        self._root = os.path.join(top, context.namespace_fp.hex())
        rejected = weakref.WeakMethod(self._dir_rejected)  # (the finalizer holds _dirs)

        def on_unsafe(path: str, detail: str) -> None:
            report = rejected()
            if report is not None:
                report(path, detail)

        self._dirs = DirFds(top, context.namespace_fp.hex(), on_unsafe, dir_fd_limit())
        weakref.finalize(self, self._dirs.close)
        width = len(f"{options.shards - 1:x}")
        n = options.shards if options.shards > 1 else 0
        self._shard_names = [f"{i:0{width}x}" for i in range(n)]
        # the index and its two locks (kvsdk.backends.disk_index)
        self._lock = threading.Lock()
        self._fs_lock = threading.Lock()
        self._seq = 0
        self._index = {}
        self._reserved = 0
        self._used = 0
        factory = context.policy_factory
        self._policy = (
            factory(capacity=max(1, options.capacity // max(1, context.chunk_bytes)))
            if factory
            else LRUPolicy()
        )
        self._tmp_names = count()
        self._burst = BurstLog(log)
        self._counters = dict.fromkeys(
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
        self._tls = threading.local()
        self._checked = False
        self._check_lock = threading.Lock()
        self._start()

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
        self._dirs.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        return disk_inventory.inventory(options)

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        return disk_inventory.wipe(options, namespace)

    def __repr__(self) -> str:
        return f"DiskBackend({self._root!r}, capacity={self.options.capacity})"


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"disk": DiskBackend}
