"""A connector reset is scoped to the instance: it drops its own view (host
tier, in-flight state, its keys move to a new epoch) and leaves the shared
tiers to the other instances; the full wipe is ``kvsdk clear --yes``."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
from disk_store_rig import NS, SLOT, TPB, pump, scheduler_on, store_on

from kvsdk.cli import main
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult


def resolve(store: TieredStore, key: bytes) -> LookupResult:
    """The lookup's answer once the slower tiers answered."""
    for _ in range(200):
        r = store.lookup(key)
        if r not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            return r
        pump(store)
    raise AssertionError("no answer")


def save(store: TieredStore, keys: list[bytes]) -> None:
    plan = store.prepare_store(keys)
    assert plan is not None
    slab = store.host.slab.numpy()
    for i, slot in enumerate(plan.slots):
        slab[slot] = np.full(SLOT, i + 1, dtype=np.uint8)
    store.complete_store(list(plan.keys))
    pump(store)


def test_one_store_resets_the_other_still_hits_the_shared_disk(tmp_path: Path) -> None:
    a, b = store_on(tmp_path), store_on(tmp_path)
    keys = [bytes([i]) * 16 for i in range(3)]
    save(a, keys)
    assert [resolve(b, k) for k in keys] == [LookupResult.HIT] * 3

    a.reset()
    pump(a)
    assert a.host.num_used == 0
    fresh = store_on(tmp_path)  # a third instance: the disk still holds every chunk
    assert [resolve(fresh, k) for k in keys] == [LookupResult.HIT] * 3
    assert all(b.lookup(k) is LookupResult.HIT for k in keys)  # b's view is untouched
    for s in (a, b, fresh):
        s.shutdown()


def chain(n: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


def lookup(s: OffloadScheduler, rid: str, hashes: list[bytes]) -> int:
    s.add_request(rid, num_prompt_tokens=len(hashes) * TPB + 1, block_hashes=hashes)
    for _ in range(200):
        hit = s.lookup(rid, 0)
        if hit is not None:
            return hit
        s.build_step(computed_after_step={})
        time.sleep(0.002)
    raise AssertionError("no answer")


def store_prompt(s: OffloadScheduler, rid: str, hashes: list[bytes]) -> None:
    """A request computes its 13-token prompt, stores its 3 chunks and finishes."""
    assert lookup(s, rid, hashes) == 0
    jobs = s.build_step(
        computed_after_step={rid: 13}, new_block_ids={rid: [[1, 2, 3, 4]]},
        replace_block_ids=[rid],
    )  # fmt: skip
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    s.request_finished(rid, 13)
    s.build_step(computed_after_step={}, finished={rid: 13})


def test_after_a_reset_the_instance_is_served_nothing_from_before_and_others_still_are(
    tmp_path: Path,
) -> None:
    a, b = scheduler_on(tmp_path), scheduler_on(tmp_path)
    hashes = chain(3)
    store_prompt(a, "r1", hashes)
    pump(a.store)
    assert lookup(b, "r2", hashes) == 12

    a.reset()  # e.g. vLLM's reset after a weight update
    pump(a.store)
    assert lookup(a, "r3", hashes) == 0  # its own old chunks are not served to it
    c = scheduler_on(tmp_path)  # another instance still finds them on the shared disk
    assert lookup(c, "r4", hashes) == 12
    for s in (a, b, c):
        s.store.shutdown()


def test_kvsdk_clear_wipes_only_with_yes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = store_on(tmp_path / "cache")
    save(a, [bytes([i]) * 16 for i in range(3)])
    a.shutdown()
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(f"tiers:\n  - backend: cpu\n  - backend: disk\n    path: {tmp_path / 'cache'}\n")
    files = lambda: list((tmp_path / "cache").rglob("*.kvc"))  # noqa: E731
    assert len(files()) == 3
    assert main(["clear", str(cfg)]) == 2
    assert "--yes" in capsys.readouterr().err
    assert len(files()) == 3
    assert main(["clear", str(cfg), "--namespace", "00" * 16, "--yes"]) == 0
    assert len(files()) == 3  # another namespace: untouched
    assert main(["clear", str(cfg), "--namespace", NS.hex, "--yes"]) == 0
    assert "3 chunks deleted" in capsys.readouterr().out
    assert files() == []


def test_a_hit_promised_before_a_reset_is_never_loaded_after_it(tmp_path: Path) -> None:
    """vLLM looks up and allocates in one scheduler step, and resets between
    steps; a caller that allocates across a reset gets a clear error, never a
    load from chunks that left with the reset."""
    a = scheduler_on(tmp_path)
    hashes = chain(3)
    store_prompt(a, "r1", hashes)
    assert lookup(a, "r2", hashes) == 12
    a.reset()
    with pytest.raises(RuntimeError, match=r"promised before a reset; look it up again"):
        a.allocated("r2", [[5, 6, 7, 8]], 12)
    for _ in range(200):  # looked up again: a miss in the new epoch
        if (hit := a.lookup("r2", 0)) is not None:
            break
        a.build_step(computed_after_step={})
        time.sleep(0.002)
    assert hit == 0
    a.allocated("r2", [[5, 6, 7, 8]], 0)
    assert not a.build_step(computed_after_step={}).loads
    a.store.shutdown()
