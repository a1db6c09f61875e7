"""Reads with a deadline: the disk tier's file reads run on a fixed set of
threads of its own, and the caller waits for each at most ``timeout`` seconds.

A read on a hung file system (an NFS server gone, a dying disk) can block in
the kernel for minutes, and no thread can be interrupted there. So the I/O
threads of the tiered store never make the system calls themselves: they hand
the read to one of ``workers`` daemon threads and wait with a timeout. A read
that misses its deadline is the caller's miss (:data:`TIMED_OUT`); its worker
stays blocked until the OS returns, then finds its :class:`Handoff` abandoned
and writes nothing anywhere the caller could see. Workers never grow in
number: while ``workers`` reads are past their deadline and still blocked, the
tier is stalled and every further read is an immediate miss
(:data:`STALLED`) without a system call, until one of them returns.

A read that writes into a caller's buffer (a host-tier slot) must never
write after the caller gave up (the slot may hold another chunk by then), so
workers read into a buffer of their own and copy into the caller's only
under :meth:`Handoff.deliver`, which the caller's abandonment excludes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")


class _Outcome:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMED_OUT = _Outcome("TIMED_OUT")
"""The read did not finish within its deadline (its worker may still be blocked)."""
STALLED = _Outcome("STALLED")
"""Every worker is blocked in a read past its deadline: not even attempted."""


class Handoff:
    """Between one read and its caller: whether the caller still waits, and the
    caller's buffers (``target``), which only :meth:`deliver` hands out. When
    the caller gives up the handoff drops them, so a blocked worker holds no
    reference to caller memory (a shared-memory slab can still be closed)."""

    __slots__ = ("_abandoned", "_lock", "_target")

    def __init__(self, target: Any = None) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._target = target

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> None:
        """The caller gives up; returns once no :meth:`deliver` is running."""
        with self._lock:
            self._abandoned = True
            self._target = None

    def deliver(self, write: Callable[[Any], None]) -> bool:
        """Run ``write(target)`` (copy into the caller's buffers) unless the caller
        gave up; True when it ran. A copy in memory, never a system call, runs here."""
        with self._lock:
            if self._abandoned:
                return False
            write(self._target)
            return True


class _Task(Generic[_T]):
    __slots__ = ("fn", "future", "handoff")

    def __init__(self, fn: Callable[[Handoff], _T], target: Any) -> None:
        self.fn = fn
        self.handoff = Handoff(target)
        self.future: Future[_T] = Future()


class DeadlineReader:
    """``workers`` daemon threads running reads; :meth:`run` waits ``timeout`` s."""

    def __init__(self, workers: int, timeout: float, name: str = "kvsdk-disk-read") -> None:
        if workers < 1 or timeout <= 0:
            raise ValueError("a deadline reader needs at least one worker and a positive timeout")
        self.workers = workers
        self.timeout = timeout
        self._tasks: queue.SimpleQueue[_Task[object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._late = 0  # reads past their deadline whose worker has not returned
        self._closed = False
        self._name = name
        self._threads: list[threading.Thread] = []  # started with the first read

    @property
    def late(self) -> int:
        """Reads past their deadline still blocked in a worker now."""
        with self._lock:
            return self._late

    def run(
        self, fn: Callable[[Handoff], _T], target: Any = None, timeout: float | None = None
    ) -> _T | _Outcome:
        """``fn(handoff)`` on a worker; its result, or :data:`TIMED_OUT` /
        :data:`STALLED`. ``fn`` should check ``handoff.abandoned`` before it
        starts (a read queued past its deadline is not made at all) and reach
        the caller's buffers ``target`` only through ``handoff.deliver``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("deadline reader closed")
            if self._late >= self.workers:
                return STALLED
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                    for i in range(self.workers)
                ]
                for t in self._threads:
                    t.start()
        task: _Task[_T] = _Task(fn, target)
        self._tasks.put(task)  # type: ignore[arg-type]
        try:
            return task.future.result(self.timeout if timeout is None else max(0.0, timeout))
        except FutureTimeout:
            task.handoff.abandon()
            with self._lock:
                self._late += 1
            task.future.add_done_callback(self._returned)  # at once if done meanwhile
            return TIMED_OUT

    def _returned(self, _future: Future[_T]) -> None:
        with self._lock:
            self._late -= 1

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                task.future.set_result(task.fn(task.handoff))
            except BaseException as exc:  # the caller sees it (or nobody, if it left)
                task.future.set_exception(exc)

    def close(self) -> None:
        """Stop the idle workers; blocked ones are daemon threads and never joined."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
