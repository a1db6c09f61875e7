"""What kvsdk's vLLM connector sends between its processes and to vLLM's
metrics: step metadata (scheduler → workers), handshakes and step reports
(workers → scheduler), connector stats and their Prometheus counters."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvsdk.metrics import COUNTERS
from kvsdk.transfer import TransferJob

if TYPE_CHECKING:
    pass

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler


@dataclass
class KVSDKConnectorMetadata(KVConnectorMetadata):
    loads: dict[int, tuple[str, TransferJob]] = field(default_factory=dict)
    """job id → (request id, job)"""
    stores: list[TransferJob] = field(default_factory=list)
    store_requests: list[str] = field(default_factory=list)
    """The request of each store job."""
    flush: frozenset[int] = frozenset()
    sync_loads: bool = False
    """The loads are done before this step's forward pass: vLLM scheduled their
    requests in this step (they are never reported in ``finished_recving``)."""
    release: frozenset[str] = frozenset()
    """Finished requests whose blocks vLLM holds for kvsdk (``request_finished``
    returned True) and whose last stores are in this step: each worker reports
    one as sent once its stores of that request are done; vLLM frees the
    blocks when every worker has."""


@dataclass
class KVSDKHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side once at start-up."""

    machine: str
    region: int
    error: str | None = None


def machine_id() -> str:
    """This machine's boot id (processes on one machine share it)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


@dataclass
class KVSDKWorkerMetadata(KVConnectorWorkerMetadata):
    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    load_bytes: int = 0
    store_bytes: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVSDKWorkerMetadata)
        out = KVSDKWorkerMetadata(dict(self.completed), dict(self.failed))
        for src, dst in ((other.completed, out.completed), (other.failed, out.failed)):
            for j, n in src.items():
                dst[j] = dst.get(j, 0) + n
        out.load_bytes = self.load_bytes + other.load_bytes
        out.store_bytes = self.store_bytes + other.store_bytes
        out.load_seconds = self.load_seconds + other.load_seconds
        out.store_seconds = self.store_seconds + other.store_seconds
        return out


@dataclass
class KVSDKConnectorStats(KVConnectorStats):
    """Counter deltas since the last report (summed when aggregated)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KVSDKPromMetrics(KVConnectorPromMetrics):
    """kvsdk's counters on vLLM's own Prometheus endpoint (``vllm:kvsdk_*``),
    labelled with vLLM's engine labels plus ``detail`` (e.g. ``tier=1``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:{name.removesuffix('_total')}",
                documentation=doc,
                labelnames=[*labelnames, "detail"],
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        for key, value in transfer_stats_data.items():
            name, _, rest = key.partition("{")
            counter = self._counters.get(name)
            if counter is not None and value > 0:
                counter.labels(*engine, rest.rstrip("}")).inc(value)  # type: ignore[union-attr]
