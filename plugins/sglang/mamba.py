"""A hybrid model's Mamba state pool as a HiCache side pool: its namespace, its
own tier chain, and moving states between the tiers and SGLang's ``MambaPoolHost``.

SGLang's ``HybridCacheController`` hands each side pool to
``register_mem_host_pool_v2`` and moves it with ``PoolTransfer`` batches
(``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``). A Mamba state pool
(one state per radix node keyed by its last page hash, ``TRAILING_PAGES``) is
served: states go to their own tier chain, in a namespace of the state shapes
and dtypes with the TP rank (states are TP-sharded, also beside MLA KV; every
rank writes its own), moved through the pool's flat page API;
``batch_exists_v2`` cuts the KV hit to the lengths whose trailing state is
stored (``restorable_prefix_pages``). Any other side pool (sliding-window
``swa``, indexer, DeepSeek-V4 compressed, draft) is refused at registration
with a :class:`~kvsdk.config.ConfigError`, which fails SGLang's attach; a
transfer for a pool not served is a miss.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvsdk.config import ConfigError, KVSDKConfig
from kvsdk.events import EventTracker
from kvsdk.keys import GroupLayout, Namespace, chunk_keys, epoch_fingerprint
from kvsdk.metrics import Metrics
from kvsdk.plugins.sglang.identity import ModelIdentity
from kvsdk.plugins.sglang.pages import HostPages, PagePool, page_key_bytes, tensor_bytes
from kvsdk.store.chain import TierChain
from kvsdk.store.factory import build_tiers
from kvsdk.trust import load_secret
from kvsdk.types import ChunkKey

Move = Callable[["MambaStates", list[str], list[int]], list[bool]]
"""Moves the states of ``keys`` between the tiers and these host slots; per key whether it moved."""


def serves_side_pool(host_pool: Any, host_pool_name: Any) -> bool:
    """Whether a v2 pool is a side pool kvsdk serves: True for a Mamba state
    pool, False for the KV pool (the anchor, served through v1); any other pool
    is a :class:`~kvsdk.config.ConfigError` (SGLang's attach fails)."""
    name = str(host_pool_name)
    if name == PoolName.KV.value:
        return False
    if (
        name != PoolName.MAMBA.value
        or not isinstance(host_pool, MambaPoolHost)
        or int(host_pool.page_size) != 1
    ):
        raise ConfigError(
            f"hicache pool {name!r} ({type(host_pool).__name__}): kvsdk's SGLang storage "
            "serves the KV pool and a hybrid model's Mamba state pool only, not this pool "
            "(sliding-window, indexer, compressed or draft pools are not supported)"
        )
    return True


@dataclass(eq=False)
class MambaStates:
    """SGLang's Mamba state host pool (one state per page key) and its tier chain."""

    host_pool: Any
    chain: TierChain
    namespace: Namespace
    key_fp: bytes  # the namespace's key-derivation key in this instance's epoch
    nbytes: int  # one state's bytes

    @classmethod
    def open(
        cls, host_pool: Any, namespace: Namespace, config: KVSDKConfig, metrics: Metrics
    ) -> MambaStates:
        """The states of ``host_pool`` over their own tiers (``config.tiers``)."""
        nbytes = int(host_pool.size_per_token)
        chain = TierChain(
            build_tiers(config, namespace, nbytes),
            metrics=metrics,
            events=EventTracker(enabled=False),  # events name KV pages only
            item_bytes=nbytes,
            copy_up=True,
        )
        return cls(host_pool, chain, namespace, namespace.fingerprint, nbytes)

    def keys(self, page_hashes: Sequence[str]) -> list[ChunkKey]:
        return chunk_keys(self.key_fp, [page_key_bytes(h) for h in page_hashes], 0)

    def new_epoch(self) -> None:
        """Move the state keys to a fresh random epoch (SGLang's cache flush)."""
        self.key_fp = epoch_fingerprint(self.namespace.fingerprint, os.urandom(16))

    def restorable(self, page_hashes: Sequence[str], kv: int, trailing: int) -> set[int]:
        """The prefix lengths (in pages, up to ``kv``) whose ``trailing`` last states are stored."""
        ckeys = self.keys(page_hashes[:kv])
        present = [w > 0 for w in self.chain.lookup(ckeys)] if ckeys else []
        return {p for p in range(1, kv + 1) if all(present[max(0, p - trailing) : p])}

    def read(self, pool: PagePool, keys: list[str], slots: list[int]) -> list[bool]:
        """Read the states of ``keys`` into host ``slots`` (through ``pool``'s staging)."""
        host = self.host_pool
        targets = [host.get_dummy_flat_data_page() for _ in keys]
        where = pool.read(self.chain, self.keys(keys), HostPages.of_tensors(targets, self.nbytes))
        ok = [w > 0 for w in where]
        for slot, page, hit in zip(slots, targets, ok):
            if hit:
                host.set_from_flat_data_page(slot, page)
        return ok

    def write(self, keys: list[str], slots: list[int]) -> list[bool]:
        """Store the states in host ``slots`` under ``keys``."""
        host = self.host_pool
        pages = [host.get_data_page(slot, flat=True).contiguous() for slot in slots]
        return self.chain.write_through(self.keys(keys), [tensor_bytes(p) for p in pages])

    def close(self) -> None:
        self.chain.close()


def mamba_namespace(
    storage_config: HiCacheStorageConfig,
    config: KVSDKConfig,
    identity: ModelIdentity,
    host_pool: Any,
    page_tokens: int,
) -> Namespace:
    """Which Mamba states are interchangeable: the model's identity (as the KV
    pages'), state shapes and dtypes, TP rank (states are TP-sharded, also
    beside MLA KV), PP stage, KV page size."""
    shapes = {
        "temporal": list(host_pool.temporal_state_shape),
        "conv": [list(c) for c in host_pool.conv_state_shapes],
        "layers": int(host_pool.num_mamba_layers),
        "extra": [[list(b.shape[1:]), str(b.dtype)] for b in host_pool.slot_state_device_tensors],
    }
    dtype = f"{host_pool.temporal_dtype}/{host_pool.conv_dtype}"
    return Namespace(
        model=identity.model,
        dtype=dtype,
        groups=(
            GroupLayout(
                shape=(int(host_pool.size_per_token),), dtype="|u1", layout=f"sglang/mamba/{shapes}"
            ),
        ),
        tokens_per_chunk=page_tokens,
        rank=int(storage_config.tp_rank),
        world_size=int(storage_config.tp_size),
        tenant_salt=config.tenant,
        extra=(
            ("engine", "sglang"),
            ("pool", "mamba"),
            ("pp", f"{storage_config.pp_rank}/{storage_config.pp_size}"),
            *identity.extra,
        ),
        secret=load_secret(config.secret_file),
    )


def _side(t: PoolTransfer, mamba: MambaStates | None) -> MambaStates | None:
    """The pool kvsdk serves for transfer ``t`` (None: a pool it does not store)."""
    return mamba if str(t.name) == PoolName.MAMBA.value else None


def restorable_prefix(
    keys: list[str], kv: int, transfers: Sequence[PoolTransfer], mamba: MambaStates | None
) -> PoolTransferResult:
    """The KV prefix of ``kv`` pages, cut to the lengths at which every side pool
    can restore its trailing pages (a Mamba state: the state at that page)."""
    restorable = set(range(1, kv + 1))
    hits: dict[str, int] = {PoolName.KV.value: kv} if kv else {}
    for t in transfers:
        side = _side(t, mamba)
        if side is None or t.hit_policy != PoolHitPolicy.TRAILING_PAGES:
            return PoolTransferResult(0, {})  # a pool kvsdk does not store: a miss
        ok = side.restorable(keys, kv, max(1, len(t.keys or ())))
        if ok:
            hits[str(t.name)] = max(ok)
        restorable &= ok
    order = sorted(restorable)
    return PoolTransferResult(order[-1] if order else 0, hits, order)


def each_side_transfer(
    transfers: list[PoolTransfer],
    mamba: MambaStates | None,
    move: Move,
    failure: Callable[[BaseException], None],
) -> dict[str, list[bool]]:
    """``move`` per transfer kvsdk serves; any other pool, or a failure, is a miss."""
    out: dict[str, list[bool]] = {}
    for t in transfers:
        keys, slots, side = _side_io(t, mamba)
        ok = [False] * len(keys)
        if side is not None and slots is not None:
            try:
                ok = move(side, keys, slots)
            except Exception as exc:
                failure(exc)
        out[str(t.name)] = ok
    return out


def _side_io(
    t: PoolTransfer, mamba: MambaStates | None
) -> tuple[list[str], list[int] | None, MambaStates | None]:
    """The keys, host slots and pool of a v2 transfer (slots None: unusable)."""
    keys = list(t.keys or ())
    side = _side(t, mamba)
    idx = t.host_indices
    if side is None or idx is None or int(idx.numel()) != len(keys):
        return keys, None, side
    return keys, [int(i) for i in idx.tolist()], side
