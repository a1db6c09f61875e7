"""Store back-pressure: a slower tier that keeps refusing writes is offered
none for a while, instead of being handed copies it throws away.

:class:`~kvsdk.store.chain.TierChain` reports the outcome of every write
batch it sends a tier (``written``). A batch *fails* when the call raised or
the tier took none of its keys: a full disk (``ENOSPC``), a Redis out of
memory under ``noeviction`` or read-only, a Mooncake store answering -200.
After ``after_failures`` failed batches in a row the tier's stores pause for
``initial_s``; the first batch offered once a pause ends is a probe: if it
fails, the tier pauses again for twice as long, up to ``max_s``; a batch the
tier takes any key of ends the back-off (the streak and the delay start
over). While a tier is paused the chain skips it (``accepts``) and counts
the chunks not offered; reads, lookups and deletes go on as before.

Metrics: ``kvsdk_store_backoffs_total{tier}`` (pauses begun),
``kvsdk_store_backoff_skipped_total{tier}`` (chunks not offered), and the
gauge ``kvsdk_store_paused{tier}`` (1 while paused). Thread-safe: writes run
on I/O threads, gauges are read by the exporter's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvsdk.config import StoreBackoffConfig
from kvsdk.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class _Tier:
    streak: int = 0
    """Failed batches in a row."""
    delay: float = 0.0
    """The last pause's length (0: not backing off)."""
    until: float = 0.0
    """Stores are not offered before this time."""


class StoreBackoff:
    """Per numbered tier, whether its stores are paused (see the module docstring)."""

    def __init__(
        self,
        names: dict[int, str],
        config: StoreBackoffConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``names``: each tier's number and name (for the log line)."""
        self.config = config
        self.metrics = metrics
        self._names = dict(names)
        self._clock = clock
        self._tiers = {t: _Tier() for t in names}
        self._lock = threading.Lock()

    def accepts(self, t: int) -> bool:
        """Whether tier ``t`` is offered stores now."""
        s = self._tiers[t]
        return s.until <= 0.0 or self._clock() >= s.until

    def skipped(self, t: int, n: int) -> None:
        """``n`` chunks were not offered to paused tier ``t``."""
        if n:
            self.metrics.inc("kvsdk_store_backoff_skipped_total", n, tier=t)

    def written(self, t: int, ok: bool) -> None:
        """Tier ``t`` took some of a batch (``ok``), or raised / took none of it."""
        s = self._tiers[t]
        if ok:
            if s.streak or s.delay:
                with self._lock:
                    resumed = s.delay > 0
                    s.streak, s.delay, s.until = 0, 0.0, 0.0
                if resumed:
                    log.warning("kvsdk: tier %d (%s) takes stores again", t, self._names[t])
            return
        cfg = self.config
        if not cfg.after_failures:
            return
        with self._lock:
            s.streak += 1
            if s.delay == 0.0 and s.streak < cfg.after_failures:
                return
            if s.delay and self._clock() < s.until:
                return  # a batch sent before the pause began: the pause stands
            s.delay = cfg.initial_s if s.delay == 0.0 else min(cfg.max_s, 2 * s.delay)
            s.until = self._clock() + s.delay
            delay, streak = s.delay, s.streak
        self.metrics.inc("kvsdk_store_backoffs_total", tier=t)
        log.warning(
            "kvsdk: tier %d (%s) refused %d write batch(es) in a row: no stores offered to "
            "it for %.1f s (reads go on)",
            t,
            self._names[t],
            streak,
            delay,
        )

    def paused(self) -> list[int]:
        """The tiers whose stores are paused now."""
        return [t for t in self._tiers if not self.accepts(t)]

    def gauges(self) -> Iterator[tuple[str, dict[str, Any], float]]:
        """``kvsdk_store_paused{tier}`` of every tier (a gauge source)."""
        for t in self._tiers:
            yield "kvsdk_store_paused", {"tier": t}, 0.0 if self.accepts(t) else 1.0
