"""SGLang's host pool as kvsdk sees it: page geometry, namespace, and moving a
batch of pages between the pool's memory and the tiers' buffers.

This is to SGLang what :mod:`kvsdk.plugins.vllm.layout` is to vLLM: the
translation of the engine's memory into chunks. A page is stored as the
bytes of its regions in address order, which is exactly
``host_pool.get_data_page(index, flat=True)``.

How a batch moves (:class:`PagePool` and :class:`HostPages`):

- a page that is one region (MLA ``page_first``/``page_first_direct``) is
  read with the tier's ``get_into`` straight into host memory and written
  from it, no copy;
- a page of several regions (MHA: K and V, per layer for ``layer_first``)
  goes as the list of its regions (views of the host pool) to a tier that
  ``supports_scatter_gather`` (the disk tier's ``writev`` / ``readv``), again
  no copy; for other tiers through one reusable staging buffer per thread,
  with one vectorized row copy per batch between it and the host pool.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvsdk.backend import Backend
from kvsdk.config import KVSDKConfig
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.plugins.sglang.identity import ModelIdentity
from kvsdk.store.chain import Payload, TierChain
from kvsdk.trust import load_secret
from kvsdk.types import ChunkKey

STAGING_BYTES = 64 << 20
"""Largest staging buffer per thread; bigger batches are moved in slices."""
SMALL_ROW_BYTES = 16 << 10
"""Below this region size a batch gather uses numpy, above it torch (measured)."""


def _host_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of host memory at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def address(buf: Any) -> int:
    """Address of a contiguous bytes-like object's first byte."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data) if arr.size else 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor (contiguous, so no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data


def page_key_bytes(page_hash: str) -> bytes:
    """The bytes a page's chunk key is derived from: the whole page hash, tagged
    so a hex hash (its bytes) and any other string (its UTF-8, e.g. a suffixed
    ``"<hex>_k"``) never give the same bytes."""
    try:
        return b"x" + bytes.fromhex(page_hash)
    except (ValueError, TypeError):  # not a hex chain hash (e.g. a suffixed key)
        return b"s" + str(page_hash).encode()


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
    storage_config: HiCacheStorageConfig,
    config: KVSDKConfig,
    identity: ModelIdentity,
    host_pool: Any,
    geom: PageGeometry,
) -> Namespace:
    """The namespace that decides which pages are interchangeable: the model's
    identity (its weights, config, the settings that change what its KV means
    and SGLang's page hash), the page layout and geometry, and the rank."""
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
        model=identity.model,
        dtype=geom.dtype,
        groups=(GroupLayout(shape=(geom.page_bytes,), dtype="|u1", layout=layout),),
        tokens_per_chunk=geom.page_tokens,
        rank=0 if mla else int(storage_config.tp_rank),
        world_size=1 if mla else int(storage_config.tp_size),
        tenant_salt=config.tenant,
        extra=(*extra, *identity.extra),
        secret=load_secret(config.secret_file),
    )


class HostPages:
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

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor], nbytes: int) -> HostPages:
        """Contiguous CPU tensors as one-region pages of ``nbytes`` each (no copy:
        the caller keeps the tensors alive while the pages are in use)."""
        addrs = np.asarray([[address(tensor_bytes(t))] for t in tensors], dtype=np.int64)
        return cls(addrs, (nbytes,), None)

    def __len__(self) -> int:
        return int(self.addrs.shape[0])

    @property
    def regions(self) -> int:
        return int(self.addrs.shape[1])

    def subset(self, idx: Sequence[int]) -> HostPages:
        out = HostPages.__new__(HostPages)
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
        _scatter(address(src), self._regions(i))

    def _regions(self, i: int) -> list[tuple[int, int]]:
        return [(int(a), s) for a, s in zip(self.addrs[i], self.sizes)]


class PagePool:
    """A registered SGLang host pool: its geometry, and batches of its pages."""

    def __init__(self, host_pool: Any) -> None:
        self.host_pool = host_pool
        self.geometry = page_geometry(host_pool)
        self.rows = pool_rows(host_pool, self.geometry)
        """The pool's buffer as rows of one region (vectorized copies), or None."""
        self.mem = pool_mem(host_pool)
        self.local = threading.local()
        """Per thread: ``staging``, the reusable staging buffer."""

    def pages(self, host_indices: torch.Tensor, n: int) -> HostPages:
        """Where ``n`` pages at ``host_indices`` lie in the host pool."""
        geom = self.geometry
        if host_indices.numel() != n * geom.page_tokens:
            raise ValueError(
                f"{host_indices.numel()} host indices for {n} pages of {geom.page_tokens} tokens"
            )
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices)
        r = geom.regions
        if len(ptrs) != n * r:
            raise ValueError(f"{len(ptrs)} page regions for {n} pages of {r} regions")
        order = list(geom.order)
        got = np.asarray(sizes, dtype=np.int64).reshape(n, r)[:, order]
        if not bool((got == np.asarray(geom.region_sizes, dtype=np.int64)).all()):
            raise ValueError("page regions differ from the registered geometry")
        addrs = np.asarray(ptrs, dtype=np.int64).reshape(n, r)[:, order]
        return HostPages(addrs, geom.region_sizes, self.rows, self.mem)

    def new_page(self) -> torch.Tensor:
        """A fresh flat page tensor (for the generic API's reads without a target)."""
        page: torch.Tensor = self.host_pool.get_dummy_flat_data_page()
        return page

    def staging(self, nbytes: int) -> np.ndarray:
        """This thread's staging buffer, at least ``nbytes`` long."""
        buf: np.ndarray | None = getattr(self.local, "staging", None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self.local.staging = buf
        return buf

    # -- pages <-> tiers -----------------------------------------------------------------
    def read(self, chain: TierChain, keys: Sequence[ChunkKey], pages: HostPages) -> list[int]:
        """Read each page from the first tier serving it, into place; per page
        the tier it came from (-1: none). Pages a lower tier served are copied
        up the chain in the background."""
        step = max(1, STAGING_BYTES // pages.page_bytes)

        def read(tier: Backend, t: int, todo: list[int]) -> list[bool]:
            ok: list[bool] = []
            for s in range(0, len(todo), step):
                part = todo[s : s + step]
                ok += self._read_tier(chain, tier, t, [keys[i] for i in part], pages.subset(part))
            return ok

        where = chain.read_through(keys, read)
        for t in sorted({w for w in where if w > 1}):
            idx = [i for i, w in enumerate(where) if w == t]
            chain.copy_up(t, [keys[i] for i in idx], partial(_copies, pages.subset(idx)))
        return where

    def _read_tier(
        self, chain: TierChain, tier: Backend, t: int, keys: list[ChunkKey], pages: HostPages
    ) -> list[bool]:
        if pages.regions == 1:  # straight into place, no copy
            return chain.read_into(t, keys, pages.views())
        if tier.supports_scatter_gather or not tier.supports_get_into:
            # one scattered read into the regions (or the tier's own copies out of get)
            return chain.read_into_parts(t, keys, pages.parts())
        pb = pages.page_bytes
        staging = self.staging(len(keys) * pb)
        ok = chain.read_into(
            t, keys, [staging[i * pb : (i + 1) * pb].data for i in range(len(keys))]
        )
        pages.scatter(staging, [i for i, good in enumerate(ok) if good])
        return ok

    def write(self, chain: TierChain, keys: Sequence[ChunkKey], pages: HostPages) -> list[bool]:
        """Write pages through to every tier; per page whether one took it."""
        if pages.regions == 1:  # stored straight from host memory
            return chain.write_through(keys, pages.views())
        if any(tier.supports_scatter_gather for tier in chain.tiers):
            # written from the regions as they are (gathered by the tier)
            return chain.write_through(keys, pages.parts())
        out: list[bool] = []
        pb = pages.page_bytes
        step = max(1, STAGING_BYTES // pb)
        for s in range(0, len(keys), step):
            part = pages.subset(range(s, min(s + step, len(keys))))
            staging = self.staging(len(part) * pb)
            part.gather(staging)
            payloads = [staging[i * pb : (i + 1) * pb].data for i in range(len(part))]
            out += chain.write_through(keys[s : s + step], payloads)
        return out


def _copies(pages: HostPages) -> list[Payload]:
    """The pages' bytes, copied out (the host pages may be reused meanwhile)."""
    pb = pages.page_bytes
    data = np.empty(len(pages) * pb, dtype=np.uint8)
    pages.gather(data)
    return [data[i * pb : (i + 1) * pb].data for i in range(len(pages))]


def pool_rows(host_pool: Any, geom: PageGeometry) -> tuple[np.ndarray, int] | None:
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


def pool_mem(host_pool: Any) -> tuple[memoryview, int] | None:
    """The host pool's whole buffer as one writable byte view, with its address."""
    buf = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        return None
    flat = buf.reshape(-1).view(torch.uint8).numpy()
    return flat.data, int(buf.data_ptr())


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
