"""``KVSDKConnector``: kvsdk as a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Scheduler side: vLLM's requests, blocks and step outputs → kvsdk's
:class:`~kvsdk.scheduler.OffloadScheduler`. Worker side: vLLM's paged KV
tensors ↔ the host tier's slab through a kvsdk transfer worker. Loads are
asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS`` until its load
lands); stores are submitted after the forward pass; blocks about to be
reused are flushed first (``handle_preemptions``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
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
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from kvsdk import plugins_manager
from kvsdk.backend import SlabRequest
from kvsdk.config import ConfigError
from kvsdk.events import EventKind, EventOrigin, KVEvent
from kvsdk.metrics import COUNTERS
from kvsdk.plugins.vllm.layout import EngineLayout, engine_layout
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.slab import SharedSlab, SlabError
from kvsdk.store.factory import StoreHandle
from kvsdk.transfer import Direction, GroupLayers, TransferJob, TransferWorker
from kvsdk.types import Locality

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler

IDLE_IO_WAIT_SECONDS = 0.002
"""Longest a step with nothing scheduled waits for kvsdk's tier I/O (a request
arriving meanwhile is scheduled at most this much later)."""


@dataclass
class KVSDKConnectorMetadata(KVConnectorMetadata):
    loads: dict[int, tuple[str, TransferJob]] = field(default_factory=dict)
    """job id → (request id, job)"""
    stores: list[TransferJob] = field(default_factory=list)
    store_requests: list[str] = field(default_factory=list)
    """The request of each store job."""
    flush: frozenset[int] = frozenset()
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


class KVSDKConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.layout: EngineLayout = engine_layout(vllm_config, kv_cache_config)
            _recompute_failed_loads(vllm_config)
            self._sched = _SchedulerSide(self.layout, vllm_config)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            pp_rank, tp_rank = get_pp_group().rank_in_group, get_tp_group().rank_in_group
            self.layout = engine_layout(vllm_config, kv_cache_config, pp_rank=pp_rank)
            self._worker = _WorkerSide(self.layout, pp_rank, tp_rank)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler side ----------------------------------------------------------------
    @property
    def sched(self) -> _SchedulerSide:
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
        return self.sched.request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request), None

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
    def worker(self) -> _WorkerSide:
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


def _has_event_sinks() -> bool:
    """Whether any installed plugin implements the ``kvsdk_publish_events`` hook."""
    return bool(plugins_manager.plugin_manager().hook.kvsdk_publish_events.get_hookimpls())


def _computed_at_finish(req: Request) -> int:
    """Tokens of a finished request whose KV the engine computed."""
    if req.status is RequestStatus.FINISHED_ABORTED:
        return int(req.num_computed_tokens)
    return max(req.num_prompt_tokens, req.num_tokens - 1)  # the last sampled token has none


def _recompute_failed_loads(vllm_config: Any) -> None:
    """A cache that fails to load is a miss: vLLM must recompute, not fail the
    request. vLLM reads this policy right after building the connector."""
    ktc = vllm_config.kv_transfer_config
    if ktc.kv_load_failure_policy != "recompute":
        log.warning(
            "kvsdk: kv_load_failure_policy %r -> 'recompute' (a failed load from a cache "
            "is a miss; the request is recomputed, never failed)",
            ktc.kv_load_failure_policy,
        )
        ktc.kv_load_failure_policy = "recompute"


class _SchedulerSide:
    def __init__(self, layout: EngineLayout, vllm_config: Any) -> None:
        self.layout = layout
        self.handle = StoreHandle(layout.config)  # starts and stops the store
        self.store = self.handle.build_store(
            layout.namespace,
            layout.chunk_bytes,
            slab=SlabRequest(layout.slab_name, layout.ranks.num_regions),
        )
        self.world_size = max(1, vllm_config.parallel_config.world_size)
        kv_events = getattr(vllm_config, "kv_events_config", None)
        if not (kv_events and kv_events.enable_kv_cache_events) and not _has_event_sinks():
            self.store.events.enabled = False  # nobody would read them: skip the bookkeeping
        self.core = OffloadScheduler(
            layout.groups,
            layout.namespace,
            self.store,
            tokens_per_hash=layout.tokens_per_hash,
            max_load_tokens=layout.config.max_load_tokens,
            num_workers=self.world_size,
            # model runner V2 zeroes new blocks and applies copy-on-write
            # before handle_preemptions: a flushed store may read rewritten bytes
            blocks_rewritten_before_flush=bool(getattr(vllm_config, "use_v2_model_runner", False)),
        )
        self.requests: dict[str, Request] = {}
        m = self.store.metrics
        self._transfer_hists = [
            (
                m.histogram("kvsdk_transfer_seconds", direction=d),
                m.histogram("kvsdk_transfer_bytes", direction=d),
            )
            for d in ("load", "store")
        ]
        self._reported: dict[str, float] = {}
        self._reported_version = -1
        self.preemptions = 0
        self._held: set[str] = set()
        """Finished requests whose blocks vLLM keeps until their stores land."""
        self._releasing: set[str] = set()
        """Held requests handed to the workers to release, not yet freed by vLLM."""
        log.info(
            "kvsdk: KV groups %s, chunk %d tokens / %d B (%d rank region(s)), host tier %s "
            "slots in shared memory %s",
            ",".join(g.kind.value for g in layout.groups),
            layout.config.chunk_tokens,
            layout.chunk_bytes,
            layout.ranks.num_regions,
            self.store.host.num_slots,
            layout.slab_name,
        )

    def check_workers(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Start-up: every worker attached to this engine's slab, on this machine."""
        here = machine_id()
        ranks = self.layout.ranks
        for (pp_rank, tp_rank), hs in sorted(metadata.items()):
            if not isinstance(hs, KVSDKHandshake):
                continue
            if hs.machine != here:
                raise ConfigError(
                    f"vLLM worker pp={pp_rank} tp={tp_rank} runs on another machine than the "
                    "scheduler: workers on other machines are not supported by kvsdk yet"
                )
            if hs.error:
                raise ConfigError(f"vLLM worker pp={pp_rank} tp={tp_rank}: {hs.error}")
            if hs.region != ranks.region_index(pp_rank, tp_rank):
                raise ConfigError(
                    f"vLLM worker pp={pp_rank} tp={tp_rank} took region {hs.region}, expected "
                    f"{ranks.region_index(pp_rank, tp_rank)}"
                )
        log.info("kvsdk: %d worker(s) attached to %s", len(metadata), self.layout.slab_name)
        attached = sum(isinstance(hs, KVSDKHandshake) for hs in metadata.values())
        if attached == self.world_size:
            self.store.host.seal()  # no process attaches any more: nothing can leak now

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if not self.core.has_request(rid):
            self.core.add_request(
                rid,
                num_prompt_tokens=request.num_prompt_tokens,
                block_hashes=request.block_hashes,
                tenant=request.cache_salt or "",
            )
        else:  # e.g. preempted and waiting again, having grown
            self.core.hashes_grew(rid, request.block_hashes)
        self.requests[rid] = request
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        hit = self.core.lookup(rid, num_computed_tokens, num_tokens=request.num_tokens)
        return hit, bool(hit)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self.core.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)
        # else: nothing to load; the request is scheduled this step, and its
        # blocks reach the core through build_connector_meta (new requests
        # carry their full block lists)

    def build_connector_meta(self, so: SchedulerOutput) -> KVSDKConnectorMetadata:
        new_blocks: dict[str, Sequence[Sequence[int]]] = {}
        resumed = set()
        for data in so.scheduled_new_reqs:
            new_blocks[data.req_id] = data.block_ids
            resumed.add(data.req_id)  # its full block list: replace
        cached = so.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                new_blocks[rid] = ids
        resumed.update(cached.resumed_req_ids)
        computed: dict[str, int] = {}
        requests, due = self.requests, self.core.store_due
        for rid, n in so.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None:
                continue
            upto = req.num_computed_tokens + n
            if upto >= due.get(rid, upto + 1):  # only requests that may complete a chunk
                computed[rid] = upto if upto < req.num_tokens else req.num_tokens
                self.core.hashes_grew(rid, req.block_hashes)
        finished: dict[str, int] = {}
        for rid in so.finished_req_ids or ():
            req = self.requests.pop(rid, None)
            if req is not None:
                finished[rid] = _computed_at_finish(req)
        copies = [c.dst_block_id for c in (so.kv_cache_block_copies or ())]
        self.preemptions += len(so.preempted_req_ids or ())
        jobs = self.core.build_step(
            computed_after_step=computed,
            new_block_ids=new_blocks,
            replace_block_ids=resumed,
            preempted=so.preempted_req_ids or (),
            finished=finished,
            reallocated_block_ids=copies,
        )
        if not so.num_scheduled_tokens and self.store.has_pending_work():
            # nothing to compute but tier I/O (lookups waiting on a promotion,
            # writes draining): sleep on it briefly rather than spin empty steps
            self.store.wait_io(IDLE_IO_WAIT_SECONDS)
        job_request = self.core.job_request
        loads = {j.job_id: (job_request(j.job_id), j) for j in jobs.loads}
        release: frozenset[str] = frozenset()
        if self._held and finished:
            # their last stores are in this step
            release = frozenset(self._held.intersection(finished))
            self._held -= release
            self._releasing |= release
        return KVSDKConnectorMetadata(
            loads=loads,
            stores=list(jobs.stores),
            store_requests=[job_request(j.job_id) for j in jobs.stores],
            flush=jobs.flush,
            release=release,
        )

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        if self._releasing and out.finished_sending:
            self._releasing -= out.finished_sending
        meta = out.kv_connector_worker_meta
        if not isinstance(meta, KVSDKWorkerMetadata):
            return
        results = [WorkerResult(j, True, n) for j, n in meta.completed.items()]
        results += [WorkerResult(j, False, n) for j, n in meta.failed.items()]
        self.core.worker_results(results)
        for (secs_hist, bytes_hist), nbytes, secs in (
            (self._transfer_hists[0], meta.load_bytes, meta.load_seconds),
            (self._transfer_hists[1], meta.store_bytes, meta.store_seconds),
        ):
            if nbytes:
                secs_hist.observe(secs)
                bytes_hist.observe(nbytes)
        if meta.load_bytes:
            self.store.metrics.inc("kvsdk_loaded_bytes_total", meta.load_bytes, tier=0)

    def request_finished(self, request: Request) -> bool:
        """True: vLLM keeps the request's blocks until a later step's
        ``release`` (its stores read them; freed blocks may be zeroed or
        rewritten before a flush could run)."""
        rid = request.request_id
        self.requests[rid] = request
        self.core.hashes_grew(rid, request.block_hashes)
        if not self.core.request_finished(rid, _computed_at_finish(request)):
            return False
        self._held.add(rid)
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self.core.take_events()
        return self._vllm_events(events) if events else ()

    def _vllm_events(self, events: list[KVEvent]) -> Iterator[KVCacheEvent]:
        for ev in events:
            medium = ev.medium.value.upper()
            locality = "REMOTE" if ev.locality is Locality.CLUSTER else "LOCAL"
            if ev.kind is EventKind.CLEARED:
                yield AllBlocksCleared()
                continue
            hashes = [  # vLLM's own block hashes, in its external event form
                maybe_convert_block_hash(BlockHash(h))
                for h in [
                    EventOrigin._make(info).block_hash if info else key
                    for key, info in zip(ev.keys, ev.info or [None] * len(ev.keys), strict=True)
                ]
            ]
            groups = (
                {EventOrigin._make(info).group for info in ev.info if info} if ev.info else set()
            )
            group = groups.pop() if len(groups) == 1 else None
            if ev.kind is EventKind.STORED:
                yield BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.layout.config.chunk_tokens,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    locality=locality,
                )
            else:
                yield BlockRemoved(
                    block_hashes=hashes, medium=medium, group_idx=group, locality=locality
                )

    def stats(self) -> KVSDKConnectorStats | None:
        self.store.flush_metrics()
        m = self.store.metrics
        if m.counter_version == self._reported_version:
            return None
        self._reported_version = m.counter_version
        now = m.counters()
        delta = {
            k: v - self._reported.get(k, 0.0)
            for k, v in now.items()
            if v != self._reported.get(k, 0.0)
        }
        self._reported = now
        return KVSDKConnectorStats(data=delta) if delta else None

    def has_pending_work(self) -> bool:
        return bool(self._held or self._releasing) or self.core.has_pending_work()

    def reset(self) -> None:
        self.core.reset()

    def shutdown(self) -> None:
        self.handle.close()


class _WorkerSide:
    def __init__(self, layout: EngineLayout, pp_rank: int, tp_rank: int) -> None:
        self.layout = layout
        self.region = layout.ranks.region_index(pp_rank, tp_rank)
        self.stores_here = layout.ranks.stores_from(tp_rank)
        """False on TP ranks > 0 of an MLA model: rank 0 stores the replicated KV."""
        name = layout.config.transfer
        workers = plugins_manager.transfer_workers()
        if name == "auto":
            name = "cpu"  # resolved again at registration, from the tensors' device
        self._name = name
        self._workers = workers
        self.xfer: TransferWorker | None = None
        self._groups: list[GroupLayers] = []
        self._slab: SharedSlab | None = None
        self._load_req: dict[int, str] = {}
        self._load_blocks: dict[int, set[int]] = {}
        self._store_req: dict[int, str] = {}
        self._stores_of: dict[str, int] = {}
        """Per request, its store jobs submitted here and not finished."""
        self._releasing: set[str] = set()
        self._submitted: set[int] = set()
        self._meta = KVSDKWorkerMetadata()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        name = self._name
        if self.layout.config.transfer == "auto":
            name = "cuda" if first.is_cuda and "cuda" in self._workers else "cpu"
        self.xfer = self._workers[name]()
        self._groups = [
            GroupLayers(g.index, tuple(kv_caches[n] for n in layers), g.blocks_per_chunk)
            for g, layers in zip(self.layout.groups, self.layout.group_layers, strict=True)
        ]
        log.info(
            "kvsdk worker: %s transfer worker, %d layers, block %d B, slot region %d",
            name,
            sum(len(g.layers) for g in self._groups),
            self._groups[0].block_bytes,
            self.region,
        )

    def handshake(self) -> KVSDKHandshake:
        """Start-up (after the scheduler side built the slab): attach now, so a
        layout kvsdk cannot serve fails the engine's start, not a request."""
        try:
            self._attach()
        except SlabError as exc:
            return KVSDKHandshake(machine_id(), self.region, str(exc))
        return KVSDKHandshake(machine_id(), self.region)

    def _attach(self) -> TransferWorker:
        """The transfer worker, bound to this rank's region of the engine's shared slab."""
        assert self.xfer is not None, "register_kv_caches first"
        if self._slab is None:
            slab = SharedSlab.attach(self.layout.slab_name)
            if slab.geometry.num_regions != self.layout.ranks.num_regions:
                raise SlabError(
                    f"shared slab {slab.name} has {slab.geometry.num_regions} rank regions, "
                    f"this engine {self.layout.ranks.num_regions}"
                )
            need = max(g.chunk_bytes for g in self._groups)
            if need > slab.geometry.region_bytes:
                raise SlabError(
                    f"this rank's chunk of {need} B does not fit its {slab.geometry.region_bytes} "
                    "B slot region: pipeline stages with unequal KV layouts are not supported yet"
                )
            self.xfer.register(self._groups, slab.region(self.region))
            self._slab = slab
        return self.xfer

    def _submit(self, job: TransferJob) -> None:
        if job.job_id in self._submitted:
            return
        if job.direction is Direction.STORE and not self.stores_here:
            # another TP rank stores this replicated KV
            self._meta.completed[job.job_id] = self._meta.completed.get(job.job_id, 0) + 1
            return
        self._submitted.add(job.job_id)
        self._attach().submit(job)

    def _submit_stores(self, meta: KVSDKConnectorMetadata, only: frozenset[int] | None) -> None:
        for job in meta.stores:
            if only is None or job.job_id in only:
                self._submit(job)

    def flush(self, meta: KVSDKConnectorMetadata) -> None:
        """Before the forward pass: stores reading blocks about to be reused go first."""
        if meta.flush:
            self._submit_stores(meta, meta.flush)
            self._attach().wait(meta.flush)

    def start_loads(self, meta: KVSDKConnectorMetadata) -> None:
        """Also counts the step's stores per request (submitted later, after the
        forward pass) before ``get_finished`` can look at a request."""
        if self.stores_here:
            for job, req in zip(meta.stores, meta.store_requests, strict=True):
                self._store_req[job.job_id] = req
                self._stores_of[req] = self._stores_of.get(req, 0) + 1
        self._releasing |= meta.release
        for job_id, (req_id, job) in meta.loads.items():
            self._load_req[job_id] = req_id
            self._load_blocks[job_id] = {int(b) for c in job.copies for b in c.engine_blocks}
            self._submit(job)

    def submit_stores(self, meta: KVSDKConnectorMetadata) -> None:
        # after the forward pass: the blocks hold this step's KV now
        self._submit_stores(meta, None)

    def poll(self) -> set[str]:
        """Loads finished since the last poll, by request (stores are counted)."""
        if self.xfer is None or self._slab is None:
            return set()
        done: set[str] = set()
        for r in self.xfer.poll():
            self._submitted.discard(r.job_id)
            target = self._meta.completed if r.ok else self._meta.failed
            target[r.job_id] = target.get(r.job_id, 0) + 1
            if r.direction is Direction.LOAD:
                self._meta.load_bytes += r.num_bytes
                self._meta.load_seconds += r.seconds
                blocks = self._load_blocks.pop(r.job_id, set())
                if not r.ok:
                    log.warning(
                        "kvsdk load job %d failed (%s): %d blocks recomputed",
                        r.job_id,
                        r.error,
                        len(blocks),
                    )
                    self._load_errors |= blocks
                req = self._load_req.pop(r.job_id, None)
                if req is not None:
                    done.add(req)
            else:
                self._meta.store_bytes += r.num_bytes
                self._meta.store_seconds += r.seconds
                owner = self._store_req.pop(r.job_id, None)
                if owner is not None:
                    left = self._stores_of[owner] - 1
                    if left:
                        self._stores_of[owner] = left
                    else:
                        del self._stores_of[owner]
        return done

    def take_released(self) -> set[str] | None:
        """Held requests whose stores on this worker are all done (vLLM frees
        their blocks once every worker reported them)."""
        if not self._releasing:
            return None
        done = {r for r in self._releasing if r not in self._stores_of}
        self._releasing -= done
        return done or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_meta(self) -> KVSDKWorkerMetadata | None:
        if not (self._meta.completed or self._meta.failed):
            return None
        meta, self._meta = self._meta, KVSDKWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        if self.xfer is not None:
            self.xfer.shutdown()
