"""Per-tier metrics: ``kvsdk_tier_info`` (each tier's configuration as labels,
never a path, URL or secret), the promotion-latency histogram, and gauges
published for several processes through Prometheus' multiprocess directory
(as vLLM's ``--api-server-count N`` serves them): each value counted once,
and a process that ended drops out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from disk_store_rig import SLOT, pump, store_on
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvsdk.types import LookupResult


def test_tier_info_names_each_tiers_configuration_and_nothing_secret(tmp_path: Path) -> None:
    store = store_on(tmp_path / "cache")
    info = [dict(lb) for n, lb, v in store.metrics.iter_gauges() if n == "kvsdk_tier_info"]
    assert info == [
        {"tier": "0", "backend": "cpu", "medium": "cpu", "locality": "process",
         "capacity_bytes": str(16 * SLOT), "chunk_bytes": str(SLOT)},
        {"tier": "1", "backend": "disk", "medium": "disk", "locality": "node",
         "capacity_bytes": str(1 << 20), "chunk_bytes": str(SLOT)},
    ]  # fmt: skip
    assert not any(str(tmp_path) in v for labels in info for v in labels.values())
    store.shutdown()
    assert not [n for n, _, _ in store.metrics.iter_gauges() if n == "kvsdk_tier_info"]


def test_promotion_latency_is_timed_from_the_lookup_to_the_chunk_readable(
    tmp_path: Path,
) -> None:
    writer = store_on(tmp_path)
    keys = [bytes([i]) * 16 for i in range(3)]
    plan = writer.prepare_store(keys)
    assert plan is not None
    for slot in plan.slots:
        writer.host.slab.numpy()[slot] = np.full(SLOT, 7, dtype=np.uint8)
    writer.complete_store(keys)
    pump(writer)
    writer.shutdown()

    reader = store_on(tmp_path)
    asked = time.monotonic()
    assert all(reader.lookup(k) is LookupResult.RETRY for k in keys)
    time.sleep(0.05)  # the lookups' wait is part of the promotion's time
    while not all(reader.lookup(k) is LookupResult.HIT for k in keys):
        pump(reader)
        assert time.monotonic() - asked < 20
    took = time.monotonic() - asked
    ((labels, h),) = [
        (lb, h) for n, lb, h in reader.metrics.iter_histograms() if n == "kvsdk_promotion_seconds"
    ]
    assert dict(labels) == {"tier": "1"} and h.n == 3
    assert 3 * 0.05 <= h.total <= 3 * took
    reader.shutdown()


WRITER = textwrap.dedent(
    """
    import sys
    from kvsdk.config import load_config
    from kvsdk.keys import GroupLayout, Namespace
    from kvsdk.store.factory import build_store

    ns = Namespace("m", "float32", (GroupLayout((2, 4, 1, 8), "float32"),), 4)
    cfg = load_config({"chunk_tokens": 4, "tiers": [
        {"backend": "cpu", "capacity": 4096},
        {"backend": "disk", "path": sys.argv[1], "capacity": "1MiB"}]})
    store = build_store(cfg, ns, 256)
    if sys.argv[2] == "paused":
        for _ in range(cfg.store_backoff.after_failures):
            store.chain.backoff.written(1, False)
    store._published.publish()
    print("published", flush=True)
    sys.stdin.readline()
    store.shutdown()
    """
)


def collect(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What an API server serving ``/metrics`` from ``path`` reports."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name.startswith("kvsdk_")
    }


def test_two_engine_processes_publish_gauges_counted_once_and_a_dead_one_drops_out(
    tmp_path: Path,
) -> None:
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / name), state],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, state in (("a", "paused"), ("b", "up"))
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "published"
        seen = collect(mp)
        info = {k: v for k, v in seen.items() if k[0] == "kvsdk_tier_info"}
        assert len(info) == 2 and set(info.values()) == {1.0}  # one series per tier, =1
        assert seen[("kvsdk_store_paused", (("tier", "1"),))] == 1.0  # one engine paused it
        entries = {k: v for k, v in seen.items() if ("stat", "entries") in k[1]}
        pids = {dict(k[1])["pid"] for k in entries}
        assert pids == {str(p.pid) for p in procs}  # each engine's own view, none summed

        a = procs[0]
        assert a.stdin is not None
        a.stdin.write("\n")
        a.stdin.flush()
        assert a.wait(30) == 0
        seen = collect(mp)
        assert seen[("kvsdk_store_paused", (("tier", "1"),))] == 0.0  # the live one's
        pids = {dict(k[1])["pid"] for k in seen if ("stat", "entries") in k[1]}
        assert pids == {str(procs[1].pid)}
    finally:
        for p in procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(30)
