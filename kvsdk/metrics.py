"""Counters and histograms for everything kvsdk does, with a snapshot API and
an optional Prometheus exporter.

Names follow Prometheus conventions (``_total`` counters, ``_bytes`` and
``_seconds`` units); labels are small fixed sets (tier, direction, result).
Recording is a dict update, cheap enough for every scheduler step.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Labels = tuple[tuple[str, str], ...]
GaugeSource = Callable[[], Iterable[tuple[str, dict[str, Any], float]]]
"""Yields ``(name, labels, value)`` of gauges read when they are collected."""

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(1 << s) for s in range(12, 34, 2))

COUNTERS = {
    "kvsdk_lookup_hits_total": "Chunk lookups answered HIT, by tier",
    "kvsdk_lookup_misses_total": "Chunk lookups answered MISS",
    "kvsdk_lookup_deferred_total": "Chunk lookups answered HIT_PENDING or RETRY",
    "kvsdk_lookup_index_misses_total": "Chunk lookups a slower tier's local index answered MISS",
    "kvsdk_lookup_waits_total": "Waits for slower tiers' lookups within a step, by outcome",
    "kvsdk_promotion_waits_total": "Waits within a step for promotions a request can hit",
    "kvsdk_hit_tokens_total": "Tokens loaded from kvsdk (the part of each hit the engine took)",
    "kvsdk_pd_handoffs_total": "P/D hand-offs decode requests carried, by outcome",
    "kvsdk_stored_bytes_total": "Bytes stored, by tier",
    "kvsdk_loaded_bytes_total": "Bytes loaded into the engine or promoted, by tier",
    "kvsdk_allocation_failures_total": "Stores refused for lack of room",
    "kvsdk_admission_skipped_total": "Chunks not stored on their first sight (no reuse seen)",
    "kvsdk_evictions_total": "Chunks evicted, by tier",
    "kvsdk_backend_errors_total": "Backend failures degraded to misses, by tier",
    "kvsdk_corrupt_chunks_total": "Chunks that failed integrity checks, by tier",
    "kvsdk_failed_jobs_total": "Transfer jobs that failed, by direction",
    "kvsdk_dropped_writes_total": "Write-throughs dropped because the queue was full, by tier",
    "kvsdk_store_backoffs_total": "Pauses of a slower tier's stores after it refused writes, "
    "by tier",
    "kvsdk_store_backoff_skipped_total": "Chunks not offered to a slower tier while its stores "
    "were paused, by tier",
}
GAUGES = {
    "kvsdk_backend_stat": "A slower tier's own numbers as its stats() reports them "
    "(failed, skipped and paused operations, breakers open, entries, bytes), "
    "by tier, backend and stat",
    "kvsdk_store_paused": "1 while a slower tier's stores are paused (it refused writes), by tier",
    "kvsdk_tier_info": "1 per tier, its configuration as labels (tier, backend, medium, "
    "locality, capacity_bytes, chunk_bytes)",
}
GAUGE_MULTIPROCESS_MODES: dict[str, Literal["liveall", "livemax"]] = {
    "kvsdk_backend_stat": "liveall",
    "kvsdk_store_paused": "livemax",
    "kvsdk_tier_info": "livemax",
}
"""How each gauge combines across the processes that write it in Prometheus'
multiprocess mode (:class:`MultiprocessGauges`). Only the processes that own
a store write (vLLM's EngineCore, one per data-parallel rank), never the API
servers that read the directory, so ``--api-server-count N`` counts each value
once. ``liveall``: a tier's own numbers, one series per process (``pid``
label), since summing two engines' views of one shared tier would count its
entries twice; ``livemax``: 1 while any live engine has the tier paused / is
configured so. ``live``: a process that ended (``mark_process_dead``) drops out."""
HISTOGRAMS = {
    "kvsdk_transfer_seconds": ("Time of one transfer job, by direction", SECONDS_BUCKETS),
    "kvsdk_transfer_bytes": ("Bytes of one transfer job, by direction", BYTES_BUCKETS),
    "kvsdk_lookup_delay_seconds": ("Planner time (sync) or deferral time (async)", SECONDS_BUCKETS),
    "kvsdk_backend_seconds": ("Time of one batched backend call, by tier and op", SECONDS_BUCKETS),
    "kvsdk_promotion_seconds": (
        "Time from a lookup asking the slower tiers to the chunk readable in host RAM, by tier",
        SECONDS_BUCKETS,
    ),
}


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def observe_many(self, values: Iterable[float]) -> None:
        """``observe`` of each value, without a call per value."""
        where, buckets, counts = bisect.bisect_left, self.buckets, self.counts
        n, total = self.n, self.total
        for v in values:
            counts[where(buckets, v)] += 1
            total += v
            n += 1
        self.n, self.total = n, total


def _labels(labels: dict[str, Any]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _format_name(name: str, labels: Labels) -> str:
    inner = ",".join(f"{k}={v}" for k, v in labels)
    return f"{name}{{{inner}}}" if inner else name


class Metrics:
    """Thread-safe registry of kvsdk's counters and histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = {}
        self._hists: dict[tuple[str, Labels], Histogram] = {}
        self.version = 0
        """Bumped by every update: a reader can skip work when nothing changed."""
        self.counter_version = 0
        """Bumped by every counter update."""
        self._names: dict[tuple[str, Labels], str] = {}
        self._keys: dict[tuple[Any, ...], tuple[str, Labels]] = {}
        """``inc``'s call form -> its normalized key (labels sorted, values as text)."""
        self._gauge_sources: list[GaugeSource] = []

    def inc(self, name: str, value: float = 1.0, **labels: Any) -> None:
        raw = (name, *labels.items())
        key = self._keys.get(raw)
        if key is None:
            assert name in COUNTERS, name
            key = self._keys[raw] = (name, _labels(labels))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value
            self.version += 1
            self.counter_version += 1

    def observe(self, name: str, value: float, **labels: Any) -> None:
        key = (name, _labels(labels))
        with self._lock:
            h = self._hists.get(key)
            if h is None:
                h = self._hists[key] = Histogram(HISTOGRAMS[name][1])
            h.observe(value)
            self.version += 1

    def histogram(self, name: str, **labels: Any) -> BoundHistogram:
        """One histogram with its labels resolved once, for hot paths."""
        key = (name, _labels(labels))
        with self._lock:
            h = self._hists.get(key)
            if h is None:
                h = self._hists[key] = Histogram(HISTOGRAMS[name][1])
        return BoundHistogram(self, h)

    def counter(self, name: str, **labels: Any) -> float:
        """One counter's value; with no labels given, the sum over all label sets."""
        with self._lock:
            if labels:
                return self._counters.get((name, _labels(labels)), 0.0)
            return sum(v for (n, _), v in self._counters.items() if n == name)

    def counters(self) -> dict[str, float]:
        """``{"name{label=value,...}": value}`` of every counter (cheaper than
        ``snapshot``: no histograms, names formatted once)."""
        names = self._names
        with self._lock:
            items = list(self._counters.items())
        out = {}
        for key, v in items:
            name = names.get(key)
            if name is None:
                name = names[key] = _format_name(*key)
            out[name] = v
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy: ``{"counters": {...}, "histograms": {...}}`` keyed by
        ``name{label=value,...}``."""

        fmt = _format_name
        with self._lock:
            return {
                "counters": {fmt(n, lb): v for (n, lb), v in sorted(self._counters.items())},
                "histograms": {
                    fmt(n, lb): {
                        "count": h.n,
                        "sum": h.total,
                        "buckets": list(h.buckets),
                        "counts": list(h.counts),
                    }
                    for (n, lb), h in sorted(self._hists.items())
                },
            }

    def iter_counters(self) -> Iterator[tuple[str, Labels, float]]:
        with self._lock:
            items = list(self._counters.items())
        for (n, lb), v in items:
            yield n, lb, v

    def add_gauge_source(self, source: GaugeSource) -> None:
        """``source`` is read each time the gauges are collected (a scrape)."""
        with self._lock:
            self._gauge_sources.append(source)

    def remove_gauge_source(self, source: GaugeSource) -> None:
        with self._lock:
            if source in self._gauge_sources:
                self._gauge_sources.remove(source)

    def iter_gauges(self) -> Iterator[tuple[str, Labels, float]]:
        """Every source's gauges now; a source that fails is left out (logged)."""
        with self._lock:
            sources = list(self._gauge_sources)
        for source in sources:
            try:
                read = [(n, _labels(lb), float(v)) for n, lb, v in source()]
            except Exception as exc:
                log.warning("kvsdk metrics: a gauge source failed: %s", exc)
                continue
            for name, labels, value in read:
                assert name in GAUGES, name
                yield name, labels, value

    def iter_histograms(self) -> Iterator[tuple[str, Labels, Histogram]]:
        with self._lock:
            items = [
                (k, Histogram(h.buckets, list(h.counts), h.total, h.n))
                for k, h in self._hists.items()
            ]
        for (n, lb), h in items:
            yield n, lb, h


class BoundHistogram:
    __slots__ = ("_hist", "_metrics")

    def __init__(self, metrics: Metrics, hist: Histogram) -> None:
        self._metrics = metrics
        self._hist = hist

    def observe(self, value: float) -> None:
        m = self._metrics
        with m._lock:
            self._hist.observe(value)
            m.version += 1

    def observe_many(self, values: Iterable[float]) -> None:
        """``observe`` of each value, under one lock."""
        m = self._metrics
        with m._lock:
            self._hist.observe_many(values)
            m.version += 1


def start_prometheus_exporter(metrics: Metrics, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``metrics`` at ``http://addr:port/metrics`` (needs ``prometheus-client``)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    class _Collector:
        def collect(self) -> Iterator[Any]:
            fams: dict[str, Any] = {}
            for name, labels, value in metrics.iter_counters():
                fam = fams.get(name)
                if fam is None:
                    fam = fams[name] = CounterMetricFamily(
                        name.removesuffix("_total"), COUNTERS[name], labels=[k for k, _ in labels]
                    )
                fam.add_metric([v for _, v in labels], value)
            for name, labels, value in metrics.iter_gauges():
                key = f"g:{name}"
                gfam = fams.get(key)
                if gfam is None:
                    gfam = fams[key] = GaugeMetricFamily(
                        name, GAUGES[name], labels=[k for k, _ in labels]
                    )
                gfam.add_metric([v for _, v in labels], value)
            for name, labels, h in metrics.iter_histograms():
                key = f"h:{name}:{','.join(k for k, _ in labels)}"
                hfam = fams.get(key)
                if hfam is None:
                    hfam = fams[key] = HistogramMetricFamily(
                        name, HISTOGRAMS[name][0], labels=[k for k, _ in labels]
                    )
                cum, buckets = 0, []
                for bound, c in zip([*map(str, h.buckets), "+Inf"], h.counts):
                    cum += c
                    buckets.append((bound, cum))
                hfam.add_metric([v for _, v in labels], buckets, h.total)
            yield from fams.values()

    registry = CollectorRegistry()
    registry.register(_Collector())
    return start_http_server(port, addr=addr, registry=registry)


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Prometheus' multiprocess directory (vLLM sets it for ``--api-server-count`` > 1)."""


class MultiprocessGauges:
    """Publishes ``metrics``' gauges into Prometheus' multiprocess directory
    (``PROMETHEUS_MULTIPROC_DIR``), where every process serving ``/metrics``
    from it (vLLM's API servers) reads them, each gauge combined across the
    writing processes as :data:`GAUGE_MULTIPROCESS_MODES` says.

    Gauges are read from their sources (``Metrics.add_gauge_source``) every
    ``interval_s`` on a daemon thread (``start``), or by ``publish()``;
    ``stop()`` ends the thread and marks this process's live gauges dead.
    The variable must be set before ``prometheus_client`` is first imported
    in the process (it picks its value store then), as vLLM does."""

    def __init__(self, metrics: Metrics, interval_s: float = 1.0) -> None:
        from prometheus_client import values

        if values.ValueClass is values.MutexValue:
            raise RuntimeError(
                f"{MULTIPROC_DIR_ENV} was not set when prometheus_client was imported"
            )
        self.metrics = metrics
        self.interval_s = interval_s
        self._gauges: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self) -> None:
        """Write every gauge's current value once."""
        from prometheus_client import Gauge

        for name, labels, value in self.metrics.iter_gauges():
            names = [k for k, _ in labels]
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(
                    name,
                    GAUGES[name],
                    labelnames=names,
                    multiprocess_mode=GAUGE_MULTIPROCESS_MODES[name],
                    registry=None,  # read from the directory, not this process's registry
                )
            if list(gauge._labelnames) != names:
                continue  # (a source's labels are fixed per gauge)
            gauge.labels(*[v for _, v in labels]).set(value)

    def start(self) -> MultiprocessGauges:
        self.publish()
        self._thread = threading.Thread(
            target=self._run, name="kvsdk-multiproc-gauges", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception as exc:  # never take the engine down for a metric
                log.warning("kvsdk metrics: publishing gauges failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        from prometheus_client import multiprocess

        path = os.environ.get(MULTIPROC_DIR_ENV)
        if path:
            multiprocess.mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]


def multiprocess_gauges(metrics: Metrics) -> MultiprocessGauges | None:
    """Started :class:`MultiprocessGauges` for ``metrics`` when
    ``PROMETHEUS_MULTIPROC_DIR`` is set and ``prometheus_client`` is installed
    (a failure to start is logged, never raised); else None."""
    if not os.environ.get(MULTIPROC_DIR_ENV):
        return None
    try:
        return MultiprocessGauges(metrics).start()
    except Exception as exc:
        log.warning("kvsdk metrics: gauges not published to %s: %s", MULTIPROC_DIR_ENV, exc)
        return None
