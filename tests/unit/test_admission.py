"""Second-sight admission: every chunk stored while chunks come back, only repeats
when none do, and every chunk again once they do (``kvsdk.admission``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsdk.admission import HIGH_REUSE, LOW_REUSE, WARMUP_CHUNKS, WARMUP_PROMPTS, SecondSight
from kvsdk.config import ConfigError, load_config
from kvsdk.keys import Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore

SLOT = 32
NS = Namespace(model="m", dtype="bf16", groups=(), tokens_per_chunk=16)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def offer_fresh(sight: SecondSight, start: int, n: int) -> list[bytes]:
    """Offer ``n`` never-seen chunks one per call, prompts of 8; the admitted ones."""
    out: list[bytes] = []
    for i in range(start, start + n):
        out += sight.admit(0, [k(i)], prompts=int(i % 8 == 0))
    return out


def test_every_chunk_is_stored_until_the_warmup_then_only_repeats() -> None:
    sight = SecondSight(memory=10_000)
    assert offer_fresh(sight, 0, WARMUP_CHUNKS - 1) == [k(i) for i in range(WARMUP_CHUNKS - 1)]
    assert not sight.selective
    offer_fresh(sight, WARMUP_CHUNKS - 1, 1)
    assert sight.selective and sight.reuse == 0.0
    assert offer_fresh(sight, 1000, 50) == []
    assert sight.take_skipped() == 50 and sight.skipped == 0
    # a chunk offered before (stored or not) is stored on its second sight
    assert sight.admit(0, [k(1000), k(5000)]) == [k(1000)]


def test_chunks_coming_back_turn_every_chunk_storing_on_again() -> None:
    sight = SecondSight(memory=10_000)
    offer_fresh(sight, 0, 2 * WARMUP_CHUNKS)
    assert sight.selective
    i = 0
    while sight.selective:  # a repeated prompt: its chunks come back
        assert sight.admit(0, [k(i)]) == [k(i)]
        i += 1
    assert sight.reuse >= HIGH_REUSE
    assert i < 2 * WARMUP_CHUNKS
    assert sight.admit(0, [k(9999)]) == [k(9999)]  # a fresh one is stored again


def test_chunks_held_or_served_count_as_coming_back() -> None:
    held = SecondSight(memory=10_000)
    served = SecondSight(memory=10_000)
    for i in range(10 * WARMUP_CHUNKS):  # one in 16 already stored, or loaded from the tier
        held.admit(1 if i % 16 == 0 else 0, [k(i)], prompts=1)
        if i % 16 == 0:
            served.served(1)
        served.admit(0, [k(i)], prompts=1)
    assert not held.selective and not served.selective
    assert held.reuse > LOW_REUSE and served.reuse > LOW_REUSE


def test_the_share_follows_recent_traffic_and_has_hysteresis() -> None:
    sight = SecondSight(memory=100_000)
    for i in range(4000):  # 1 in 20 back: between the two thresholds, from every-chunk mode
        sight.admit(1 if i % 20 == 0 else 0, [k(i)], prompts=1)
    assert not sight.selective
    offer_fresh(sight, 10_000, 4000)  # then nothing comes back
    assert sight.selective
    for i in range(4000):  # 1 in 20 again: stays selective (under HIGH_REUSE)
        sight.admit(1 if i % 20 == 0 else 0, [k(20_000 + i)], prompts=1)
    assert sight.selective


def test_no_decision_before_enough_prompts() -> None:
    sight = SecondSight(memory=10_000)
    for i in range(WARMUP_PROMPTS - 1):  # a few long fresh prompts: not enough evidence
        assert len(sight.admit(0, [k(1000 * i + c) for c in range(100)], prompts=1)) == 100
    assert not sight.selective
    sight.admit(0, [k(9000 + c) for c in range(100)], prompts=1)
    assert sight.selective


def test_the_memory_of_keys_is_bounded() -> None:
    sight = SecondSight(memory=100)
    offer_fresh(sight, 0, 1000)
    assert len(sight._ghost) == 100
    assert sight.admit(0, [k(0)]) == []  # forgotten: a first sight again
    assert sight.admit(0, [k(999)]) == [k(999)]


# -- in the store, from the config ----------------------------------------------------------------


@pytest.fixture
def made() -> Iterator[list[TieredStore]]:
    stores: list[TieredStore] = []
    yield stores
    for s in stores:
        s.shutdown()


def store_from(
    made: list[TieredStore],
    admission: dict[str, object] | None = None,
    tiers: list[dict[str, object]] | None = None,
) -> TieredStore:
    raw: dict[str, object] = {
        "chunk_tokens": 16,
        "tiers": tiers or [{"backend": "cpu", "capacity": 1024 * SLOT, "pin_memory": "never"}],
    }
    if admission is not None:
        raw["admission"] = admission
    store = build_store(load_config(raw), NS, SLOT)
    made.append(store)
    return store


def save(store: TieredStore, keys: list[bytes]) -> list[bytes]:
    keys, _ = store.admit(keys, prompts=1)
    plan = store.prepare_store(keys)
    assert plan is not None
    slab = store.host.slab.numpy()
    for slot in plan.slots:
        slab[slot] = np.full(SLOT, 7, dtype=np.uint8)
    store.complete_store(plan.keys)
    return list(plan.keys)


def test_the_default_host_tier_stores_fresh_prompts_only_until_none_come_back(
    made: list[TieredStore],
) -> None:
    store = store_from(made)
    assert store.second_sight is not None
    stored = [key for p in range(20) for key in save(store, [k(100 * p + c) for c in range(8)])]
    assert len(stored) == WARMUP_CHUNKS  # 8 prompts of 8 chunks, then nothing
    store.step()
    assert store.metrics.counter("kvsdk_admission_skipped_total") == 12 * 8
    # a prompt that comes back is stored now, and its repeat is a hit
    assert save(store, [k(1900 + c) for c in range(8)]) == [k(1900 + c) for c in range(8)]
    assert store.lookup_run([k(1900 + c) for c in range(8)], 0, 8) == (8, 8)


def test_a_reset_of_the_store_decides_admission_afresh(made: list[TieredStore]) -> None:
    store = store_from(made)
    assert store.second_sight is not None
    for p in range(20):
        save(store, [k(100 * p + c) for c in range(8)])
    assert store.second_sight.selective
    store.reset()  # e.g. vLLM's reset_prefix_cache(reset_connector=True)
    assert not store.second_sight.selective and store.second_sight.reuse == 0.0
    # every chunk is stored again until the warm-up's evidence is in
    assert save(store, [k(5000 + c) for c in range(8)]) == [k(5000 + c) for c in range(8)]


def test_policy_all_and_shared_tiers_store_every_chunk(
    made: list[TieredStore], tmp_path: Path
) -> None:
    everything = store_from(made, {"policy": "all"})
    disk = store_from(
        made,
        tiers=[
            {"backend": "cpu", "capacity": 1024 * SLOT, "pin_memory": "never"},
            {"backend": "disk", "path": str(tmp_path), "capacity": "1MiB"},
        ],
    )
    forced = store_from(
        made,
        {"policy": "second_sight"},
        tiers=[
            {"backend": "cpu", "capacity": 1024 * SLOT, "pin_memory": "never"},
            {"backend": "disk", "path": str(tmp_path / "2"), "capacity": "1MiB"},
        ],
    )
    assert everything.second_sight is None and disk.second_sight is None
    assert forced.second_sight is not None
    for store in (everything, disk):
        stored = [key for p in range(20) for key in save(store, [k(100 * p + c) for c in range(8)])]
        assert len(stored) == 160


def test_a_bad_policy_names_the_key_and_the_choices() -> None:
    with pytest.raises(
        ConfigError,
        match=r"admission.policy: got 'sometimes'; expected one of: "
        r"auto, second_sight, all",
    ):
        load_config({"admission": {"policy": "sometimes"}})
