"""A circuit breaker for a backend's server: after each failure the server is
skipped for a backoff that doubles up to a cap; a success resets it."""

from __future__ import annotations

import threading
import time


class Breaker:
    """Skip a server for a growing backoff after each failure (thread-safe)."""

    def __init__(self, initial: float, cap: float) -> None:
        self._initial = initial
        self._cap = cap
        self._backoff = initial
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    def failed(self) -> float:
        with self._lock:
            pause = self._backoff
            self._open_until = time.monotonic() + pause
            self._backoff = min(self._cap, self._backoff * 2)
            return pause

    def succeeded(self) -> None:
        if self._backoff != self._initial:
            with self._lock:
                self._backoff = self._initial
