"""Tail-first eviction: of a chain's chunks stored or used together, the tail
leaves before the head (every prompt with the prefix needs its head), in the
policies, the host tier and the disk tier."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvsdk.config import load_config
from kvsdk.eviction import ARCPolicy, EvictionPolicy, LRUPolicy
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore

TPB = 4
SLOT = 256
NS = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)


def chain(name: str, n: int) -> list[bytes]:
    """A chain's chunk keys, head first."""
    return [f"{name}{i}".encode().ljust(16, b".") for i in range(n)]


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(capacity=8)], ids=["lru", "arc"])
def test_a_chain_inserted_together_loses_its_tail_first(
    make: Callable[[], EvictionPolicy],
) -> None:
    policy = make()
    a = chain("a", 4)
    policy.insert_many(a)
    assert policy.victims(2, lambda _k: True) == [a[3], a[2]]


def test_a_chain_used_together_keeps_its_head_most_recent() -> None:
    lru = LRUPolicy()
    a, b = chain("a", 3), chain("b", 3)
    lru.insert_many(a)
    lru.insert_many(b)
    lru.touch_many(a)  # a prompt with prefix a was served: a is the most recent now
    assert list(lru.candidates()) == [b[2], b[1], b[0], a[2], a[1], a[0]]


def store(slots: int, *lower: dict[str, object]) -> TieredStore:
    cfg = load_config(
        {"chunk_tokens": TPB, "tiers": [{"backend": "cpu", "capacity": slots * SLOT}, *lower]}
    )
    return build_store(cfg, NS, SLOT)


def save(s: TieredStore, keys: list[bytes]) -> list[bytes]:
    """Store ``keys`` as one step's store; the host entries it evicted."""
    before = set(s.host.iter_keys())
    plan = s.prepare_store(keys)
    assert plan is not None and list(plan.keys) == keys
    s.complete_store(keys)
    return sorted(before - set(s.host.iter_keys()))


def test_the_host_tier_evicts_a_chains_tail_before_its_head() -> None:
    s = store(8)
    a, b = chain("a", 4), chain("b", 4)
    save(s, a)
    save(s, b)
    assert save(s, chain("c", 2)) == sorted(a[2:])  # a is older than b: its tail goes
    s.prepare_load(b)  # a prompt with prefix b loads it: b's head is the most recent now
    s.complete_load(b)
    c = chain("c", 2)
    assert save(s, chain("d", 3)) == sorted([a[1], a[0], c[1]])  # b stays whole
    s.shutdown()


def test_the_disk_tier_evicts_a_chains_tail_before_its_head(tmp_path: Path) -> None:
    probe = store(8, {"backend": "disk", "path": str(tmp_path / "probe"), "capacity": "1MiB"})
    save(probe, chain("p", 1))
    probe.shutdown()  # (finishes the write-through)
    entry = int(probe.chain.tier(1).stats()["bytes_used"])
    s = store(16, {"backend": "disk", "path": str(tmp_path / "d"), "capacity": 6 * entry})
    disk = s.chain.tier(1)
    a = chain("a", 4)
    save(s, a)
    _drain(s)
    save(s, chain("b", 4))  # 8 chunks for 6 places: two of a go
    _drain(s)
    assert disk.exists(a) == [True, True, False, False]
    s.shutdown()


def _drain(s: TieredStore) -> None:
    deadline = time.monotonic() + 20
    while s.has_pending_work() and time.monotonic() < deadline:
        s.step()
        time.sleep(0.002)
    s.step()


def test_chunks_read_from_the_disk_are_reached_tail_first(tmp_path: Path) -> None:
    """A promotion reads a chain in one batch: the disk tier then holds its head
    as the most recent, so the next eviction there takes the tail."""
    probe = store(8, {"backend": "disk", "path": str(tmp_path / "probe"), "capacity": "1MiB"})
    save(probe, chain("p", 1))
    probe.shutdown()
    entry = int(probe.chain.tier(1).stats()["bytes_used"])
    s = store(16, {"backend": "disk", "path": str(tmp_path / "d"), "capacity": 6 * entry})
    disk = s.chain.tier(1)
    a, b = chain("a", 3), chain("b", 3)
    save(s, a)
    _drain(s)
    save(s, b)
    _drain(s)
    outs = [memoryview(np.zeros(SLOT, dtype=np.uint8)) for _ in a]
    assert s.chain.read_into(1, a, outs) == [True] * 3  # a used: b is the older now
    save(s, chain("c", 2))
    _drain(s)
    assert disk.exists(a) == [True] * 3
    assert disk.exists(b) == [True, False, False]
    s.shutdown()
