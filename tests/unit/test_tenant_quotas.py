"""Per-tenant quotas on the host tier: a tenant over its share evicts its own
entries, never another tenant's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvsdk.config import ConfigError, load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.types import LookupResult

NS = Namespace("m", "uint8", (GroupLayout((1,), "uint8"),), 16)


def store_for(quotas: dict[str, float]) -> object:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": 20 * 64}], "tenant_quotas": quotas})
    return build_store(cfg, NS, 64)


def put(store: object, tenant: str, keys: list[bytes]) -> bool:
    plan = store.prepare_store(keys, tenant)  # type: ignore[attr-defined]
    if plan is None:
        return False
    store.complete_store(plan.keys)  # type: ignore[attr-defined]
    return True


def k(tenant: str, i: int) -> bytes:
    return f"{tenant}:{i}".encode().ljust(16, b".")


def test_a_tenant_over_its_share_evicts_only_its_own_chunks() -> None:
    s = store_for({"greedy": 0.25})  # 5 of 20 slots
    assert put(s, "calm", [k("calm", i) for i in range(10)])
    for i in range(40):  # the greedy tenant streams far more than its share
        assert put(s, "greedy", [k("greedy", i)])
    host = s.host  # type: ignore[attr-defined]
    assert host.usage("greedy") == 5
    assert all(s.lookup(k("calm", i)) is LookupResult.HIT for i in range(10))  # type: ignore[attr-defined]
    assert s.lookup(k("greedy", 39)) is LookupResult.HIT  # type: ignore[attr-defined]
    assert s.lookup(k("greedy", 0)) is LookupResult.MISS  # type: ignore[attr-defined]


def test_a_tenant_at_its_share_gives_up_its_least_recently_used_entry_never_a_pinned_one() -> None:
    s = store_for({"t": 0.15})  # 3 of 20 slots
    assert put(s, "calm", [k("calm", i) for i in range(10)])
    assert put(s, "t", [k("t", i) for i in range(3)])
    host = s.host  # type: ignore[attr-defined]
    s.touch([k("t", 0)])  # type: ignore[attr-defined]  # t:1 is now its least recently used
    host.pin([k("t", 1)])  # ...but a load reads it: t:2 goes
    assert put(s, "t", [k("t", 3)])
    assert [s.lookup(k("t", i)) is LookupResult.HIT for i in range(4)] == [True, True, False, True]  # type: ignore[attr-defined]
    host.unpin([k("t", 1)])
    assert put(s, "t", [k("t", 4)])
    assert s.lookup(k("t", 1)) is LookupResult.MISS  # type: ignore[attr-defined]
    host.pin([k("t", 0)])
    host.pin([k("t", 3)])
    host.pin([k("t", 4)])
    assert not put(s, "t", [k("t", 5)])  # all its own are pinned: refused, nobody else evicted
    assert all(s.lookup(k("calm", i)) is LookupResult.HIT for i in range(10))  # type: ignore[attr-defined]


def test_star_applies_to_unlisted_tenants_and_a_batch_larger_than_the_share_is_refused() -> None:
    s = store_for({"*": 0.1, "vip": 1.0})  # 2 slots for everyone but vip
    assert put(s, "t1", [k("t1", 0), k("t1", 1)])
    assert not put(s, "t1", [k("t1", i) for i in range(2, 5)])
    assert s.metrics.counter("kvsdk_allocation_failures_total") == 1  # type: ignore[attr-defined]
    assert put(s, "vip", [k("vip", i) for i in range(15)])


def test_quota_config_errors_name_the_tenant() -> None:
    with pytest.raises(ConfigError, match=r"tenant_quotas\.acme: got 1\.5"):
        load_config({"tenant_quotas": {"acme": 1.5}})
    with pytest.raises(ConfigError, match=r"tenant_quotas\.acme: got 'lots'"):
        load_config({"tenant_quotas": {"acme": "lots"}})


def test_a_tenant_over_its_share_of_a_slower_tier_loses_only_its_own_chunks_there(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 100 * 64},
                {"backend": "disk", "path": str(tmp_path), "capacity": 20 * 320},
            ],
            "tenant_quotas": {"greedy": 0.25},
        }
    )
    s = build_store(cfg, NS, 64)
    assert put(s, "calm", [k("calm", i) for i in range(10)])
    pump(s)
    for i in range(40):
        assert put(s, "greedy", [k("greedy", i)])
        pump(s)  # engine steps between stores: write-throughs land
    disk = s.tiers[1]
    on_disk = {
        key
        for key, there in zip(
            [k("calm", i) for i in range(10)] + [k("greedy", i) for i in range(40)],
            disk.exists([k("calm", i) for i in range(10)] + [k("greedy", i) for i in range(40)]),
            strict=True,
        )
        if there
    }
    assert {k("calm", i) for i in range(10)} <= on_disk
    assert len([key for key in on_disk if key.startswith(b"greedy")]) == 5  # 0.25 x 20
    s.shutdown()


def pump(store: object) -> None:
    deadline = time.monotonic() + 20
    while store.has_pending_work() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        store.step()  # type: ignore[attr-defined]
        time.sleep(0.002)
    store.step()  # type: ignore[attr-defined]


def test_rotating_salts_share_the_star_account_and_the_accounting_stays_bounded(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 20 * 64},
                {"backend": "disk", "path": str(tmp_path), "capacity": 20 * 320},
            ],
            "tenant_quotas": {"*": 0.25, "vip": 0.5},
        }
    )
    s = build_store(cfg, NS, 64)
    assert put(s, "vip", [k("vip", i) for i in range(8)])
    for i in range(200):  # a new cache_salt per request: one account for all of them
        assert put(s, f"salt{i}", [k(f"s{i}", 0)])
        pump(s)
    host = s.host
    assert host.usage("*") == 5  # 0.25 x 20 host slots, for every unlisted salt together
    assert host.usage("vip") == 8
    assert set(host._usage) == {"*", "vip"}  # (per-owner state: one per account)
    assert set(host._owner.values()) <= {"*", "vip"}
    assert {tenant for _, tenant in s._lower_owned} == {"*", "vip"}
    assert all(len(owned) <= 10 for owned in s._lower_owned.values())
    assert all(s.lookup(k("vip", i)) is LookupResult.HIT for i in range(8))
    s.shutdown()


def test_without_a_star_unlisted_salts_are_unlimited_but_share_one_account() -> None:
    s = store_for({"vip": 0.25})
    for i in range(15):
        assert put(s, f"salt{i}", [k(f"s{i}", 0)])
    host = s.host  # type: ignore[attr-defined]
    assert host.usage("*") == 15
    assert set(host._usage) == {"*"}
    assert s.quota_slots("salt3") is None  # type: ignore[attr-defined]


def promote(store: object, tenant: str, keys: list[bytes]) -> list[LookupResult]:
    """``tenant``'s requests look ``keys`` up until every answer is final (a HIT
    once the promotion from the slower tier landed, else a MISS)."""
    deadline = time.monotonic() + 20
    while True:
        found = [store.lookup(key, tenant) for key in keys]  # type: ignore[attr-defined]
        final = (LookupResult.HIT, LookupResult.MISS)
        if all(f in final for f in found) or time.monotonic() > deadline:
            return found
        pump(store)


@pytest.mark.parametrize("capped", ["small", ""])
def test_promotions_are_charged_to_the_requesting_tenant_within_its_quota(
    tmp_path: Path, capped: str
) -> None:
    """Write-through, eviction and promotion across two tenants: the capped one
    (4 of 16 host slots; also the unsalted tenant ``""``) brings back its own
    chunks from disk after they were evicted from host RAM, and still holds at
    most 4 slots; the other tenant keeps every one of its 8 chunks."""
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 16 * 64},
                {"backend": "disk", "path": str(tmp_path), "capacity": 100 * 320},
            ],
            "tenant_quotas": {capped: 0.25, "other": 0.5},
        }
    )
    s = build_store(cfg, NS, 64)
    theirs = [k("other", i) for i in range(8)]
    assert put(s, "other", theirs)  # the least recently used entries from here on
    pump(s)
    mine = [k("mine", i) for i in range(12)]
    for i in range(0, 12, 2):  # written through to disk, evicting its own earlier chunks
        assert put(s, capped, mine[i : i + 2])
        pump(s)
    host = s.host
    assert host.usage(capped) == 4 and host.usage("other") == 8

    found = promote(s, capped, mine[:8])  # 8 of its chunks, from disk
    assert LookupResult.HIT in found  # promotions happened...
    assert host.usage(capped) <= 4  # ...within its quota, charged to it and nobody else
    assert set(host._owner.values()) == {capped, "other"}
    assert host.usage("other") == 8
    assert all(s.lookup(key, "other") is LookupResult.HIT for key in theirs)
    assert s.metrics.counter("kvsdk_loaded_bytes_total", tier=1) > 0
    s.shutdown()
