"""A lookup that misses host RAM does not cost a request an engine step when the
slower tiers can answer at once: the scheduler waits for them up to
``lookup_wait_ms`` per step, and a tier with a local index answers a chunk it
surely lacks without being asked. A chunk that is there is still loaded."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.config import ConfigError, load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, Locality, Medium

TPB = 4
CHUNK_BYTES = 256
NS = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
GROUPS = [KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)]
PROMPT = list(range(10, 26))  # 16 tokens: 4 whole chunks, no tail
TIMEOUT_S = 20.0


def chain(tokens: list[int]) -> list[bytes]:
    out, prev = [], b""
    for b in range(len(tokens) // TPB):
        prev = hashlib.sha256(prev + bytes(tokens[b * TPB : (b + 1) * TPB])).digest()
        out.append(prev)
    return out


def add(s: OffloadScheduler, rid: str, prompt: list[int]) -> None:
    s.add_request(rid, num_prompt_tokens=len(prompt), block_hashes=chain(prompt),
                  prompt_token_ids=prompt)  # fmt: skip


def store_prompt(s: OffloadScheduler, rid: str, prompt: list[int]) -> None:
    """``prompt`` computed in one step and stored (its write-through started)."""
    add(s, rid, prompt)
    assert s.lookup(rid, 0) == 0
    n = len(prompt) // TPB
    jobs = s.build_step(computed_after_step={rid: len(prompt)},
                        new_block_ids={rid: [list(range(1, n + 1))]},
                        replace_block_ids=[rid])  # fmt: skip
    assert s.request_finished(rid, len(prompt)) is True
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    s.build_step(computed_after_step={}, finished={rid: len(prompt)})


def lookup_until_answered(s: OffloadScheduler, rid: str) -> tuple[int, int]:
    """(the hit, the steps it was deferred)."""
    steps = 0
    deadline = time.monotonic() + TIMEOUT_S
    while (hit := s.lookup(rid, 0)) is None:
        assert time.monotonic() < deadline, "the lookup was never answered"
        s.build_step(computed_after_step={})
        steps += 1
        time.sleep(0.002)
    return hit, steps


def disk_scheduler(path: Path, **config: Any) -> OffloadScheduler:
    """Over a disk tier; the wait is 200 ms unless ``config`` says otherwise (the
    default 5 ms is ample for an ``lstat``, not for one on a machine busy with
    other tests: the tests are about what happens within the wait)."""
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 16 * CHUNK_BYTES},
                {"backend": "disk", "path": str(path), "capacity": "1MiB"},
            ],
            "lookup_wait_ms": 200,
            **config,
        }
    )
    return OffloadScheduler(GROUPS, NS, build_store(cfg, NS, CHUNK_BYTES))


@pytest.fixture
def schedulers() -> Iterator[list[OffloadScheduler]]:
    made: list[OffloadScheduler] = []
    yield made
    for s in made:
        s.store.shutdown()


def test_a_prompt_no_tier_holds_is_scheduled_at_once_over_a_disk_tier(
    tmp_path: Path, schedulers: list[OffloadScheduler]
) -> None:
    """Under the defaults the disk answers within the step's wait: no deferral.
    With ``lookup_wait_ms: 0`` (the store never waits) the same request sits
    out a step: what the test would catch if the wait were gone."""
    s = disk_scheduler(tmp_path)
    schedulers.append(s)
    add(s, "new", PROMPT)
    assert s.lookup("new", 0) == 0
    never_waits = disk_scheduler(tmp_path / "other", lookup_wait_ms=0)
    schedulers.append(never_waits)
    add(never_waits, "new", PROMPT)
    assert never_waits.lookup("new", 0) is None
    hit, steps = lookup_until_answered(never_waits, "new")
    assert hit == 0 and steps >= 1


def test_a_prompt_another_instance_stored_on_the_disk_still_loads(
    tmp_path: Path, schedulers: list[OffloadScheduler]
) -> None:
    a, b = disk_scheduler(tmp_path), disk_scheduler(tmp_path)
    schedulers += [a, b]
    store_prompt(a, "w", PROMPT)
    a.store.shutdown()  # its writes to the disk are done
    schedulers.remove(a)
    add(b, "r", PROMPT)
    hit, steps = lookup_until_answered(b, "r")
    assert hit == len(PROMPT)
    assert steps >= 1  # promoted into host RAM between steps, then loaded
    add(b, "new", [t + 100 for t in PROMPT])
    assert b.lookup("new", 0) == 0


def test_the_config_names_a_bad_wait() -> None:
    with pytest.raises(ConfigError, match="lookup_wait_ms: got -1"):
        load_config({"lookup_wait_ms": -1})


# -- slow tiers, with and without a local index (the core alone) --------------------------


class SlowDict(Backend):
    """A slower tier whose ``exists`` takes ``delay_s``; with ``indexed``, a local
    index of its keys answers ``may_contain``."""

    name = "test-slow"
    medium = Medium.REMOTE
    locality = Locality.CLUSTER

    def __init__(self, delay_s: float, indexed: bool) -> None:
        self.data: dict[ChunkKey, bytes] = {}
        self.delay_s = delay_s
        self.exists_calls = 0
        self.lock = threading.Lock()
        self.supports_local_index = indexed  # type: ignore[misc]

    def may_contain(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self.data for k in keys]

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.exists_calls += 1
        time.sleep(self.delay_s)
        return [k in self.data for k in keys]

    get_delay_s = 0.0

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        time.sleep(self.get_delay_s)
        return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        with self.lock:
            for k, v in items:
                self.data[k] = bytes(v)
        return [True] * len(items)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    def clear(self) -> None:
        self.data.clear()


def slow_scheduler(tier: SlowDict, lookup_wait_s: float = 0.002) -> OffloadScheduler:
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=CHUNK_BYTES)
    host = CPUBackend(CPUOptions(capacity=16 * CHUNK_BYTES, pin_memory="never"), ctx)
    store = TieredStore(host, [tier], io_threads=2, lookup_wait_s=lookup_wait_s)
    return OffloadScheduler(GROUPS, NS, store)


def test_a_slow_tier_without_an_index_defers_and_the_wait_is_bounded(
    schedulers: list[OffloadScheduler],
) -> None:
    tier = SlowDict(delay_s=0.2, indexed=False)
    s = slow_scheduler(tier)
    schedulers.append(s)
    add(s, "new", PROMPT)
    start = time.perf_counter()
    assert s.lookup("new", 0) is None  # the tier did not answer within the wait
    assert time.perf_counter() - start < 0.1  # waited ~2 ms, never the tier's 200 ms
    assert lookup_until_answered(s, "new")[0] == 0
    s.store.flush_metrics()
    waits = s.store.metrics.snapshot()["counters"]
    assert any("kvsdk_lookup_waits_total" in k and "timed_out" in k for k in waits)


def test_a_slow_tier_with_a_local_index_answers_a_miss_at_once_and_still_loads_a_hit(
    schedulers: list[OffloadScheduler],
) -> None:
    tier = SlowDict(delay_s=0.2, indexed=True)
    writer = slow_scheduler(tier)
    schedulers.append(writer)
    store_prompt(writer, "w", PROMPT)
    deadline = time.monotonic() + TIMEOUT_S
    while len(tier.data) < len(PROMPT) // TPB:  # the write-through lands
        assert time.monotonic() < deadline
        writer.build_step(computed_after_step={})
        time.sleep(0.01)
    reader = slow_scheduler(tier)
    schedulers.append(reader)
    add(reader, "new", [t + 100 for t in PROMPT])
    calls = tier.exists_calls
    start = time.perf_counter()
    assert reader.lookup("new", 0) == 0  # the index says no chunk is there
    assert time.perf_counter() - start < 0.05
    assert tier.exists_calls == calls  # the tier itself was not asked
    add(reader, "r", PROMPT)
    hit, steps = lookup_until_answered(reader, "r")
    assert hit == len(PROMPT) and steps >= 1  # found, promoted, then loaded


def test_the_wait_for_a_promotion_is_bounded_by_the_engines_median_step() -> None:
    """A promotion that takes 1 s: the lookup waits about the engine's median
    step (20 ms), not the 250 ms cap, although one step, after an idle spell,
    took 2 s; then the request is deferred and loads once it has landed."""
    tier = SlowDict(delay_s=0.0, indexed=True)
    tier.get_delay_s = 1.0
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=CHUNK_BYTES)
    host = CPUBackend(CPUOptions(capacity=16 * CHUNK_BYTES, pin_memory="never"), ctx)
    store = TieredStore(host, [tier], io_threads=2, lookup_wait_s=0.2, promotion_wait_s=0.25)
    s = OffloadScheduler(GROUPS, NS, store)
    try:
        add(s, "w", PROMPT)  # the keys of the prompt, written to the slow tier
        assert s.lookup("w", 0) == 0  # (its keys derived; the tier's miss kept 1 s)
        (keys,) = s._requests["w"].keys
        for k in keys:
            tier.data[k] = bytes(CHUNK_BYTES)
        for pause in [0.02] * 7 + [2.0] + [0.02] * 7:
            s.build_step(computed_after_step={})
            time.sleep(pause)
        s.build_step(computed_after_step={})
        add(s, "r", PROMPT)
        start = time.perf_counter()
        assert s.lookup("r", 0) is None
        assert time.perf_counter() - start < 0.15
        hit, _ = lookup_until_answered(s, "r")
        assert hit == len(PROMPT)
    finally:
        store.shutdown()
