"""``KVSDKStorage``: kvsdk's storage tiers as SGLang's HiCache storage backend.

SGLang's hierarchical cache has three levels: GPU, its own host pool, and a
storage backend. This class is the storage level. SGLang's dynamic backend
factory builds it as ``KVSDKStorage(storage_config, kwargs)`` from
``--hicache-storage-backend-extra-config``::

    {"backend_name": "kvsdk", "module_path": "kvsdk.plugins.sglang",
     "class_name": "KVSDKStorage", "interface_v1": 1, "config": "kvsdk.yaml"}

``config`` is a YAML path or an inline mapping of kvsdk's schema (the
``KVSDK_CONFIG`` environment variable is the fallback). Its tiers below host
memory form the storage chain: a leading ``cpu`` tier is skipped, because
SGLang's host pool already is the host tier; a config with no tier left is a
:class:`~kvsdk.config.ConfigError`. Tiers are numbered from 1 in events and
metrics (tier 0 is SGLang's host pool).

What SGLang asks, and what kvsdk does:

- Construction: the model's identity is what its weights are (a fingerprint
  of every weight file, the config digest and the settings that change what
  its KV means; :mod:`kvsdk.plugins.sglang.identity`), never its served name;
  weights kvsdk cannot locate are refused unless ``model_id`` names them.
- ``register_mem_pool_host`` (after construction): the model's identity and
  the host pool's page geometry decide the namespace (dtype, layout, page
  size and page regions, TP/PP rank and size; MLA is rank-replicated, so its
  namespace has no TP rank and only the writer rank stores). The tiers are
  built then.
- Page keys (SGLang's 64-hex SHA-256 chain) become kvsdk chunk keys,
  ``chunk_key(epoch_fp, bytes.fromhex(page_hash), 0)``, where ``epoch_fp`` is
  the namespace's key-derivation key until the first ``clear``.
- ``clear`` (SGLang's cache flush) is scoped to this instance, like vLLM's
  reset: its keys move to a fresh random epoch
  (:func:`~kvsdk.keys.epoch_fingerprint`), so none of the pages stored before
  is served to it again, while the shared disk and Redis tiers keep every
  entry for the other instances (a full wipe is ``kvsdk clear``).
- ``batch_get_v1`` / ``batch_set_v1`` move pages between the tiers and the
  host pool's page regions, without a copy where the tier allows it; the
  generic (tensor) path reads and writes the same page bytes
  (:mod:`kvsdk.plugins.sglang.pages`).
- ``batch_exists`` counts the leading stored pages with kvsdk's planner.
- Everything else is kvsdk's one tier chain (:class:`~kvsdk.store.chain.TierChain`),
  called synchronously: reads walk the tiers in order (a page found lower is
  copied up in the background), writes go through to every tier, a bad page
  or a failing tier is a miss (counted, logged once per burst, never an
  exception into SGLang); events carry SGLang's page hash (``take_events``
  and the ``kvsdk_publish_events`` sinks); metrics go to ``metrics``,
  optionally served to Prometheus (``metrics.prometheus_port`` + TP rank).
- A :class:`~kvsdk.store.factory.StoreHandle` owns the start (exporter,
  ``kvsdk_startup``) and the stop (``close``: tiers, ``kvsdk_shutdown``).

- Hybrid models: a Mamba state side pool (SGLang's v2 ``PoolTransfer`` API)
  is served in its own tier chain (:mod:`kvsdk.plugins.sglang.mamba`); any
  other side pool is refused at registration with a
  :class:`~kvsdk.config.ConfigError`, which fails SGLang's attach.

Not covered: side pools other than Mamba (above); heterogeneous-TP head
splitting (``tp_lcm_size``). The Mamba path is tested on SGLang's real
``MambaPoolHost`` and controller registration, not with a hybrid model
running (SGLang runs no model on CPU).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvsdk.backend import Backend
from kvsdk.config import ConfigError
from kvsdk.events import KVEvent
from kvsdk.keys import Namespace, chunk_keys, epoch_fingerprint
from kvsdk.planner import LookupPlanner, PlanRequest
from kvsdk.plugins.sglang.config import CONFIG_ENV, config_source, load_storage_config
from kvsdk.plugins.sglang.identity import model_identity
from kvsdk.plugins.sglang.mamba import (
    MambaStates,
    each_side_transfer,
    mamba_namespace,
    restorable_prefix,
    serves_side_pool,
)
from kvsdk.plugins.sglang.pages import (
    HostPages,
    PageGeometry,
    PagePool,
    page_key_bytes,
    storage_namespace,
    tensor_bytes,
)
from kvsdk.plugins.sglang.stats import TransferStats
from kvsdk.store.chain import TierChain
from kvsdk.store.factory import StoreHandle
from kvsdk.types import ChunkKey, KVGroupSpec, LookupResult

__all__ = ["CONFIG_ENV", "KVSDKStorage", "load_storage_config"]

log = logging.getLogger(__name__)

KNOWN_KEYS = 1 << 18
"""Keys per tier remembered as stored (for removed events); oldest forgotten first."""


class KVSDKStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """SGLang HiCache storage backend over kvsdk's tiers (see the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        source = config_source(storage_config.extra_config, kwargs)
        self.config, self._tier_configs = load_storage_config(source)
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError(
                "tp_lcm_size: kvsdk does not split heads across heterogeneous TP sizes"
            )
        # what the weights are, not what they are called (refused when not found)
        self.identity = model_identity(storage_config, self.config)
        log.info(
            "kvsdk storage for SGLang: model %s (from %s)",
            self.identity.model,
            self.identity.source,
        )
        # MLA KV is the same on every TP rank: one writer (SGLang's choice), all read
        self.is_writer = bool(
            getattr(
                storage_config,
                "is_storage_writer",
                not storage_config.is_mla_model or storage_config.tp_rank == 0,
            )
        )
        # one port per rank on a node
        self.handle = StoreHandle(self.config, port_offset=int(storage_config.tp_rank))
        self.metrics = self.handle.metrics
        self.events = self.handle.events
        self._stats = TransferStats(self.metrics, log)  # kvsdk's metrics and SGLang's stats
        self.chain: TierChain | None = None
        self.pool: PagePool | None = None
        self.namespace: Namespace | None = None
        self._key_fp = b""  # the namespace's key-derivation key in this instance's epoch
        self.mem_pool_host: Any = None
        self._planner: LookupPlanner | None = None
        self._mamba: MambaStates | None = None  # SGLang's Mamba state host pool (v2)

    # -- set-up ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: learn the page geometry, build the tiers."""
        anchor = getattr(mem_pool_host, "anchor_entry", None)  # a HostPoolGroup: its KV pool
        if anchor is not None:
            mem_pool_host = anchor.host_pool
        pool = PagePool(mem_pool_host)
        geom = pool.geometry
        namespace = storage_namespace(
            self.storage_config, self.config, self.identity, mem_pool_host, geom
        )
        self.mem_pool_host = mem_pool_host
        if self.chain is not None and namespace == self.namespace:
            self.pool = pool
            return
        self.chain = self.handle.build_chain(
            namespace,
            geom.page_bytes,
            config=replace(self.config, tiers=self._tier_configs),
            track_keys=KNOWN_KEYS,
        )
        self.pool, self.namespace = pool, namespace
        self._key_fp = namespace.fingerprint
        self._planner = LookupPlanner([KVGroupSpec(index=0, tokens_per_block=geom.page_tokens)])
        log.info(
            "kvsdk storage for SGLang: tiers %s, namespace %s, %d-byte pages (%s, %s, %d "
            "regions), %s",
            ", ".join(f"{i + 1}:{type(t).__name__}" for i, t in enumerate(self.tiers)),
            namespace.hex,
            geom.page_bytes,
            geom.pool,
            geom.layout,
            geom.regions,
            "writer" if self.is_writer else "reader (MLA: another rank writes)",
        )

    @property
    def tiers(self) -> tuple[Backend, ...]:
        return self.chain.tiers if self.chain is not None else ()

    @property
    def geometry(self) -> PageGeometry | None:
        return self.pool.geometry if self.pool is not None else None

    @property
    def ready(self) -> bool:
        return self.chain is not None and not self.handle.closed

    def chunk_keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """kvsdk chunk keys for SGLang page hashes (in this instance's epoch)."""
        assert self.namespace is not None
        return chunk_keys(self._key_fp, [page_key_bytes(h) for h in page_hashes], 0)

    # -- zero-copy v1 ----------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool; per page whether it was read."""
        n = len(keys)
        if not n or not self.ready:
            return [False] * n
        assert self.pool is not None
        start = time.perf_counter()
        try:
            out = self._read(keys, self.pool.pages(host_indices, n))
        except Exception as exc:  # never into SGLang: the pages are misses
            self._failure("get", exc)
            return [False] * n
        self._observe("load", sum(out), start)
        return out

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages from the host pool; per page whether a tier took it."""
        n = len(keys)
        if not n:
            return []
        if not self.ready:
            return [False] * n
        if not self.is_writer:  # MLA: pages are rank-replicated, one rank writes
            return [True] * n
        assert self.pool is not None and self.chain is not None
        start = time.perf_counter()
        try:
            pages = self.pool.pages(host_indices, n)
            out: list[bool] = self.pool.write(self.chain, self._keys(keys), pages)
        except Exception as exc:
            self._failure("put", exc)
            return [False] * n
        self._observe("store", sum(out), start)
        return out

    # -- generic (tensor) API --------------------------------------------------------
    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Pages into the given flat tensors (or new ones): the tensor, or None for a miss."""
        n = len(keys)
        if not n or not self.ready:
            return [None] * n
        assert self.pool is not None
        start = time.perf_counter()
        try:
            given = list(target_locations) if target_locations is not None else [None] * n
            targets = [t if t is not None else self.pool.new_page() for t in given]
            ok = self._read(keys, HostPages.of_tensors(targets, targets[0].nbytes))
        except Exception as exc:
            self._failure("get", exc)
            return [None] * n
        self._observe("load", sum(ok), start)
        return [t if hit else None for t, hit in zip(targets, ok)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat page tensors (``get_data_page(i, flat=True)``); True if all were stored."""
        n = len(keys)
        if not n:
            return True
        if not self.ready or values is None:
            return False
        if not self.is_writer:
            return True
        assert self.chain is not None
        start = time.perf_counter()
        try:
            tensors = [v.contiguous() for v in values]
            payloads = [tensor_bytes(t) for t in tensors]
            out = self.chain.write_through(self._keys(keys), payloads)
        except Exception as exc:
            self._failure("put", exc)
            return False
        self._observe("store", sum(out), start)
        return all(out)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages are stored (a later hit after a miss cannot load)."""
        n = len(keys)
        if not n or not self.ready:
            return 0
        assert self.chain is not None and self._planner is not None and self.geometry is not None
        start = time.perf_counter()
        try:
            ckeys = self.chunk_keys(keys)
            where = self.chain.lookup(ckeys)
            found = {k for k, w in zip(ckeys, where) if w > 0}
            tokens = n * self.geometry.page_tokens
            plan = self._planner.plan(
                PlanRequest(
                    req_id="sglang",
                    num_tokens=tokens,
                    num_prompt_tokens=tokens,
                    num_computed_tokens=0,
                    group_keys=(ckeys,),
                    max_load_tokens=self.config.max_load_tokens,
                ),
                lambda k: LookupResult.HIT if k in found else LookupResult.MISS,
            )
            hits = plan.num_hit_tokens // self.geometry.page_tokens if plan else 0
        except Exception as exc:
            self._failure("exists", exc)
            return 0
        self.metrics.observe("kvsdk_lookup_delay_seconds", time.perf_counter() - start)
        if hits:
            self.metrics.inc("kvsdk_hit_tokens_total", hits * self.geometry.page_tokens)
        return hits

    # -- SGLang's v2 pool transfers: Mamba states beside the KV pages ----------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang hands over a hybrid model's side pool (after the KV pool): a
        Mamba state pool is served, any other is refused (the attach fails)."""
        if not serves_side_pool(host_pool, host_pool_name):  # the KV anchor, served through v1
            return
        if self.pool is None:
            raise ConfigError(
                "hicache pool 'mamba': kvsdk needs SGLang's KV host pool registered first"
            )
        namespace = mamba_namespace(
            self.storage_config,
            self.config,
            self.identity,
            host_pool,
            self.pool.geometry.page_tokens,
        )
        old, self._mamba = self._mamba, None  # a failed open leaves no closed chain in use
        if old is not None:
            old.close()
        self._mamba = MambaStates.open(
            host_pool, namespace, replace(self.config, tiers=self._tier_configs), self.metrics
        )
        log.info(
            "kvsdk storage for SGLang: Mamba states, namespace %s, %d-byte states",
            namespace.hex,
            self._mamba.nbytes,
        )

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV prefix, cut to the lengths at which every side pool can
        restore its trailing pages (a Mamba state: the state at that page)."""
        kv = self.batch_exists(keys, extra_info)
        if not pool_transfers:
            return PoolTransferResult(kv, {})
        try:
            return restorable_prefix(keys, kv, pool_transfers, self._side_pool())
        except Exception as exc:
            self._failure("exists", exc)
            return PoolTransferResult(0, {})

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages (Mamba states) into its host slots."""
        failure = partial(self._failure, "get")
        return each_side_transfer(transfers, self._side_pool(), self._read_states, failure)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages (Mamba states) from its host slots. Every
        rank writes its own (Mamba states are TP-sharded, even beside MLA)."""
        failure = partial(self._failure, "put")
        return each_side_transfer(transfers, self._side_pool(), MambaStates.write, failure)

    def _side_pool(self) -> MambaStates | None:
        return self._mamba if self.ready else None

    def _read_states(self, mamba: MambaStates, keys: list[str], slots: list[int]) -> list[bool]:
        assert self.pool is not None
        return mamba.read(self.pool, keys, slots)

    # -- housekeeping -----------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's cache flush, scoped to this instance: its page keys move to
        a fresh random epoch, so no page stored before (by it or anyone) is
        served to it again; the shared tiers keep every entry for the other
        instances and nothing is deleted. A CLEARED event per tier says this
        instance's view of it is empty. (The full wipe: ``kvsdk clear``.)"""
        if self.chain is None or self.namespace is None:
            return
        self._key_fp = epoch_fingerprint(self.namespace.fingerprint, os.urandom(16))
        if self._mamba is not None:
            self._mamba.new_epoch()
        for t in self.chain.numbers:
            self.chain.cleared(t)
        self.chain.publish()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch)."""
        return self._stats.take()

    def kvsdk_stats(self) -> dict[str, Any]:
        """kvsdk's view: metrics snapshot and each tier's own counters."""
        return {
            "namespace": self.namespace.hex if self.namespace else None,
            "metrics": self.metrics.snapshot(),
            "tiers": {
                f"{t + 1}:{type(tier).__name__}": tier.stats() for t, tier in enumerate(self.tiers)
            },
            "events_dropped": self.events.dropped,
        }

    def take_events(self) -> list[KVEvent]:
        """Drain the stored / removed / cleared events of this storage level."""
        if self.chain is None:
            return self.events.take_events()
        with self.chain.lock:
            return self.events.take_events()

    def close(self) -> None:
        if self._mamba is not None:
            self._mamba.close()
            self._mamba = None
        self.handle.close()

    # -- helpers ----------------------------------------------------------------------
    def _keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """Chunk keys for ``page_hashes``, annotated with them for events."""
        ckeys = self.chunk_keys(page_hashes)
        if self.events.enabled and self.chain is not None:
            with self.chain.lock:
                for k, h in zip(ckeys, page_hashes):
                    self.events.annotate(k, h)
        return ckeys

    def _read(self, page_hashes: Sequence[str], pages: HostPages) -> list[bool]:
        assert self.pool is not None and self.chain is not None
        where = self.pool.read(self.chain, self._keys(page_hashes), pages)
        return [w > 0 for w in where]

    def _observe(self, direction: str, pages: int, start: float) -> None:
        assert self.geometry is not None
        sglang = bool(self.storage_config.enable_storage_metrics)
        self._stats.observe(direction, pages, self.geometry.page_bytes, start, sglang)

    def _failure(self, op: str, exc: BaseException) -> None:
        self._stats.failure(op, exc)
