"""Whether each slower tier is up: one log line when it goes down, one when it is back.

:class:`~kvsdk.store.chain.TierChain` reports every call's outcome here. The
first failure of a tier that was up logs, once::

    kvsdk: tier 1 (redis) down: exists: 1 failure(s) absorbed by the tier (its warning names the cause)

Further failures are only counted (the per-burst warnings say the rest).
The tier is back when an operation that failed while it was down succeeds
again, with no new failure, while the tier is not skipping calls (a Redis
circuit breaker that answers misses without asking the server says nothing
about the server): that logs, once::

    kvsdk: tier 1 (redis) back up after 4 failures: failing for 1.2 s, answering 2.3 s after the first failure

"failing for" runs from the first failure to the last one: how long the tier
was seen down. The success comes later by the breaker's backoff and the
engine's next call, so "answering" is an upper bound, never the outage itself.

A tier whose writes fail while its reads still work (a disk that became
read-only) stays down until a write succeeds: reads do not bring it back.
Both lines are WARNING, so they show under an engine's default log level.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Outage:
    since: float
    failures: int
    last: float = 0.0
    """When the last failure was seen."""
    ops: set[str] = field(default_factory=set)
    """The operations that failed while down: one of them succeeding brings it back."""


class TierHealth:
    """Down / back-up state of numbered tiers (thread-safe)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._down: dict[int, _Outage] = {}
        self._lock = threading.Lock()

    def is_down(self, t: int) -> bool:
        with self._lock:
            return t in self._down

    def failed(self, t: int, name: str, op: str, failures: int, reason: str) -> None:
        """Tier ``t`` (``name``) failed ``failures`` times in operation ``op``."""
        with self._lock:
            outage = self._down.get(t)
            went_down = outage is None
            if outage is None:
                outage = self._down[t] = _Outage(time.monotonic(), 0)
            outage.failures += max(1, failures)
            outage.last = time.monotonic()
            outage.ops.add(op)
        if went_down:
            self._log.warning("kvsdk: tier %d (%s) down: %s", t, name, reason)

    def succeeded(self, t: int, name: str, op: str, available: bool) -> None:
        """Tier ``t`` answered ``op`` without a failure; ``available``: it is not
        skipping calls (its answer came from the medium itself)."""
        if t not in self._down:  # (unlocked fast path: a dict lookup)
            return
        with self._lock:
            outage = self._down.get(t)
            if outage is None or not available or op not in outage.ops:
                return
            del self._down[t]
        self._log.warning(
            "kvsdk: tier %d (%s) back up after %d failures: failing for %.1f s, answering "
            "%.1f s after the first failure",
            t,
            name,
            outage.failures,
            outage.last - outage.since,
            time.monotonic() - outage.since,
        )
