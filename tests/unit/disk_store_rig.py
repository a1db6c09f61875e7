"""A small store for the core's unit tests: a host tier over a disk tier in a
test's directory, 4-token chunks of 256 bytes, and the scheduler over it."""

from __future__ import annotations

import time
from pathlib import Path

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import OffloadScheduler
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4
SLOT = 256
NS = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)


def store_on(disk: Path) -> TieredStore:
    cfg = load_config(
        {
            "chunk_tokens": TPB,
            "tiers": [
                {"backend": "cpu", "capacity": 16 * SLOT},
                {"backend": "disk", "path": str(disk), "capacity": "1MiB"},
            ],
        }
    )
    return build_store(cfg, NS, SLOT)


def scheduler_on(disk: Path) -> OffloadScheduler:
    return OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], NS, store_on(disk))


def pump(store: TieredStore) -> None:
    deadline = time.monotonic() + 20
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.002)
    store.step()
