"""``KVSDKConnector``: kvsdk as a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Scheduler side: vLLM's requests, blocks and step outputs → kvsdk's
:class:`~kvsdk.scheduler.OffloadScheduler`. Worker side: vLLM's paged KV
tensors ↔ the host tier's slab through a kvsdk transfer worker. On vLLM-CPU
loads are synchronous (done before the forward pass of the step that schedules
the request, see :func:`~kvsdk.plugins.vllm.scheduler_side.loads_in_step`);
elsewhere asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS`` until
its load lands). Stores are submitted after the forward pass; blocks about to
be reused are flushed first (``handle_preemptions``).

Worker call order: vLLM 0.32 calls ``wait_for_save`` before ``get_finished``;
0.33's model runner V2 with a drafter calls ``get_finished`` first and
``wait_for_save`` after the drafter ran. Either is right: the step's stores are
counted per request in ``start_load_kv`` (before both), so a finished request
is released only once its stores, submitted in either order, are done.

Sleep mode is refused (see :mod:`kvsdk.plugins.vllm.sleep_mode`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvsdk.config import ConfigError
from kvsdk.plugins.vllm import vllm_version_problem
from kvsdk.plugins.vllm.layout import EngineLayout, engine_layout
from kvsdk.plugins.vllm.messages import (
    KVSDKConnectorMetadata,
    KVSDKConnectorStats,
    KVSDKPromMetrics,
    KVSDKWorkerMetadata,
)
from kvsdk.plugins.vllm.scheduler_side import SchedulerSide, recompute_failed_loads
from kvsdk.plugins.vllm.sleep_mode import sleep_mode_problem
from kvsdk.plugins.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler

__all__ = ["KVSDKConnector", "KVSDKConnectorMetadata", "KVSDKWorkerMetadata"]


class KVSDKConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if (problem := sleep_mode_problem(vllm_config)) is not None:
            raise ConfigError(problem)  # vLLM 0.32 does not ask supports_sleep_mode
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # also where vLLM's general plugins are off and kvsdk came by module path
            if (problem := vllm_version_problem(vllm.__version__)) is not None:
                raise ConfigError(problem)
            self.layout: EngineLayout = engine_layout(vllm_config, kv_cache_config, announce=True)
            recompute_failed_loads(vllm_config)
            self._sched = SchedulerSide(self.layout, vllm_config)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            pp_rank, tp_rank = get_pp_group().rank_in_group, get_tp_group().rank_in_group
            self.layout = engine_layout(vllm_config, kv_cache_config, pp_rank=pp_rank)
            self._worker = WorkerSide(self.layout, pp_rank, tp_rank)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM 0.33 refuses sleep mode with kvsdk): see :mod:`~kvsdk.plugins.vllm.sleep_mode`."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler side ----------------------------------------------------------------
    @property
    def sched(self) -> SchedulerSide:
        assert self._sched is not None
        return self._sched

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.sched.check_workers(metadata)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.sched.take_events()

    def has_pending_push_work(self) -> bool:
        return self.sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        self.sched.reset()
        return True

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is None:
            return None
        return self._sched.stats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVSDKPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVSDKConnectorStats(data=dict(data or {}))

    # -- worker side ----------------------------------------------------------------------
    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVSDKConnectorMetadata)
        self.worker.flush(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSDKConnectorMetadata)
        self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSDKConnectorMetadata)
        self.worker.submit_stores(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving = self.worker.poll()
        return self.worker.take_released(), recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
