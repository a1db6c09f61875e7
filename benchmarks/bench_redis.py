"""Redis tier throughput vs raw pipelined redis-py of the same bytes: one node, a
3-node Cluster, and the tiered store end to end.

Both sides move the same payloads to and from the same server(s) in the same
process, batch by batch as the tiered store's I/O threads do:

- ``node`` / ``cluster``: the baseline (``raw_pipelined``) sends each batch as
  one redis-py pipeline of ``SET``\\ s (a ``RedisCluster`` pipeline on the
  Cluster), then reads it back with one pipeline of ``GET``\\ s, holding each
  batch of values; the tier does ``put`` then ``get`` of the same batches
  (framing, checksum, namespace-prefixed keys, verification of every value
  read back, circuit breaker, local index included). Goal >= 0.9.
- ``store``: a ``cpu -> redis`` tiered store writes the chunks through from
  host slots (prepare/complete store, then steps until the write-through
  ended), and a second store (another engine's, its own empty host tier)
  looks them up and promotes them into its slots (lookups and steps until
  every one is a hit), bytes checked; against the raw SET and GET pipelines.
  Goal >= 0.8.

The figure is baseline seconds / tier seconds (1.0 = as fast as raw redis-py),
reported as the median of the per-repeat ratios: each repeat runs both back
to back, so drift in the machine's load hits both alike. The database is
flushed before every run.

Starts its own ``redis-server`` (and Cluster) on free loopback ports
(persistence off) unless ``--url`` names one (its database is flushed!; not
for ``cluster``).

    python benchmarks/bench_redis.py [--mode all|node|cluster|store] [--chunks 64] \\
        [--chunk-kib 1024] [--batch 16] [--repeats 7] [--url redis://...] \\
        [--out out/bench_redis.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis.cluster import RedisCluster

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.chunk_format import DEFAULT_CHECKSUM, HEADER_SIZE
from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.types import LookupResult

NS = hashlib.blake2b(b"bench-redis", digest_size=16).digest()
STORE_NS = Namespace("bench-redis", "float16", (GroupLayout((2, 16, 8, 128), "float16"),), 256)


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    """``url`` as given, or a throwaway ``redis-server`` on a free loopback port."""
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: install it (apt-get install redis-server) "
                         "or pass --url")  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="kvsdk-bench-redis-") as tmp:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", tmp, "--logfile", str(Path(tmp) / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"redis-server on port {port} did not start") from None
                    time.sleep(0.02)
            client.close()
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=10)


def raw_pipelined(client: Any, keys: list[bytes], payloads: list[bytes], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for k, p in zip(keys[i : i + batch], payloads[i : i + batch]):
            pipe.set(k, p)
        assert all(r is True for r in pipe.execute())
    total = 0
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for k in keys[i : i + batch]:
            pipe.get(k)
        held = pipe.execute()
        total += sum(len(v) for v in held)
    elapsed = time.perf_counter() - start
    assert total == sum(len(p) for p in payloads)
    return elapsed


def tier(backend: RedisBackend, keys: list[bytes], payloads: list[bytes], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        assert all(backend.put(list(zip(keys[i : i + batch], payloads[i : i + batch]))))
    total = 0
    for i in range(0, len(keys), batch):
        held = backend.get(keys[i : i + batch])
        assert all(v is not None for v in held)
        total += sum(len(v) for v in held if v is not None)
    elapsed = time.perf_counter() - start
    assert total == sum(len(p) for p in payloads)
    return elapsed


@contextlib.contextmanager
def redis_cluster() -> Iterator[str]:
    """A throwaway 3-node Cluster (tests/integration/redis_server.py's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from redis_server import start_cluster

    with tempfile.TemporaryDirectory(prefix="kvsdk-bench-cluster-") as tmp:
        cluster = start_cluster(Path(tmp))
        try:
            yield cluster.url
        finally:
            for node in cluster.nodes:
                node.kill()


def paired(runs: dict[str, list[float]], repeats: int, one: dict[str, Callable[[], float]]) -> None:
    """``repeats`` runs of each variant of ``one``, back to back, order alternating."""
    for rep in range(repeats):
        order = list(one) if rep % 2 == 0 else list(reversed(one))  # no order bias
        for name in order:
            runs.setdefault(name, []).append(one[name]())


def tier_vs_raw(url: str, cluster: bool, args: argparse.Namespace, data: Data) -> dict[str, Any]:
    client: Any = (
        RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    )  # (untyped upstream)
    info: dict[str, Any] = (
        client.info("server", target_nodes=RedisCluster.RANDOM) if cluster
        else client.info("server")
    )  # fmt: skip
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=data.size)
    backend = RedisBackend(RedisOptions(url=url, cluster=cluster, max_batch=args.batch), ctx)
    runs: dict[str, list[float]] = {}

    def flushed(fn: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            client.flushdb()
            return fn()

        return run

    try:
        client.flushdb()
        raw_pipelined(client, data.raw_keys, data.payloads, args.batch)  # warm-up: connections,
        tier(backend, data.keys, data.payloads, args.batch)  # server allocations, page faults
        paired(runs, args.repeats, {
            "raw_pipelined": flushed(
                lambda: raw_pipelined(client, data.raw_keys, data.payloads, args.batch)),
            "redis_tier": flushed(lambda: tier(backend, data.keys, data.payloads, args.batch)),
        })  # fmt: skip
        stats = backend.stats()
        client.flushdb()
    finally:
        backend.close()
        client.close()
    out = figures(runs, "raw_pipelined", "redis_tier", data, GOAL_TIER)
    out["redis_server_version"] = info.get("redis_version")
    out["tier_stats"] = {k: stats.get(k) for k in ("puts", "put_failures", "hits", "misses",
                                                   "corrupt", "round_trips", "errors")}  # fmt: skip
    return out


def store_vs_raw(url: str, args: argparse.Namespace, data: Data) -> dict[str, Any]:
    """The tiered store end to end (write-through, then another store's promotions)."""
    client = redis.Redis.from_url(url)
    config = load_config({"tiers": [
        {"backend": "cpu", "capacity": 2 * data.size * len(data.keys)},
        {"backend": "redis", "url": url, "max_batch": args.batch},
    ]})  # fmt: skip
    writer = build_store(config, STORE_NS, data.size)
    reader = build_store(config, STORE_NS, data.size)
    waits: list[float] = []

    def store_run() -> float:
        client.flushdb()
        writer.reset()
        reader.reset()
        return store_round(writer, reader, data, args.batch, waits)

    def raw_run() -> float:
        client.flushdb()
        return raw_pipelined(client, data.raw_keys, data.payloads, args.batch)

    runs: dict[str, list[float]] = {}
    try:
        raw_run()
        store_run()  # warm-up (and both host slabs touched)
        paired(runs, args.repeats, {"raw_pipelined": raw_run, "store_end_to_end": store_run})
        client.flushdb()
    finally:
        writer.shutdown()
        reader.shutdown()
        client.close()
    out = figures(runs, "raw_pipelined", "store_end_to_end", data, GOAL_STORE)
    out["index_wait_ms_median"] = 1e3 * statistics.median(waits) if waits else None
    return out


def store_round(
    writer: TieredStore, reader: TieredStore, data: Data, batch: int, waits: list[float]
) -> float:
    """Seconds for ``writer`` to store and write through every chunk (from the
    completed stores: the engine's copies into the host slots are not timed,
    raw redis-py has its bytes at hand too), plus for ``reader`` to find and
    promote them all (bytes checked after the clock)."""
    keys, payloads = data.keys, data.payloads
    wslab = writer.host.slab.numpy()
    plans = []
    for i in range(0, len(keys), batch):
        plan = writer.prepare_store(keys[i : i + batch])
        assert plan is not None and len(plan.keys) == len(keys[i : i + batch])
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            wslab[slot, : data.size] = np.frombuffer(payloads[keys.index(k)], dtype=np.uint8)
        plans.append(plan)
    start = time.perf_counter()
    for plan in plans:
        writer.complete_store(plan.keys)
        writer.step()
    while writer.has_pending_work():
        writer.wait_io(0.05)
        writer.step()
    written = time.perf_counter()
    tier = reader.lower[0]
    while not all(tier.may_contain(keys)):  # the other engine hears of them (not timed)
        time.sleep(0.0005)
    heard = time.perf_counter()
    waits.append(heard - written)
    pending = list(keys)
    while pending:
        pending = [k for k in pending if reader.lookup(k) is not LookupResult.HIT]
        reader.step()
        if pending:
            reader.wait_io(0.05)
    end = time.perf_counter()
    rslab = reader.host.slab.numpy()
    slots = reader.prepare_load(keys)
    try:
        for k, slot in zip(keys, slots, strict=True):
            assert rslab[slot, : data.size].tobytes() == payloads[keys.index(k)], "wrong bytes"
    finally:
        reader.complete_load(keys)
    return (written - start) + (end - heard)


class Data:
    def __init__(self, chunks: int, size: int) -> None:
        rng = np.random.default_rng(0)
        self.size = size
        self.payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                         for _ in range(chunks)]  # fmt: skip
        self.keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
                     for i in range(chunks)]  # fmt: skip
        self.raw_keys = [b"bench:raw:" + k.hex().encode() for k in self.keys]


def figures(
    runs: dict[str, list[float]], base: str, mine: str, data: Data, goal: float
) -> dict[str, Any]:
    total_bytes = data.size * len(data.keys)
    med = {name: statistics.median(t) for name, t in runs.items()}
    ratios = [r / t for r, t in zip(runs[base], runs[mine])]
    ratio = statistics.median(ratios)
    return {
        "median_seconds": med,
        "all_seconds": runs,
        "throughput_gb_per_s": {name: 2 * total_bytes / t / 1e9 for name, t in med.items()},
        "ratio": ratio,
        "ratio_per_repeat": ratios,
        "ratio_of_medians": med[base] / med[mine],
        "ratio_of_best": min(runs[base]) / min(runs[mine]),
        "goal": goal,
        "meets_goal": ratio >= goal,
    }


GOAL_TIER = 0.9
GOAL_STORE = 0.8


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mode", choices=["all", "node", "cluster", "store"], default="all")
    ap.add_argument("--url", default=None, help="an existing server (its database is flushed)")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="out/bench_redis.json")
    args = ap.parse_args()

    data = Data(args.chunks, args.chunk_kib * 1024)
    modes = ["node", "cluster", "store"] if args.mode == "all" else [args.mode]
    result: dict[str, Any] = {
        "benchmark": "redis tier put+get (and the tiered store end to end) vs raw pipelined "
        "redis-py SET/GET of the same payloads",
        "redis_py_version": redis.__version__,
        "chunks": args.chunks,
        "chunk_bytes": data.size,
        "frame_header_bytes": HEADER_SIZE,
        "batch": args.batch,
        "repeats": args.repeats,
        "checksum": {1: "xxh3-128", 2: "blake2b-128"}[DEFAULT_CHECKSUM],
    }
    for mode in modes:
        if mode == "cluster":
            with redis_cluster() as url:
                result[mode] = tier_vs_raw(url, True, args, data)
        else:
            with redis_server(args.url) as url:
                result[mode] = (
                    tier_vs_raw(url, False, args, data) if mode == "node"
                    else store_vs_raw(url, args, data)
                )  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for mode in modes:
        r = result[mode]
        for name, t in r["median_seconds"].items():
            print(f"{mode:8s} {name:17s} {t * 1e3:8.1f} ms  "
                  f"{r['throughput_gb_per_s'][name]:6.2f} GB/s (put+get)")  # fmt: skip
        print(
            f"{mode:8s} ratio vs raw: {r['ratio']:.2f} (median of per-repeat ratios; of "
            f"medians {r['ratio_of_medians']:.2f}, of best runs {r['ratio_of_best']:.2f}; "
            f"goal >= {r['goal']})  {'OK' if r['meets_goal'] else 'BELOW GOAL'}"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
