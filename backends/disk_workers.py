"""The disk tier's worker threads: every system call of the tier runs on its
reader threads (reads, ``exists``) or writer threads (writes, deletes,
``clear``), and the caller waits at most ``read_timeout`` for each (see
:mod:`kvsdk.backends.disk_reader`); a batch is optionally spread over
``io_threads``; a call that missed its deadline is counted and logged here."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import TypeVar

from kvsdk.backends.disk_index import DiskIndex
from kvsdk.backends.disk_reader import TIMED_OUT, DeadlineReader

_T = TypeVar("_T")
_R = TypeVar("_R")


class DiskWorkers(DiskIndex):
    """The threads part of the disk tier (a base of
    :class:`~kvsdk.backends.disk.DiskBackend`, which starts them)."""

    _reader: DeadlineReader
    """Reads, ``exists`` (``read_workers`` threads)."""
    _writer: DeadlineReader
    """Writes, deletes, ``clear`` (as many threads; a backlog of writes never
    delays a read)."""
    _pool: ThreadPoolExecutor | None
    """``io_threads`` threads a batch is spread over (None: one)."""

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
