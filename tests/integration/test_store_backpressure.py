"""Store back-pressure on a real full disk: a disk tier on a small tmpfs
refuses writes with ENOSPC; after ``store_backoff.after_failures`` refused
batches kvsdk stops offering it stores (counted, a gauge says so), reads from
it go on, and once it has room a probe after the pause resumes the stores.

Mounting the tmpfs needs root (as on this project's machines and CI); without
it the test fails, naming what it needs."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult

pytestmark = pytest.mark.integration

TPB = 16
SLOT = 16 << 10
NS = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 128), "float32"),), TPB)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: about 15 chunks of 16 KiB fit."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        pytest.fail(f"mounting a 256 KiB tmpfs needs root: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def pump(store: TieredStore) -> None:
    deadline = time.monotonic() + 20
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.002)
    store.step()


def save(store: TieredStore, keys: list[bytes]) -> None:
    """Store ``keys`` in host RAM; each step's write-through is one batch to the disk."""
    plan = store.prepare_store(keys)
    assert plan is not None
    for slot, key in zip(plan.slots, plan.keys, strict=True):
        store.host.slab.numpy()[slot] = np.frombuffer(key * (SLOT // len(key)), dtype=np.uint8)
    store.complete_store(list(plan.keys))
    pump(store)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def paused(store: TieredStore) -> float:
    return next(v for n, lb, v in store.metrics.iter_gauges() if n == "kvsdk_store_paused")


def test_a_full_disk_gets_no_stores_for_a_while_reads_go_on_and_stores_resume(
    small_fs: Path,
) -> None:
    cfg = load_config(
        {
            "chunk_tokens": TPB,
            "store_backoff": {"after_failures": 3, "initial_s": 0.5, "max_s": 2},
            "tiers": [
                {"backend": "cpu", "capacity": 64 * SLOT},
                {"backend": "disk", "path": str(small_fs), "capacity": "16MiB"},
            ],
        }
    )
    store = build_store(cfg, NS, SLOT)
    disk = store.chain.tier(1)
    n = 0
    while disk.stats()["put_enospc"] < 1:  # fill the file system
        save(store, [key(n), key(n + 1)])
        n += 2
        assert n < 64, "the disk never filled"
    refused = disk.stats()["put_enospc"]
    for _ in range(10):  # refused batches, until the stores pause
        if paused(store):
            break
        save(store, [key(n)])
        n += 1
    assert paused(store) == 1, "the disk refused 10 batches and was still offered stores"
    assert store.metrics.counter("kvsdk_store_backoffs_total", tier=1) == 1
    refused = disk.stats()["put_enospc"]
    assert refused <= 1 + 3  # the batch that filled it, then after_failures refusals

    for _ in range(5):  # paused: the disk is not asked, the chunks are counted
        save(store, [key(n)])
        n += 1
    assert disk.stats()["put_enospc"] == refused
    assert store.metrics.counter("kvsdk_store_backoff_skipped_total", tier=1) == 5

    # reads go on: a chunk only the disk holds is promoted and served
    first = key(0)
    assert store.host.delete([first]) == 1
    for _ in range(200):
        if (got := store.lookup(first)) not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            break
        pump(store)
    assert got is LookupResult.HIT

    # room again: the first batch after the pause is a probe; taken, the back-off ends
    for f in list(small_fs.rglob("*.kvc"))[:6]:
        f.unlink()
    time.sleep(0.6)
    puts = disk.stats()["puts"]
    save(store, [key(n)])
    assert disk.stats()["puts"] == puts + 1
    assert paused(store) == 0
    save(store, [key(n + 1)])
    assert disk.stats()["puts"] == puts + 2
    store.shutdown()
