"""Committing the host tier's memory before the first store needs it.

A store into a page of the host tier that no process has touched yet pays a
page fault: the kernel allocates and zeroes the page, then maps it. Measured
on this project's 2-core VM (``benchmarks/bench_slab_prefault.py``), copying
512 KiB slots into fresh shared-memory pages ran at about 1 GiB/s, into
touched ones at 10-20 GiB/s; a second process mapping pages that exist paid
another 0.35-0.8 s/GiB in faults. At low reuse nearly every store lands in
pages never touched until the tier is full, so the faults, not the copy, were
the store's cost.

:func:`start_prefault` walks a mapping on a daemon thread with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later): pages are allocated
(by the first process) and mapped writable (in each), nothing is written, so
it is safe beside stores already running. It goes in 64 MiB steps through
``ctypes``, which releases the GIL, so the engine's threads keep going. Where
the kernel lacks it the walk stops at once and the tier faults pages in as it
goes, as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""``<linux/mman.h>``; Python's ``mmap`` module names it from 3.12 on."""
STEP_BYTES = 64 << 20


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


def populate(addr: int, nbytes: int) -> bool:
    """Fault in ``[addr, addr + nbytes)`` (shrunk to whole pages) writable, without
    writing to it; False where the kernel cannot (the pages then fault on use)."""
    page = mmap.PAGESIZE
    start = -(-addr // page) * page
    stop = (addr + nbytes) // page * page
    madvise = _madvise()
    if madvise is None:
        return False
    for at in range(start, stop, STEP_BYTES):
        if madvise(at, min(STEP_BYTES, stop - at), MADV_POPULATE_WRITE) != 0:
            return False
    return True


def start_prefault(addr: int, nbytes: int, keepalive: object, what: str) -> threading.Thread:
    """:func:`populate` on a daemon thread. ``keepalive`` (the mapping or tensor
    that owns the memory) is held until it is done, so the memory cannot be
    unmapped under it."""

    def run() -> None:
        started = time.perf_counter()
        done = populate(addr, nbytes)
        log.debug(
            "kvsdk: %s: %s %.2f GiB in %.2f s",
            what,
            "prefaulted" if done else "could not prefault (the kernel lacks MADV_POPULATE_WRITE)",
            nbytes / 2**30,
            time.perf_counter() - started,
        )
        del holder[:]

    holder = [keepalive]
    t = threading.Thread(target=run, name="kvsdk-prefault", daemon=True)
    t.start()
    return t
