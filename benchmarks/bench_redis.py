"""Redis tier put+get throughput vs raw pipelined redis-py SET/GET of the same bytes.

Both sides move the same payloads to and from the same server in the same
process, batch by batch as the tiered store's I/O threads do: the baseline
(``raw_pipelined``) sends each batch as one redis-py pipeline of ``SET``\\ s,
then reads it back with one pipeline of ``GET``\\ s, holding each batch of
values; the tier does ``put`` then ``get`` of the same batches (framing,
checksum, namespace-prefixed keys, verification of every value read back,
circuit breaker included). The figure is baseline seconds / tier seconds
(1.0 = as fast as raw redis-py; goal >= 0.8), reported as the median of the
per-repeat ratios: each repeat runs both back to back, so drift in the
machine's load hits both alike. The database is flushed before every run.

Starts its own ``redis-server`` on a free loopback port (persistence off)
unless ``--url`` names one (its database is flushed!).

    python benchmarks/bench_redis.py [--chunks 64] [--chunk-kib 1024] [--batch 16] \\
        [--repeats 7] [--url redis://...] [--out out/bench_redis.json]
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
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.chunk_format import DEFAULT_CHECKSUM, HEADER_SIZE

NS = hashlib.blake2b(b"bench-redis", digest_size=16).digest()


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


def raw_pipelined(
    client: redis.Redis, keys: list[bytes], payloads: list[bytes], batch: int
) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--url", default=None, help="an existing server (its database is flushed)")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="out/bench_redis.json")
    args = ap.parse_args()

    size = args.chunk_kib * 1024
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(args.chunks)]
    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
            for i in range(args.chunks)]  # fmt: skip
    raw_keys = [b"bench:raw:" + k.hex().encode() for k in keys]
    total_bytes = size * args.chunks
    runs: dict[str, list[float]] = {"raw_pipelined": [], "redis_tier": []}
    with redis_server(args.url) as url:
        client = redis.Redis.from_url(url)
        info: dict[str, Any] = client.info("server")
        ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=size)
        backend = RedisBackend(RedisOptions(url=url, max_batch=args.batch), ctx)
        try:
            client.flushdb()
            raw_pipelined(client, raw_keys, payloads, args.batch)  # warm-up: connections,
            tier(backend, keys, payloads, args.batch)  # server allocations, page faults
            for rep in range(args.repeats):
                order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # no order bias
                for name in order:
                    client.flushdb()
                    if name == "raw_pipelined":
                        runs[name].append(raw_pipelined(client, raw_keys, payloads, args.batch))
                    else:
                        runs[name].append(tier(backend, keys, payloads, args.batch))
            stats = backend.stats()
            client.flushdb()
        finally:
            backend.close()
            client.close()

    med = {name: statistics.median(t) for name, t in runs.items()}
    gbps = {name: 2 * total_bytes / t / 1e9 for name, t in med.items()}
    # each repeat runs both variants back to back: the median of the per-repeat
    # ratios is the least sensitive to load from other processes on the machine
    paired = [r / t for r, t in zip(runs["raw_pipelined"], runs["redis_tier"])]
    ratio = statistics.median(paired)
    result = {
        "benchmark": "redis tier put+get vs raw pipelined redis-py SET/GET of the same payloads",
        "redis_server_version": info.get("redis_version"),
        "redis_py_version": redis.__version__,
        "chunks": args.chunks,
        "chunk_bytes": size,
        "frame_header_bytes": HEADER_SIZE,
        "batch": args.batch,
        "repeats": args.repeats,
        "checksum": {1: "xxh3-128", 2: "blake2b-128"}[DEFAULT_CHECKSUM],
        "median_seconds": med,
        "all_seconds": runs,
        "throughput_gb_per_s": gbps,
        "ratio": ratio,
        "ratio_per_repeat": paired,
        "ratio_of_medians": med["raw_pipelined"] / med["redis_tier"],
        "ratio_of_best": min(runs["raw_pipelined"]) / min(runs["redis_tier"]),
        "goal": 0.8,
        "meets_goal": ratio >= 0.8,
        "tier_stats": {k: stats[k] for k in ("puts", "put_failures", "hits", "misses", "corrupt")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name in runs:
        print(f"{name:16s} {med[name] * 1e3:8.1f} ms  {gbps[name]:6.2f} GB/s (put+get)")
    print(
        f"ratio tier/raw: {ratio:.2f} (median of per-repeat ratios; of medians "
        f"{result['ratio_of_medians']:.2f}, of best runs {result['ratio_of_best']:.2f}; "
        f"goal >= 0.8)  -> {out}"
    )


if __name__ == "__main__":
    main()
