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

- ``register_mem_pool_host`` (after construction): the host pool's page
  geometry decides the namespace (model, dtype, layout, page size and page
  regions, TP/PP rank and size; MLA is rank-replicated, so its namespace has
  no TP rank and only the writer rank stores). The tiers are built then.
- Page keys (SGLang's 64-hex SHA-256 chain) become kvsdk chunk keys,
  ``chunk_key(namespace.fingerprint, bytes.fromhex(page_hash), 0)``.
- A page is stored as the bytes of its regions in address order, which is
  exactly ``host_pool.get_data_page(index, flat=True)``: the zero-copy v1
  path and the generic path read each other's pages.
- ``batch_get_v1`` / ``batch_set_v1`` move pages between the tiers and the
  host pool's page regions (``get_page_buffer_meta``). A page that is one
  region (MLA ``page_first``/``page_first_direct``) is read with the tier's
  ``get_into`` straight into host memory and written from it, no copy. A page
  of several regions (MHA: K and V, per layer for ``layer_first``) is passed
  as the list of its regions (views of the host pool) to a tier with
  scatter/gather I/O (``put_parts`` / ``get_into_parts``: the disk tier writes
  them with one ``writev`` and reads them with one ``readv``, checksummed over
  the parts), again no copy; for other tiers it goes through one reusable
  staging buffer per thread: one vectorized row copy per batch between it and
  the host pool.
- ``batch_exists`` counts the leading stored pages with kvsdk's planner.
- Reads walk the tiers in order; a page found in a lower tier is copied up to
  the tiers above it in the background. Writes go through to every tier; a
  page counts as stored when one tier took it.
- Every page read back is verified by the tier (frame, namespace, key,
  checksum); a bad one is a miss. Any failure of a tier (exception, refused
  write, timeout inside the tier) is a miss or a refused write for those
  pages, counted and logged once per burst, never an exception into SGLang.
- Events (stored / removed / cleared per tier, annotated with SGLang's page
  hash) go to kvsdk's :class:`~kvsdk.events.EventTracker` (``take_events``)
  and to the ``kvsdk_publish_events`` sinks; counters and histograms to
  :class:`~kvsdk.metrics.Metrics` (``metrics``), optionally served to
  Prometheus (``metrics.prometheus_port`` + TP rank).

Not covered: SGLang's v2 pool transfers (Mamba / SWA / indexer side pools of
hybrid models) answer "nothing stored", so those models get misses;
heterogeneous-TP head splitting (``tp_lcm_size``) is not supported.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvsdk import plugins_manager
from kvsdk.backend import Backend
from kvsdk.burst_log import BurstLog
from kvsdk.config import ConfigError, KVSDKConfig
from kvsdk.events import EventKind, EventTracker, KVEvent
from kvsdk.keys import GroupLayout, Namespace, chunk_keys
from kvsdk.metrics import Metrics, start_prometheus_exporter
from kvsdk.planner import LookupPlanner, PlanRequest
from kvsdk.plugins.sglang.config import load_storage_config
from kvsdk.store.factory import build_tiers
from kvsdk.types import ChunkKey, KVGroupSpec, LookupResult

log = logging.getLogger(__name__)

CONFIG_ENV = "KVSDK_CONFIG"
STAGING_BYTES = 64 << 20
"""Largest staging buffer per thread; bigger batches are moved in slices."""
KNOWN_KEYS = 1 << 18
"""Keys per tier remembered as stored (for removed events); oldest forgotten first."""
MAX_PROMOTIONS_IN_FLIGHT = 64
"""Background copies up the tier chain; beyond it a promotion is skipped."""
SMALL_ROW_BYTES = 16 << 10
"""Below this region size a batch gather uses numpy, above it torch (measured)."""

_EXPORTERS: dict[int, Metrics] = {}
_EXPORTERS_LOCK = threading.Lock()


# -- configuration ------------------------------------------------------------------------


# -- small helpers ------------------------------------------------------------------------


def _host_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of host memory at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def _address(buf: Any) -> int:
    """Address of a contiguous bytes-like object's first byte."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data) if arr.size else 0


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor (contiguous, so no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _page_key_bytes(page_hash: str) -> bytes:
    try:
        return bytes.fromhex(page_hash)
    except (ValueError, TypeError):  # not a hex chain hash (e.g. a suffixed key)
        return str(page_hash).encode()


@dataclass(frozen=True)
class PageGeometry:
    """How one page of the host pool lies in memory."""

    page_tokens: int
    region_sizes: tuple[int, ...]
    """Bytes of each region of a page, in address order."""
    order: tuple[int, ...]
    """``get_page_buffer_meta``'s region positions, sorted by address."""
    dtype: str
    layout: str
    pool: str

    @property
    def page_bytes(self) -> int:
        return sum(self.region_sizes)

    @property
    def regions(self) -> int:
        return len(self.region_sizes)


def page_geometry(host_pool: Any) -> PageGeometry:
    """Page geometry of a registered SGLang host pool (reads pointers only)."""
    page_tokens = int(host_pool.page_size)
    ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page_tokens, dtype=torch.int64))
    order = tuple(sorted(range(len(ptrs)), key=lambda i: ptrs[i]))
    return PageGeometry(
        page_tokens=page_tokens,
        region_sizes=tuple(int(sizes[i]) for i in order),
        order=order,
        dtype=str(host_pool.dtype).removeprefix("torch."),
        layout=str(host_pool.layout),
        pool=type(host_pool).__name__,
    )


_GEOMETRY_ATTRS = ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank",
                   "qk_rope_head_dim", "kv_cache_dim")  # fmt: skip


def storage_namespace(
    storage_config: HiCacheStorageConfig, config: KVSDKConfig, host_pool: Any, geom: PageGeometry
) -> Namespace:
    """The namespace that decides which pages are interchangeable."""
    mla = bool(storage_config.is_mla_model)
    shape = ",".join(
        f"{a}={getattr(host_pool, a)}" for a in _GEOMETRY_ATTRS if hasattr(host_pool, a)
    )
    layout = f"sglang/{geom.pool}/{geom.layout}/{shape}/regions={list(geom.region_sizes)}"
    extra = [("engine", "sglang"), ("pp", f"{storage_config.pp_rank}/{storage_config.pp_size}")]
    cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        extra.append(("attn_cp", f"{storage_config.attn_cp_rank}/{cp_size}"))
    dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
    if dcp_size > 1:
        extra.append(("dcp", f"{storage_config.dcp_rank}/{dcp_size}"))
    return Namespace(
        model=config.model_id or storage_config.model_name or "unknown-model",
        dtype=geom.dtype,
        groups=(GroupLayout(shape=(geom.page_bytes,), dtype="|u1", layout=layout),),
        tokens_per_chunk=geom.page_tokens,
        rank=0 if mla else int(storage_config.tp_rank),
        world_size=1 if mla else int(storage_config.tp_size),
        tenant_salt=config.tenant,
        extra=tuple(extra),
    )


class _KnownKeys:
    """Keys a tier is believed to hold (bounded, oldest forgotten first)."""

    def __init__(self, capacity: int = KNOWN_KEYS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()

    def add(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Adds keys; returns those that were not known."""
        new = []
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
                new.append(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return new

    def drop(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Forgets keys; returns those that were known."""
        return [k for k in keys if self._keys.pop(k, 0) is None]

    def clear(self) -> None:
        self._keys.clear()


class _Pages:
    """Where a batch of pages lies in host memory, and how to copy them.

    ``addrs[i]`` are page ``i``'s region addresses in address order (the page's
    bytes are their concatenation). When every region has the same size and
    lies on a row of ``pool_rows`` (the host pool's buffer viewed as rows of
    that size, true for SGLang's MHA and MLA pools in every layout), a whole
    batch is copied with one vectorized row copy; otherwise region by region.
    """

    def __init__(
        self,
        addrs: np.ndarray,
        sizes: tuple[int, ...],
        pool: tuple[np.ndarray, int] | None,
        mem: tuple[memoryview, int] | None = None,
    ) -> None:
        self.addrs = addrs  # (n, r) int64
        self.sizes = sizes
        self.page_bytes = sum(sizes)
        self.mem = mem  # the host pool's bytes and their address (for region views)
        self.rows: np.ndarray | None = None
        self.pool_rows: np.ndarray | None = None
        if pool is not None and len(set(sizes)) == 1:
            pool_rows, base = pool
            row = sizes[0]
            off = addrs - base
            if (
                pool_rows.shape[1] == row
                and bool((off >= 0).all())
                and bool((off % row == 0).all())
                and bool((off // row < pool_rows.shape[0]).all())
            ):
                self.rows, self.pool_rows = off // row, pool_rows

    def __len__(self) -> int:
        return int(self.addrs.shape[0])

    def subset(self, idx: Sequence[int]) -> _Pages:
        out = _Pages.__new__(_Pages)
        sel = np.asarray(idx, dtype=np.int64)
        out.addrs, out.sizes, out.page_bytes = self.addrs[sel], self.sizes, self.page_bytes
        out.mem = self.mem
        out.rows = None if self.rows is None else self.rows[sel]
        out.pool_rows = self.pool_rows
        return out

    def views(self) -> list[memoryview]:
        """Each page as one writable view of host memory (one-region pages only)."""
        assert self.addrs.shape[1] == 1
        return [regions[0] for regions in self.parts()]

    def parts(self) -> list[list[memoryview]]:
        """Each page as writable views of its regions, in address order (no copy):
        slices of the host pool's buffer, or views made from the addresses."""
        if self.mem is not None and self.addrs.size:
            mem, base = self.mem
            off = self.addrs - base
            end = off + np.asarray(self.sizes, dtype=np.int64)
            if bool((off >= 0).all()) and bool((end <= mem.nbytes).all()):
                return [
                    [mem[a:b] for a, b in zip(starts, stops)]
                    for starts, stops in zip(off.tolist(), end.tolist())
                ]
        return [[_host_view(a, s) for a, s in zip(row, self.sizes)] for row in self.addrs.tolist()]

    def gather(self, dst: np.ndarray) -> None:
        """Copy the pages, concatenated, into ``dst`` (uint8, ``len * page_bytes``)."""
        n = len(self)
        if self.rows is not None and self.pool_rows is not None:
            row = self.pool_rows.shape[1]
            out = dst[: n * self.page_bytes].reshape(-1, row)
            if row < SMALL_ROW_BYTES:  # numpy's take is quicker for small rows, torch for big
                np.take(self.pool_rows, self.rows.reshape(-1), axis=0, out=out)
            else:
                torch.index_select(
                    torch.from_numpy(self.pool_rows),
                    0,
                    torch.from_numpy(self.rows.reshape(-1)),
                    out=torch.from_numpy(out),
                )
            return
        base = int(dst.ctypes.data)
        for i in range(n):
            _gather(base + i * self.page_bytes, self._regions(i))

    def scatter(self, src: np.ndarray, which: Sequence[int]) -> None:
        """Copy pages ``which`` from ``src`` (the batch's pages, concatenated) into place."""
        if not which:
            return
        if self.rows is not None and self.pool_rows is not None:
            row = self.pool_rows.shape[1]
            data = src[: len(self) * self.page_bytes].reshape(len(self), -1, row)
            if len(which) == len(self):  # the usual case: one copy for the batch
                self.pool_rows[self.rows.reshape(-1)] = data.reshape(-1, row)
            else:
                for i in which:
                    self.pool_rows[self.rows[i]] = data[i]
            return
        base = int(src.ctypes.data)
        for i in which:
            _scatter(base + i * self.page_bytes, self._regions(i))

    def scatter_page(self, i: int, src: Any) -> None:
        """Copy one page from a bytes-like object into place."""
        _scatter(_address(src), self._regions(i))

    def _regions(self, i: int) -> list[tuple[int, int]]:
        return [(int(a), s) for a, s in zip(self.addrs[i], self.sizes)]


# -- the backend --------------------------------------------------------------------------


class KVSDKStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """SGLang HiCache storage backend over kvsdk's tiers (see the module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        source = extra.get("config")
        if source is None:
            source = (kwargs or {}).get("config", os.environ.get(CONFIG_ENV))
        if source is None:
            raise ConfigError(
                "config: missing; pass kvsdk's config in the storage extra config "
                '(--hicache-storage-backend-extra-config \'{..., "config": "kvsdk.yaml"}\') '
                f"or set {CONFIG_ENV}"
            )
        self.config, self._tier_configs = load_storage_config(source)
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError(
                "tp_lcm_size: kvsdk does not split heads across heterogeneous TP sizes"
            )
        # MLA KV is the same on every TP rank: one writer (SGLang's choice), all read
        self.is_writer = bool(
            getattr(
                storage_config,
                "is_storage_writer",
                not storage_config.is_mla_model or storage_config.tp_rank == 0,
            )
        )
        self.metrics = Metrics()
        port = self.config.metrics.prometheus_port
        if port is not None:
            port += int(storage_config.tp_rank)  # one port per rank on a node
            with _EXPORTERS_LOCK:
                if port in _EXPORTERS:
                    self.metrics = _EXPORTERS[port]
                else:
                    try:
                        start_prometheus_exporter(self.metrics, port)
                    except OSError as exc:
                        raise ConfigError(
                            f"metrics.prometheus_port: cannot serve on port {port} "
                            f"(the configured port + TP rank): {exc.strerror or exc}"
                        ) from None
                    _EXPORTERS[port] = self.metrics
        self.events = EventTracker(
            enabled=self.config.events.enabled, max_pending=self.config.events.max_pending
        )
        self._lock = threading.Lock()  # events, known keys
        self._burst = BurstLog(log)
        self._local = threading.local()
        self.tiers: tuple[Backend, ...] = ()
        self.namespace: Namespace | None = None
        self.geometry: PageGeometry | None = None
        self.mem_pool_host: Any = None
        self._known: list[_KnownKeys] = []
        self._corrupt_seen: list[float] = []
        self._planner: LookupPlanner | None = None
        self._pool_rows: tuple[np.ndarray, int] | None = None
        self._pool_mem: tuple[memoryview, int] | None = None
        self._promoter: ThreadPoolExecutor | None = None
        self._promotions = 0
        self._sglang_stats: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []
        }  # fmt: skip
        self._closed = False
        plugins_manager.plugin_manager().hook.kvsdk_startup(config=self.config)

    # -- set-up ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: learn the page geometry, build the tiers."""
        anchor = getattr(mem_pool_host, "anchor_entry", None)  # a HostPoolGroup: its KV pool
        if anchor is not None:
            mem_pool_host = anchor.host_pool
        geom = page_geometry(mem_pool_host)
        namespace = storage_namespace(self.storage_config, self.config, mem_pool_host, geom)
        self.mem_pool_host = mem_pool_host
        if self.tiers and namespace == self.namespace:
            return
        self._close_tiers()
        lower_config = replace(self.config, tiers=self._tier_configs)
        tiers = build_tiers(lower_config, namespace, geom.page_bytes)
        self.geometry, self.namespace, self.tiers = geom, namespace, tuple(tiers)
        self._known = [_KnownKeys() for _ in self.tiers]
        self._corrupt_seen = [self._tier_counter(t, "corrupt") for t in range(len(self.tiers))]
        self._planner = LookupPlanner([KVGroupSpec(index=0, tokens_per_block=geom.page_tokens)])
        self._pool_rows = _pool_rows(mem_pool_host, geom)
        self._pool_mem = _pool_mem(mem_pool_host)
        if len(self.tiers) > 1:
            self._promoter = ThreadPoolExecutor(1, thread_name_prefix="kvsdk-sglang-promote")
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
    def ready(self) -> bool:
        return bool(self.tiers) and not self._closed

    def chunk_keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        """kvsdk chunk keys for SGLang page hashes."""
        assert self.namespace is not None
        fp = self.namespace.fingerprint
        return chunk_keys(fp, [_page_key_bytes(h) for h in page_hashes], 0)

    # -- zero-copy v1 ----------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool; per page whether it was read."""
        n = len(keys)
        out = [False] * n
        if not n or not self.ready:
            return out
        start = time.perf_counter()
        try:
            pages = self._pages(host_indices, n)
            ckeys = self.chunk_keys(keys)
            self._annotate(ckeys, keys)
            self._read(ckeys, pages, out)
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
        start = time.perf_counter()
        try:
            pages = self._pages(host_indices, n)
            ckeys = self.chunk_keys(keys)
            self._annotate(ckeys, keys)
            out = self._write_pages(ckeys, pages)
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
        start = time.perf_counter()
        try:
            given = list(target_locations) if target_locations is not None else [None] * n
            targets = [t if t is not None else self._new_page_tensor() for t in given]
            views = [_tensor_bytes(t) for t in targets]
            ckeys = self.chunk_keys(keys)
            self._annotate(ckeys, keys)
            ok = [False] * n
            addrs = np.asarray([[_address(v)] for v in views], dtype=np.int64)
            self._read(ckeys, _Pages(addrs, (views[0].nbytes,), None), ok)
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
        start = time.perf_counter()
        try:
            tensors = [v.contiguous() for v in values]
            payloads = [_tensor_bytes(t) for t in tensors]
            ckeys = self.chunk_keys(keys)
            self._annotate(ckeys, keys)
            out = self._write_payloads(ckeys, payloads)
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
        start = time.perf_counter()
        try:
            ckeys = self.chunk_keys(keys)
            present = self._exists(ckeys)
            assert self._planner is not None and self.geometry is not None
            found = {k for k, p in zip(ckeys, present) if p}
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

    # -- SGLang's v2 pool transfers: side pools are not stored ------------------------
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        if pool_transfers:
            return PoolTransferResult(0, {})
        return PoolTransferResult(self.batch_exists(keys, extra_info), {})

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    # -- housekeeping -----------------------------------------------------------------
    def clear(self) -> None:
        """Drop every page this namespace stored, in every tier."""
        for t, tier in enumerate(self.tiers):
            try:
                tier.clear()
            except Exception as exc:
                self._tier_failure(t, "clear", exc)
                continue
            with self._lock:
                self._known[t].clear()
                self._record(EventKind.CLEARED, [], t)
        self._publish()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch)."""
        with self._lock:
            snap = {k: list(v) for k, v in self._sglang_stats.items()}
            for v in self._sglang_stats.values():
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
        with self._lock:
            return self.events.take_events()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_tiers()
        with contextlib.suppress(Exception):
            plugins_manager.plugin_manager().hook.kvsdk_shutdown()

    def _close_tiers(self) -> None:
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
            self._promoter = None
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()
        self.tiers = ()

    # -- page regions ---------------------------------------------------------------------
    def _pages(self, host_indices: torch.Tensor, n: int) -> _Pages:
        """Where ``n`` pages at ``host_indices`` lie in the host pool."""
        geom = self.geometry
        assert geom is not None
        if host_indices.numel() != n * geom.page_tokens:
            raise ValueError(
                f"{host_indices.numel()} host indices for {n} pages of {geom.page_tokens} tokens"
            )
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        r = geom.regions
        if len(ptrs) != n * r:
            raise ValueError(f"{len(ptrs)} page regions for {n} pages of {r} regions")
        order = list(geom.order)
        got = np.asarray(sizes, dtype=np.int64).reshape(n, r)[:, order]
        if not bool((got == np.asarray(geom.region_sizes, dtype=np.int64)).all()):
            raise ValueError("page regions differ from the registered geometry")
        addrs = np.asarray(ptrs, dtype=np.int64).reshape(n, r)[:, order]
        return _Pages(addrs, geom.region_sizes, self._pool_rows, self._pool_mem)

    def _staging(self, nbytes: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "staging", None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._local.staging = buf
        return buf

    def _new_page_tensor(self) -> torch.Tensor:
        dummy: torch.Tensor = self.mem_pool_host.get_dummy_flat_data_page()
        return dummy

    # -- reads ----------------------------------------------------------------------------
    def _read(self, ckeys: list[ChunkKey], pages: _Pages, out: list[bool]) -> None:
        """Set ``out[i]`` for every page read (and verified) into place."""
        geom = self.geometry
        assert geom is not None
        todo = list(range(len(ckeys)))
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            hits: list[int] = []
            misses: list[int] = []
            step = max(1, STAGING_BYTES // pages.page_bytes)
            for s in range(0, len(todo), step):
                part = todo[s : s + step]
                ok = self._read_tier(t, tier, [ckeys[i] for i in part], pages.subset(part))
                for i, good in zip(part, ok):
                    (hits if good else misses).append(i)
            for i in hits:
                out[i] = True
            if hits:
                self.metrics.inc(
                    "kvsdk_loaded_bytes_total", len(hits) * pages.page_bytes, tier=t + 1
                )
                if t > 0:
                    self._promote(t, [ckeys[i] for i in hits], pages.subset(hits))
            if misses:
                self._note_misses(t, [ckeys[i] for i in misses])
            todo = misses
        self._publish()

    def _read_tier(self, t: int, tier: Backend, keys: list[ChunkKey], pages: _Pages) -> list[bool]:
        get_into = getattr(tier, "get_into", None)
        start = time.perf_counter()
        try:
            if get_into is not None and pages.addrs.shape[1] == 1:
                # one region per page: straight into place, no copy
                ok = [bool(x) for x in get_into(keys, pages.views())]
            elif _scatter_gather(tier):
                # several regions per page: one scattered read into them, no copy
                ok = [bool(x) for x in tier.get_into_parts(keys, pages.parts())]
            elif get_into is not None:
                pb = pages.page_bytes
                staging = self._staging(len(keys) * pb)
                outs = [staging[i * pb : (i + 1) * pb].data for i in range(len(keys))]
                ok = [bool(x) for x in get_into(keys, outs)]
                pages.scatter(staging, [i for i, good in enumerate(ok) if good])
            else:
                ok = []
                for i, value in enumerate(tier.get(keys)):
                    good = value is not None and memoryview(value).nbytes == pages.page_bytes
                    if good:
                        pages.scatter_page(i, value)
                    ok.append(good)
        except Exception as exc:
            self._tier_failure(t, "get", exc)
            return [False] * len(keys)
        finally:
            self.metrics.observe(
                "kvsdk_backend_seconds", time.perf_counter() - start, tier=t + 1, op="get"
            )
        return ok

    def _exists(self, ckeys: list[ChunkKey]) -> list[bool]:
        present = [False] * len(ckeys)
        todo = list(range(len(ckeys)))
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            start = time.perf_counter()
            try:
                found = tier.exists([ckeys[i] for i in todo])
            except Exception as exc:
                self._tier_failure(t, "exists", exc)
                found = [False] * len(todo)
            self.metrics.observe(
                "kvsdk_backend_seconds", time.perf_counter() - start, tier=t + 1, op="exists"
            )
            hits = [i for i, f in zip(todo, found) if f]
            for i in hits:
                present[i] = True
            if hits:
                self.metrics.inc("kvsdk_lookup_hits_total", len(hits), tier=t + 1)
            todo = [i for i, f in zip(todo, found) if not f]
            if todo:
                self._note_misses(t, [ckeys[i] for i in todo])
        if todo:
            self.metrics.inc("kvsdk_lookup_misses_total", len(todo))
        self._publish()
        return present

    def _note_misses(self, t: int, keys: list[ChunkKey]) -> None:
        """Keys the tier was known to hold and no longer serves are removed there."""
        with self._lock:
            gone = self._known[t].drop(keys)
            if gone:
                self._record(EventKind.REMOVED, gone, t)
        corrupt = self._tier_counter(t, "corrupt")
        if corrupt > self._corrupt_seen[t]:
            self.metrics.inc(
                "kvsdk_corrupt_chunks_total", corrupt - self._corrupt_seen[t], tier=t + 1
            )
            self._corrupt_seen[t] = corrupt

    def _tier_counter(self, t: int, name: str) -> float:
        try:
            return float(self.tiers[t].stats().get(name, 0.0))
        except Exception:
            return 0.0

    # -- writes ---------------------------------------------------------------------------
    def _write_pages(self, ckeys: list[ChunkKey], pages: _Pages) -> list[bool]:
        if pages.addrs.shape[1] == 1:  # one region per page: stored straight from host memory
            return self._write_payloads(ckeys, pages.views())
        if any(_scatter_gather(tier) for tier in self.tiers):
            # several regions per page: written from them as they are (gathered by the tier)
            return self._write_payloads(ckeys, pages.parts())
        out: list[bool] = []
        pb = pages.page_bytes
        step = max(1, STAGING_BYTES // pb)
        for s in range(0, len(ckeys), step):
            part = pages.subset(range(s, min(s + step, len(ckeys))))
            staging = self._staging(len(part) * pb)
            part.gather(staging)
            payloads = [staging[i * pb : (i + 1) * pb].data for i in range(len(part))]
            out += self._write_payloads(ckeys[s : s + step], payloads)
        return out

    def _write_payloads(
        self,
        ckeys: list[ChunkKey],
        payloads: list[memoryview] | list[list[memoryview]],
        *,
        tiers: range | None = None,
    ) -> list[bool]:
        """Write through to every tier (or ``tiers``); per key whether one took it.
        A payload may be the list of a page's regions (``put_parts``)."""
        assert self.geometry is not None
        stored = [False] * len(ckeys)
        items: list[Any] = list(zip(ckeys, payloads))
        in_parts = bool(payloads) and isinstance(payloads[0], list)
        for t in tiers if tiers is not None else range(len(self.tiers)):
            tier = self.tiers[t]
            start = time.perf_counter()
            try:
                ok = [bool(x) for x in (tier.put_parts if in_parts else tier.put)(items)]
            except Exception as exc:
                self._tier_failure(t, "put", exc)
                ok = [False] * len(items)
            self.metrics.observe(
                "kvsdk_backend_seconds", time.perf_counter() - start, tier=t + 1, op="put"
            )
            took = [k for k, good in zip(ckeys, ok) if good]
            refused = len(ckeys) - len(took)
            if refused:
                self.metrics.inc("kvsdk_allocation_failures_total", refused)
            for i, good in enumerate(ok):
                stored[i] = stored[i] or good
            if took:
                with self._lock:
                    new = self._known[t].add(took)
                    self._record(EventKind.STORED, new, t)
                self.metrics.inc(
                    "kvsdk_stored_bytes_total", len(new) * self.geometry.page_bytes, tier=t + 1
                )
        self._publish()
        return stored

    def _promote(self, t: int, keys: list[ChunkKey], pages: _Pages) -> None:
        """Copy pages found in tier ``t`` up to the tiers above it, in the background."""
        if self._promoter is None:
            return
        with self._lock:
            if self._promotions >= MAX_PROMOTIONS_IN_FLIGHT:
                return
            self._promotions += 1
        pb = pages.page_bytes
        data = np.empty(len(keys) * pb, dtype=np.uint8)  # the host pages may be reused
        pages.gather(data)
        payloads = [data[i * pb : (i + 1) * pb].data for i in range(len(keys))]

        def run() -> None:
            try:
                self._write_payloads(keys, payloads, tiers=range(t))
            finally:
                with self._lock:
                    self._promotions -= 1

        try:
            self._promoter.submit(run)
        except RuntimeError:  # shut down
            with self._lock:
                self._promotions -= 1

    # -- events, metrics, failures -------------------------------------------------------
    def _annotate(self, ckeys: list[ChunkKey], page_hashes: Sequence[str]) -> None:
        if not self.events.enabled:
            return
        with self._lock:
            for k, h in zip(ckeys, page_hashes):
                self.events.annotate(k, h)

    def _record(self, kind: EventKind, keys: list[ChunkKey], t: int) -> None:
        """Record an event for tier ``t`` (call with the lock held)."""
        tier = self.tiers[t]
        self.events.record(kind, keys, tier=t + 1, medium=tier.medium, locality=tier.locality)

    def _publish(self) -> None:
        with self._lock:
            self.events.publish()

    def _observe(self, direction: str, pages: int, start: float) -> None:
        assert self.geometry is not None
        seconds = time.perf_counter() - start
        nbytes = pages * self.geometry.page_bytes
        self.metrics.observe("kvsdk_transfer_seconds", seconds, direction=direction)
        self.metrics.observe("kvsdk_transfer_bytes", float(nbytes), direction=direction)
        if self.storage_config.enable_storage_metrics and pages:
            key = "prefetch" if direction == "load" else "backup"
            with self._lock:
                self._sglang_stats[f"{key}_pgs"].append(pages)
                self._sglang_stats[f"{key}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def _tier_failure(self, t: int, op: str, exc: BaseException) -> None:
        self.metrics.inc("kvsdk_backend_errors_total", tier=t + 1)
        self._burst.warning(
            f"tier{t}-{op}",
            "kvsdk storage: tier %d (%s) %s failed, treated as misses: %s",
            t + 1,
            type(self.tiers[t]).__name__ if t < len(self.tiers) else "?",
            op,
            exc,
        )

    def _failure(self, op: str, exc: BaseException) -> None:
        self.metrics.inc("kvsdk_failed_jobs_total", direction=op)
        self._burst.warning(
            f"batch-{op}", "kvsdk storage: %s failed, treated as misses: %r", op, exc
        )


def _pool_rows(host_pool: Any, geom: PageGeometry) -> tuple[np.ndarray, int] | None:
    """The host pool's buffer as rows of one region each, with its address, when
    every page region is one such row (for vectorized copies); else None."""
    buf = getattr(host_pool, "kv_buffer", None)
    row = geom.region_sizes[0]
    if (
        not isinstance(buf, torch.Tensor)
        or buf.device.type != "cpu"
        or not buf.is_contiguous()
        or len(set(geom.region_sizes)) != 1
        or (buf.numel() * buf.element_size()) % row
    ):
        return None
    flat = buf.reshape(-1).view(torch.uint8).numpy()
    return flat.reshape(-1, row), int(buf.data_ptr())


def _pool_mem(host_pool: Any) -> tuple[memoryview, int] | None:
    """The host pool's whole buffer as one writable byte view, with its address."""
    buf = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    flat = buf.reshape(-1).view(torch.uint8).numpy()
    return flat.data, int(buf.data_ptr())


def _scatter_gather(tier: Backend) -> bool:
    """Whether the tier does scatter/gather I/O itself (not the base class's copies)."""
    cls = type(tier)
    return (
        getattr(cls, "put_parts", None) is not Backend.put_parts
        and getattr(cls, "get_into_parts", None) is not Backend.get_into_parts
    )


def _scatter(src: int, page: list[tuple[int, int]]) -> None:
    """Copy a contiguous page at ``src`` into its regions."""
    off = 0
    for ptr, size in page:
        ctypes.memmove(ptr, src + off, size)
        off += size


def _gather(dst: int, page: list[tuple[int, int]]) -> None:
    """Copy a page's regions to contiguous memory at ``dst``."""
    off = 0
    for ptr, size in page:
        ctypes.memmove(dst + off, ptr, size)
        off += size
