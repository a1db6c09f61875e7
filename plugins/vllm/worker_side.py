"""The connector's worker side: vLLM's paged KV tensors ↔ the host tier's
shared slab through a kvsdk transfer worker, one per engine process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvsdk import plugins_manager
from kvsdk.plugins.vllm.layout import EngineLayout
from kvsdk.plugins.vllm.messages import (
    KVSDKConnectorMetadata,
    KVSDKHandshake,
    KVSDKWorkerMetadata,
    machine_id,
)
from kvsdk.slab import SharedSlab, SlabError
from kvsdk.transfer import Direction, GroupLayers, TransferJob, TransferWorker
from kvsdk.transfer.cpu import no_cpu_to_spare

if TYPE_CHECKING:
    pass

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler


class WorkerSide:
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
        """Asynchronous load jobs → their request (reported in ``finished_recving``)."""
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
            host = self.layout.config.tiers[0].options if self.layout.config.tiers else None
            slab = SharedSlab.attach(
                self.layout.slab_name,
                prefault=bool(getattr(host, "prefault", True)),
                prefault_inline=no_cpu_to_spare(),
            )
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
        xfer = self._attach()
        if job.direction is Direction.STORE and self._slab is not None and self._slab.walking:
            # this process's prefault walk keeps ahead of the slots stores reach (once
            # the whole slab is committed, a store step does not look at its slots)
            end = max((int(max(c.slots)) + 1 for c in job.copies if c.num_blocks), default=0)
            self._slab.stores_reached(end)
        xfer.submit(job)

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
            if not meta.sync_loads:
                self._load_req[job_id] = req_id
            self._load_blocks[job_id] = {int(b) for c in job.copies for b in c.engine_blocks}
            self._submit(job)
        if meta.sync_loads and meta.loads:  # vLLM calls this before the forward pass
            self._attach().wait(meta.loads)

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
