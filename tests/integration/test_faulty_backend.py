"""The ``faulty`` wrapper tier: reproducible fault injection around a real disk tier,
and through the tiered store: injected faults become misses, never wrong bytes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsdk.backend import TierContext
from kvsdk.config import ConfigError, build_tier_config, load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.plugins_manager import backends
from kvsdk.store.factory import build_store
from kvsdk.types import LookupResult

NS = Namespace("m", "float32", (GroupLayout((4,), "float32"),), 16)
CHUNK = 4096


def faulty(tmp_path: Path, **rates: Any) -> Any:
    cfg = build_tier_config(
        {"backend": "faulty", "wraps": {"backend": "disk", "path": str(tmp_path)}, **rates}, "t"
    )
    ctx = TierContext(NS.fingerprint, NS.hex, CHUNK, tier_index=1)
    return backends()["faulty"](cfg.options, ctx)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()


def test_config_errors_name_the_wrapper_key() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\].*error_rate.*1.5"):
        load_config(
            {
                "tiers": [
                    {"backend": "cpu", "capacity": "1MiB"},
                    {
                        "backend": "faulty",
                        "error_rate": 1.5,
                        "wraps": {"backend": "disk", "path": "/tmp/x"},
                    },
                ]
            }
        )
    with pytest.raises(ConfigError, match="wraps"):
        load_config({"tiers": [{"backend": "cpu"}, {"backend": "faulty"}]})
    with pytest.raises(ConfigError, match=r"wraps.*capcity"):
        load_config(
            {
                "tiers": [
                    {"backend": "cpu"},
                    {
                        "backend": "faulty",
                        "wraps": {"backend": "disk", "path": "/tmp/x", "capcity": "1GiB"},
                    },
                ]
            }
        )


def test_corrupted_and_truncated_reads_are_caught_by_the_frame_checks(tmp_path: Path) -> None:
    b = faulty(tmp_path, corrupt_read_rate=1.0)
    items = [(key(i), payload(i)) for i in range(20)]
    assert all(b.put(items))
    assert b.get([k for k, _ in items]) == [None] * 20
    assert b.injected["caught_by_checks"] == 20
    t = faulty(tmp_path, truncate_rate=1.0)
    assert t.get([k for k, _ in items]) == [None] * 20
    clean = faulty(tmp_path)
    assert [bytes(v) for v in clean.get([k for k, _ in items])] == [v for _, v in items]


def test_faults_replay_exactly_from_the_seed(tmp_path: Path) -> None:
    def run(sub: str) -> dict[str, int]:
        b = faulty(
            tmp_path / sub, seed=3, error_rate=0.2, drop_write_rate=0.3, corrupt_read_rate=0.3
        )
        for i in range(30):
            try:
                b.put([(key(i), payload(i))])
                b.get([key(i)])
            except Exception:
                pass
        return dict(b.injected)

    assert run("a") == run("b")
    assert sum(run("c").values()) > 10


def test_tiered_store_over_a_faulty_tier_never_loads_wrong_bytes(tmp_path: Path) -> None:
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 8 * CHUNK},  # tiny: most hits come from below
                {
                    "backend": "faulty",
                    "seed": 1,
                    "error_rate": 0.1,
                    "timeout_rate": 0.05,
                    "timeout_ms": 20,
                    "drop_write_rate": 0.1,
                    "corrupt_read_rate": 0.2,
                    "truncate_rate": 0.1,
                    "wraps": {"backend": "disk", "path": str(tmp_path)},
                },
            ]
        }
    )
    store = build_store(cfg, NS, CHUNK)
    slab = store.host.slab.numpy()
    n = 60
    for i in range(n):  # store every chunk (write-through to the faulty tier)
        plan = store.prepare_store([key(i)])
        assert plan is not None and plan.keys
        slab[plan.slots[0]] = np.frombuffer(payload(i), dtype=np.uint8)
        store.complete_store(plan.keys, ok=True)
        while store.has_pending_work():
            store.step()
            time.sleep(0.001)
    hits = wrong = 0
    for _round in range(3):
        for i in range(n):
            deadline = time.monotonic() + 5
            r = store.lookup(key(i))
            while (
                r in (LookupResult.RETRY, LookupResult.HIT_PENDING) and time.monotonic() < deadline
            ):
                store.step()
                time.sleep(0.002)
                r = store.lookup(key(i))
            if r is LookupResult.HIT:
                (slot,) = store.prepare_load([key(i)])
                hits += 1
                wrong += bytes(slab[slot]) != payload(i)
                store.complete_load([key(i)])
    faults = store.tiers[1].injected
    store.shutdown()
    assert wrong == 0
    assert hits > n // 3  # promotions happened despite the faults
    assert faults["caught_by_checks"] > 0 and faults["dropped_write"] > 0 and faults["error"] > 0
    assert store.metrics.counter("kvsdk_backend_errors_total") > 0


def bare_disk(tmp_path: Path) -> Any:
    cfg = build_tier_config({"backend": "disk", "path": str(tmp_path)}, "t")
    return backends()["disk"](cfg.options, TierContext(NS.fingerprint, NS.hex, CHUNK))


def test_the_wrapper_is_transparent_over_what_a_bare_tier_wrote(tmp_path: Path) -> None:
    """A restart through the wrapper at rate 0 sees exactly what the bare tier
    wrote (listing, index, get, get_into, capabilities); the wrapper's own writes
    are the bare tier's frames."""
    items = [(key(i), payload(i)) for i in range(7)]
    bare = bare_disk(tmp_path)
    assert bare.put(items[:4]) == [True] * 4
    bare.close()
    wrapped = faulty(tmp_path)
    assert wrapped.put(items[4:]) == [True] * 3
    wrapped.close()

    restarted = faulty(tmp_path)
    bare = bare_disk(tmp_path)
    keys = [k for k, _ in items]
    for flag in ("supports_listing", "supports_get_into", "supports_scatter_gather"):
        assert getattr(restarted, flag) == getattr(bare, flag) is True, flag
    assert sorted(restarted.iter_keys()) == sorted(bare.iter_keys()) == sorted(keys)
    assert [bytes(v) for v in restarted.get(keys)] == [v for _, v in items]
    assert [bytes(v) for v in bare.get(keys)] == [v for _, v in items]
    slots = [memoryview(bytearray(CHUNK)) for _ in keys]
    assert restarted.get_into(keys, slots) == [True] * 7
    assert [bytes(s) for s in slots] == [v for _, v in items]


def test_faults_over_persisted_data_lose_hits_never_bytes(tmp_path: Path) -> None:
    items = [(key(i), payload(i)) for i in range(40)]
    bare = bare_disk(tmp_path)
    assert all(bare.put(items))
    bare.close()
    restarted = faulty(tmp_path, seed=3, corrupt_read_rate=0.3, truncate_rate=0.2)
    got = restarted.get([k for k, _ in items])
    hits = [i for i, v in enumerate(got) if v is not None]
    assert 0 < len(hits) < len(items)
    assert all(bytes(got[i]) == items[i][1] for i in hits)  # type: ignore[arg-type]
    assert restarted.injected["caught_by_checks"] == len(items) - len(hits)
