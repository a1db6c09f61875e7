"""Hybrid models' side pools through ``KVSDKStorage``, on SGLang's real classes.

SGLang 0.5.23 hands a hybrid model's side pools to a storage backend through
``register_mem_host_pool_v2`` (``HybridCacheController``) and moves them with
``PoolTransfer`` batches (``batch_exists_v2`` / ``batch_get_v2`` /
``batch_set_v2``). kvsdk serves the Mamba state pool (``MambaPoolHost``: one
state per page key, ``TRAILING_PAGES``) and refuses every other side pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.pool_host.group import PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang_rig import Rig, disk_config, kvsdk_extra_config, tokens_for

from kvsdk.config import ConfigError
from kvsdk.plugins.sglang import KVSDKStorage

TRAILING = PoolHitPolicy.TRAILING_PAGES


def kvsdk_rig(make_rig: Any, path: Path, **kw: Any) -> Rig:
    rig: Rig = make_rig(extra_config=kvsdk_extra_config(disk_config(path)), **kw)
    assert isinstance(rig.storage, KVSDKStorage)
    return rig


def mamba_host(ssm_heads: int = 4) -> MambaPoolHost:
    """SGLang's Mamba host pool over CPU 'device' checkpoints (2 layers, 9 slots)."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, 9, ssm_heads, 8, 8),
        conv=(torch.zeros(2, 9, 3, 40, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, layout="page_first")


def attach_mamba(rig: Rig, host: MambaPoolHost) -> None:
    """As SGLang attaches a dynamic side pool: through the controller."""
    rig.ctrl.register_host_pool_entry(
        PoolEntry(name=PoolName.MAMBA, host_pool=host, device_pool=None, layer_mapper=lambda i: i)
    )


def put_states(host: MambaPoolHost, n: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` host slots holding random state bytes; the slots and their pages."""
    g = torch.Generator().manual_seed(seed)
    slots = host.alloc(n)
    assert slots is not None
    pages = []
    for s in slots.tolist():
        page = torch.randint(0, 256, (host.size_per_token,), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(s, page)
        pages.append(host.get_data_page(s).clone())
    return slots, pages


def query(keys: list[str]) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)]


def test_mamba_states_round_trip_bitwise_beside_the_kv_pages(make_rig: Any, tmp_path: Path) -> None:
    rig = kvsdk_rig(make_rig, tmp_path)
    storage = rig.storage
    host = mamba_host()
    attach_mamba(rig, host)
    tokens = tokens_for(4, rig.page)
    hashes = rig.hashes(tokens)
    assert rig.backup(rig.fill(4, seed=3), tokens) == 4 * rig.page
    # states at the ends of pages 2 and 4 (one per radix node, keyed by its last page)
    slots, pages = put_states(host, 2, seed=5)
    for slot, key in zip(slots, (hashes[1], hashes[3])):
        t = PoolTransfer(PoolName.MAMBA, host_indices=slot.view(1), keys=[key], hit_policy=TRAILING)
        assert storage.batch_set_v2([t]) == {"mamba": [True]}
    r = storage.batch_exists_v2(hashes, query(hashes))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [2, 4])
    assert r.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    # a prefix that ends where no state was stored is cut back to one that has one
    r = storage.batch_exists_v2(hashes[:3], query(hashes[:3]))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (2, [2])
    # the states come back bitwise, each under its own page key
    new = host.alloc(3)
    assert new is not None
    got = storage.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=new[:2], keys=[hashes[3], hashes[1]])]
    )
    assert got == {"mamba": [True, True]}
    assert torch.equal(host.get_data_page(int(new[0])), pages[1])
    assert torch.equal(host.get_data_page(int(new[1])), pages[0])
    assert not torch.equal(pages[0], pages[1])
    # negative controls: a page without a state, and KV pages stored without states
    before = host.get_data_page(int(new[2])).clone()
    miss = storage.batch_get_v2(
        [PoolTransfer(PoolName.MAMBA, host_indices=new[2:], keys=[hashes[0]])]
    )
    assert miss == {"mamba": [False]} and torch.equal(host.get_data_page(int(new[2])), before)
    other = rig.hashes(tokens_for(3, rig.page, start=50_000))
    assert rig.backup(rig.fill(3, seed=4), tokens_for(3, rig.page, start=50_000)) == 3 * rig.page
    assert storage.batch_exists(other) == 3
    assert storage.batch_exists_v2(other, query(other)).kv_hit_pages == 0
    # flush: this instance sees neither pages nor states any more
    storage.clear()
    r = storage.batch_exists_v2(hashes, query(hashes))
    assert r.kv_hit_pages == 0


def test_mamba_states_survive_a_restart_and_never_cross_state_shapes(
    make_rig: Any, tmp_path: Path
) -> None:
    first = kvsdk_rig(make_rig, tmp_path)
    host = mamba_host()
    attach_mamba(first, host)
    tokens = tokens_for(2, first.page)
    hashes = first.hashes(tokens)
    assert first.backup(first.fill(2, seed=1), tokens) == 2 * first.page
    slots, pages = put_states(host, 1, seed=9)
    t = PoolTransfer(PoolName.MAMBA, host_indices=slots, keys=[hashes[1]], hit_policy=TRAILING)
    assert first.storage.batch_set_v2([t]) == {"mamba": [True]}
    first.close()
    # a new instance over the same disk tier reads the state back
    second = kvsdk_rig(make_rig, tmp_path)
    host2 = mamba_host()
    attach_mamba(second, host2)
    assert second.storage.batch_exists_v2(hashes, query(hashes)).kv_hit_pages == 2
    slot = host2.alloc(1)
    assert slot is not None
    t = PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=[hashes[1]])
    assert second.storage.batch_get_v2([t]) == {"mamba": [True]}
    assert torch.equal(host2.get_data_page(int(slot[0])), pages[0])
    # a model whose Mamba states have another shape gets nothing from them
    third = kvsdk_rig(make_rig, tmp_path)
    attach_mamba(third, mamba_host(ssm_heads=2))
    r = third.storage.batch_exists_v2(hashes, query(hashes))
    assert third.storage.batch_exists(hashes) == 2 and r.kv_hit_pages == 0


@pytest.mark.parametrize("name", [PoolName.SWA, PoolName.INDEXER, PoolName.DRAFT, PoolName.MAMBA])
def test_side_pools_kvsdk_does_not_serve_are_refused_at_attach(
    make_rig: Any, tmp_path: Path, name: PoolName
) -> None:
    """SGLang's real MHA host pool offered as a side pool (what a sliding-window
    model's SWA pool is) fails the attach with one sentence naming the pool."""
    rig = kvsdk_rig(make_rig, tmp_path)
    entry = build_pool_entry(
        name=name, host_pool=rig.host, device_pool=rig.kv,
        layer_mapping={i: i for i in range(rig.layers)}, transfer_layer_id_max=rig.layers,
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        rig.ctrl.register_host_pool_entry(entry)
    msg = str(err.value)
    assert f"'{name.value}'" in msg and "MHATokenToKVPoolHost" in msg and msg.count(".") <= 1
    # nothing of that pool is ever served
    t = PoolTransfer(name, host_indices=torch.tensor([0]), keys=["ab" * 32], hit_policy=TRAILING)
    assert rig.storage.batch_exists_v2(["ab" * 32], [t]).kv_hit_pages == 0
