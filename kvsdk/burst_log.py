"""Log a failure once per burst, not once per key."""

from __future__ import annotations

import logging
import threading
import time


class BurstLog:
    """Log each failure kind at most once per ``interval`` seconds, with a count
    of the reports suppressed since the last one."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self._interval) < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            n = self._suppressed.pop(kind, 0)
        self._log.warning(msg + (f" (+{n} more since last report)" if n else ""), *args)
