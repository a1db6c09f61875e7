"""Host-tier hit latency with a disk and a Redis tier behind it vs the host tier alone.

The slower tiers must not tax hits: a lookup that hits host RAM, and the
prepare/complete-load around it, never touch disk or the network. Goal: <= 1.1x.

    .venv/bin/python benchmarks/bench_tier_hit.py [--redis-url URL]

Starts its own ``redis-server`` (see bench_redis.py) unless ``--redis-url`` is
given. Writes ``out/bench_tier_hit.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_redis import redis_server

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult

CHUNK = 64 << 10
N = 2048
NS = Namespace("bench", "float16", (GroupLayout((2, 16, 8, 128), "float16"),), 256)


def fill(store: TieredStore) -> list[bytes]:
    keys = [i.to_bytes(16, "little") for i in range(N)]
    slab = store.host.slab.numpy()
    for i in range(0, N, 64):
        plan = store.prepare_store(keys[i : i + 64])
        assert plan is not None
        for s in plan.slots:
            slab[s, :8] = np.frombuffer(s.to_bytes(8, "little"), dtype=np.uint8)
        store.complete_store(plan.keys)
    deadline = time.monotonic() + 120
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.002)
    return keys


def hit_seconds(store: TieredStore, keys: list[bytes], rounds: int) -> float:
    """Median time of one full pass: lookup every key (all hits) and load it."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for k in keys:
            assert store.lookup(k) is LookupResult.HIT
        for i in range(0, len(keys), 32):
            batch = keys[i : i + 32]
            store.prepare_load(batch)
            store.complete_load(batch)
        store.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="out/bench_tier_hit.json")
    args = ap.parse_args()
    host = {"backend": "cpu", "capacity": N * CHUNK}
    with redis_server(args.redis_url) as url, tempfile.TemporaryDirectory() as tmp:
        alone = build_store(load_config({"tiers": [host]}), NS, CHUNK)
        chain = build_store(
            load_config(
                {
                    "tiers": [
                        host,
                        {"backend": "disk", "path": tmp},
                        {"backend": "redis", "url": url},
                    ]
                }
            ),
            NS,
            CHUNK,
        )
        keys_a, keys_c = fill(alone), fill(chain)
        hit_seconds(alone, keys_a, 2)
        hit_seconds(chain, keys_c, 2)  # warm-up
        a_times, c_times = [], []
        for _ in range(3):  # interleave to share the machine's noise
            a_times.append(hit_seconds(alone, keys_a, args.rounds))
            c_times.append(hit_seconds(chain, keys_c, args.rounds))
        a, c = statistics.median(a_times), statistics.median(c_times)
        chain.shutdown()
        alone.shutdown()
    result = {
        "chunks": N,
        "host_alone_us_per_hit": 1e6 * a / N,
        "with_disk_and_redis_us_per_hit": 1e6 * c / N,
        "ratio": c / a,
        "goal": "<= 1.1",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"host tier alone:          {result['host_alone_us_per_hit']:.2f} µs per hit (lookup+load)"
    )
    print(f"with disk + redis behind: {result['with_disk_and_redis_us_per_hit']:.2f} µs per hit")
    print(f"ratio: {result['ratio']:.3f}x (goal <= 1.1)")


if __name__ == "__main__":
    main()
