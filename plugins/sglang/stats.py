"""Transfer accounting for the SGLang storage level: kvsdk's transfer and
failure metrics, and the per-batch pages and bandwidth that SGLang's
``get_stats`` reports (its ``StorageMetrics``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvsdk.burst_log import BurstLog
from kvsdk.metrics import Metrics


class TransferStats:
    """Counts each batch moved (or failed) into ``metrics``, and keeps SGLang's
    per-batch statistics until :meth:`take` drains them."""

    def __init__(self, metrics: Metrics, logger: logging.Logger) -> None:
        self.metrics = metrics
        self._burst = BurstLog(logger)
        self._lock = threading.Lock()
        self._sglang: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []
        }  # fmt: skip

    def observe(
        self, direction: str, pages: int, page_bytes: int, start: float, sglang: bool
    ) -> None:
        """A batch of ``pages`` moved in ``direction`` (``load`` / ``store``) since
        ``start``; ``sglang``: also kept for SGLang's ``get_stats``."""
        seconds = time.perf_counter() - start
        nbytes = pages * page_bytes
        self.metrics.observe("kvsdk_transfer_seconds", seconds, direction=direction)
        self.metrics.observe("kvsdk_transfer_bytes", float(nbytes), direction=direction)
        if sglang and pages:
            key = "prefetch" if direction == "load" else "backup"
            with self._lock:
                self._sglang[f"{key}_pgs"].append(pages)
                self._sglang[f"{key}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def failure(self, op: str, exc: BaseException) -> None:
        """A batch ``op`` failed: counted, logged once per burst (its pages are misses)."""
        self.metrics.inc("kvsdk_failed_jobs_total", direction=op)
        self._burst.warning(
            f"batch-{op}", "kvsdk storage: %s failed, treated as misses: %r", op, exc
        )

    def take(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None without SGLang's class)."""
        with self._lock:
            snap = {k: list(v) for k, v in self._sglang.items()}
            for v in self._sglang.values():
                v.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        stats = StorageMetrics()
        stats.prefetch_pgs.extend(int(v) for v in snap["prefetch_pgs"])
        stats.backup_pgs.extend(int(v) for v in snap["backup_pgs"])
        stats.prefetch_bandwidth.extend(snap["prefetch_bandwidth"])
        stats.backup_bandwidth.extend(snap["backup_bandwidth"])
        return stats
