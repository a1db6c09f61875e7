"""A reset is a fence for the engine's workers: a host slot that a store or a
load in flight still copies into or out of is handed to nothing else (a new
store, a promotion from a slower tier) until the workers report that job,
and the job's late report is credited to no request.

The engine's workers are played by ``Worker`` below (the core is tested alone:
it copies between a dict of engine blocks and the host slab as a transfer
worker does, and holds a job as long as the test says)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from disk_store_rig import SLOT, TPB, pump, scheduler_on, store_on

from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.tiered import TieredStore
from kvsdk.transfer import Direction, TransferJob
from kvsdk.types import LookupResult


class Worker:
    """An engine worker: engine blocks of SLOT bytes, copied whole to and from slots."""

    def __init__(self, store: TieredStore) -> None:
        self.slab = store.host.slab.numpy()
        self.blocks: dict[int, np.ndarray] = {}

    def run(self, job: TransferJob) -> WorkerResult:
        for c in job.copies:
            for block, slot in zip(c.engine_blocks, c.slots, strict=True):
                if job.direction is Direction.STORE:
                    self.slab[slot] = self.blocks[block]
                else:
                    self.blocks[block] = self.slab[slot].copy()
        return WorkerResult(job.job_id)


def chain(n: int, salt: bytes) -> list[bytes]:
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


def lookup(s: OffloadScheduler, rid: str, hashes: list[bytes]) -> int:
    s.add_request(rid, num_prompt_tokens=len(hashes) * TPB + 1, block_hashes=hashes)
    for _ in range(500):
        if (hit := s.lookup(rid, 0)) is not None:
            return hit
        s.build_step(computed_after_step={})
        time.sleep(0.002)
    raise AssertionError("no answer")


def promote(store: TieredStore, keys: list[bytes]) -> None:
    """Another instance's chunks, found on the shared disk, come up into host slots."""
    for _ in range(500):
        if all(store.lookup(k) is LookupResult.HIT for k in keys):
            return
        pump(store)
    raise AssertionError("not promoted")


def others_chunks(disk: Path) -> tuple[list[bytes], list[np.ndarray]]:
    """Three chunks another instance wrote to the shared disk, and their bytes."""
    other = store_on(disk)
    keys = [bytes([0x70 + i]) * 16 for i in range(3)]
    values = [np.full(SLOT, 0x10 + i, dtype=np.uint8) for i in range(3)]
    plan = other.prepare_store(keys)
    assert plan is not None
    for slot, v in zip(plan.slots, values, strict=True):
        other.host.slab.numpy()[slot] = v
    other.complete_store(list(plan.keys))
    pump(other)
    other.shutdown()
    return keys, values


def test_a_store_in_flight_at_a_reset_keeps_its_slots_until_its_workers_report_it(
    tmp_path: Path,
) -> None:
    keys, values = others_chunks(tmp_path)
    s = scheduler_on(tmp_path)
    worker = Worker(s.store)
    for b in (1, 2, 3, 4):
        worker.blocks[b] = np.full(SLOT, 0xAA, dtype=np.uint8)
    assert lookup(s, "r1", chain(3, b"r1")) == 0
    jobs = s.build_step(
        computed_after_step={"r1": 13}, new_block_ids={"r1": [[1, 2, 3, 4]]},
        replace_block_ids=["r1"],
    )  # fmt: skip
    (store_job,) = jobs.stores  # the worker holds it: its copy is still under way
    held = {slot for c in store_job.copies for slot in c.slots}

    flush = s.reset()
    assert store_job.job_id in flush  # the workers are asked to finish it first
    assert s.has_pending_work()  # the engine keeps reporting until the fence opens
    promote(s.store, keys)  # the first thing after the reset to take host slots
    promoted = {s.store.host.slot_of(k) for k in keys}
    assert promoted.isdisjoint(held)

    assert not s.worker_results([worker.run(store_job)])  # its late copy lands now
    for k, v in zip(keys, values, strict=True):  # and wrote into no promoted chunk
        (got,) = s.store.host.get([k])
        assert got is not None and bytes(got) == v.tobytes()
    assert s.store.host.num_used == len(keys)  # its slots are free again
    assert not s.has_pending_work()
    assert s.num_tracked_requests() == 1  # r1 is still running; nothing was credited to it
    assert not s.ledger.has_jobs("r1")
    s.store.shutdown()


def test_a_load_in_flight_at_a_reset_reads_its_chunks_not_what_came_after(
    tmp_path: Path,
) -> None:
    keys, _ = others_chunks(tmp_path)
    s = scheduler_on(tmp_path)
    worker = Worker(s.store)
    stored = [np.full(SLOT, 0x30 + b, dtype=np.uint8) for b in (1, 2, 3)]
    for b, v in zip((1, 2, 3), stored, strict=True):
        worker.blocks[b] = v
    worker.blocks[4] = np.zeros(SLOT, dtype=np.uint8)
    hashes = chain(3, b"prompt")
    assert lookup(s, "r1", hashes) == 0
    jobs = s.build_step(
        computed_after_step={"r1": 13}, new_block_ids={"r1": [[1, 2, 3, 4]]},
        replace_block_ids=["r1"],
    )  # fmt: skip
    s.worker_results([worker.run(j) for j in jobs.stores])
    pump(s.store)  # written through to the disk: only the load holds the chunks now
    assert lookup(s, "r2", hashes) == 12
    s.allocated("r2", [[5, 6, 7, 8]], 12)
    (load_job,) = s.build_step(computed_after_step={}).loads  # held: still copying out

    s.reset()
    promote(s.store, keys)
    assert s.worker_results([worker.run(load_job)]) == set()
    for b, v in zip((5, 6, 7), stored, strict=True):
        assert worker.blocks[b].tobytes() == v.tobytes(), f"block {b} got other bytes"
    assert s.store.host.num_used == len(keys)
    assert not s.has_pending_work()
    s.store.shutdown()


def test_a_failed_load_reported_after_a_reset_still_names_its_engine_blocks(
    tmp_path: Path,
) -> None:
    s = scheduler_on(tmp_path)
    worker = Worker(s.store)
    for b in (1, 2, 3, 4):
        worker.blocks[b] = np.full(SLOT, b, dtype=np.uint8)
    hashes = chain(3, b"prompt")
    assert lookup(s, "r1", hashes) == 0
    jobs = s.build_step(
        computed_after_step={"r1": 13}, new_block_ids={"r1": [[1, 2, 3, 4]]},
        replace_block_ids=["r1"],
    )  # fmt: skip
    s.worker_results([worker.run(j) for j in jobs.stores])
    assert lookup(s, "r2", hashes) == 12
    s.allocated("r2", [[5, 6, 7, 8]], 12)
    (load_job,) = s.build_step(computed_after_step={}).loads
    s.reset()
    # the engine recomputes them rather than run on blocks the load never filled
    assert s.worker_results([WorkerResult(load_job.job_id, ok=False)]) == {5, 6, 7}
    pump(s.store)
    assert s.store.host.num_used == 0 and not s.has_pending_work()
    s.store.shutdown()
