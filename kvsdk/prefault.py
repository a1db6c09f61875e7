"""Committing the host tier's memory ahead of the stores that need it.

A store into a page of the host tier that no process has touched yet pays a
page fault: the kernel allocates and zeroes the page, then maps it. Measured
on this project's 2-core VM (``benchmarks/bench_slab_prefault.py``), copying
512 KiB slots into fresh shared-memory pages ran at about 1 GiB/s, into
touched ones at 10-20 GiB/s; a second process mapping pages that exist paid
another 0.35-0.8 s/GiB in faults. At low reuse nearly every store lands in
pages never touched until the tier is full, so the faults, not the copy, were
the store's cost.

A :class:`Prefault` walks a mapping on a daemon thread with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later): pages are allocated
(by the first process) and mapped writable (in each), nothing is written, so
it is safe beside stores already running. Where the kernel lacks it the walk
stops at once and the tier faults pages in as it goes, as before.

Where the process has no CPU to spare (its torch threads already fill every
CPU it may run on: a vLLM-CPU worker pinned to its cores), a thread walking
ahead takes its CPU from the forward pass, and pages walked ahead of a short
run are work no store needed: measured on a fleet engine pinned to one core,
the worker's walk was 7 % of its time and kvsdk's whole cost there. There the
walk is *inline*: :meth:`Prefault.reached` commits, on the caller's thread and
in one batch, just the pages the stores are about to write, which costs less
than the page faults of the copy itself and nothing ahead of use.

The first :data:`START_BYTES` of a tier are committed when the tier is set up,
on the calling thread: at an engine's start, before it serves, as vLLM
commits its own KV cache. A walk or a fault during serving takes its CPU from
requests; on a fleet engine with one core that was the largest share of what
kvsdk cost a run on fresh engines. The rest is walked as stores approach it.

The walk keeps :data:`AHEAD_BYTES` past the furthest byte stores have reached
(:meth:`Prefault.reached`; a host tier hands out its never-used slots lowest
first), not the whole tier at start. Measured on vLLM-CPU (2 cores, the
engine's threads on both, a 1 GiB tier): walking all of it at once took the
two processes 3.25 s after the engine started, into its first requests, and
there kvsdk's time to first token stood 17 % above a connector that moves
nothing; a tier that is never filled paid for pages it never used. Walked
ahead of use, the work is the pages stores will touch, spread over the time
they fill them. It goes in 2 MiB steps through ``ctypes`` (which releases the
GIL), so each step holds the process's memory-map lock briefly: an engine
thread that maps or unmaps memory (a large allocation) waits no longer than
that behind the walk.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""``<linux/mman.h>``; Python's ``mmap`` module names it from 3.12 on."""
STEP_BYTES = 2 << 20
AHEAD_BYTES = 256 << 20
"""How far past the stores the walk keeps pages committed."""
START_BYTES = 1 << 30
"""How much of a tier its set-up commits before serving (about 0.7 s of one
core per GiB for the process that allocates, 0.25 s for each that maps)."""


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` (None where there is none to call)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _page_down(addr: int) -> int:
    return addr // mmap.PAGESIZE * mmap.PAGESIZE


def _page_up(addr: int) -> int:
    return -(-addr // mmap.PAGESIZE) * mmap.PAGESIZE


def populate(addr: int, nbytes: int) -> bool:
    """Fault in ``[addr, addr + nbytes)`` (shrunk to whole pages) writable, without
    writing to it; False where the kernel cannot (the pages then fault on use)."""
    start, stop = _page_up(addr), _page_down(addr + nbytes)
    madvise = _madvise()
    if madvise is None:
        return False
    for at in range(start, stop, STEP_BYTES):
        if madvise(at, min(STEP_BYTES, stop - at), MADV_POPULATE_WRITE) != 0:
            return False
    return True


class Prefault:
    """Commits ``[addr, addr + nbytes)`` (whole pages) on a daemon thread, ``ahead``
    bytes past the furthest offset :meth:`reached` was told of. ``keepalive``
    (the mapping or tensor that owns the memory) is held while a step runs, so
    the memory cannot be unmapped under it; once it is gone the thread ends.

    ``inline=True``: no thread and nothing ahead; :meth:`reached` commits the
    pages up to the offset it is told of, on the caller's thread, before the
    caller's stores write them (see the module's docstring for when).
    ``start``: bytes from the start committed before the constructor returns."""

    def __init__(
        self,
        addr: int,
        nbytes: int,
        keepalive: object,
        what: str,
        *,
        ahead: int | None = None,
        inline: bool = False,
        start: int = 0,
    ) -> None:
        self.what = what
        self.inline = inline
        self.ahead = 0 if inline else AHEAD_BYTES if ahead is None else ahead
        self._base = addr
        self._lo = _page_up(addr)
        self._hi = max(self._lo, _page_down(addr + nbytes))
        self._committed = self._lo
        """Absolute address the walk has committed up to (from the first whole page)."""
        self._target = self._lo
        self._cond = threading.Condition()
        self._owner = weakref.ref(keepalive)
        self.thread: threading.Thread | None = None
        if start > 0:
            first = min(self._hi, _page_up(self._lo + start))
            if populate(self._lo, first - self._lo):
                self._committed = self._target = first
            else:  # the kernel cannot: the pages fault in as the stores write them
                self._committed = self._target = self._hi
        if inline or self.done:
            return
        self.reached(0)
        self.thread = threading.Thread(target=self._run, name="kvsdk-prefault", daemon=True)
        self.thread.start()

    @property
    def done(self) -> bool:
        return self._committed >= self._hi

    @property
    def committed_bytes(self) -> int:
        return self._committed - self._lo

    def reached(self, offset: int) -> None:
        """Stores have reached byte ``offset`` of the memory: commit ``ahead`` past it."""
        want = min(self._hi, _page_up(self._base + offset + self.ahead))
        if want <= self._target:  # the common case, without the lock
            return
        if self.inline:
            self._target = want
            if self._owner() is not None and populate(self._committed, want - self._committed):
                self._committed = want
            else:  # the pages fault in as the stores write them
                self._committed = self._target = self._hi
            return
        with self._cond:
            if want > self._target:
                self._target = want
                self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self) -> None:
        started = time.perf_counter()
        while not self.done:
            with self._cond:
                while self._target <= self._committed:
                    if not self._cond.wait(timeout=5.0) and self._owner() is None:
                        return
                target = self._target
            owner = self._owner()
            if owner is None:
                return
            ok = populate(self._committed, target - self._committed)
            del owner
            if not ok:
                log.debug(
                    "kvsdk: %s: could not prefault (the kernel lacks MADV_POPULATE_WRITE)",
                    self.what,
                )
                return
            self._committed = target
        log.debug(
            "kvsdk: %s: %.2f GiB committed, the last step %.2f s after the start",
            self.what,
            (self._hi - self._lo) / 2**30,
            time.perf_counter() - started,
        )
