"""Disk tier store+load throughput vs plain sequential file write+read.

Both sides move the same payloads through the same directory in the same
process. The baseline (``plain_files``) writes each payload to its own file
with ``open().write`` and reads it back with ``open().read()``, holding each
batch of reads as a batched consumer does; the tier does ``put`` then ``get``
in the same batches, as the tiered store's I/O threads do (framing, checksum,
atomic rename, verification included). ``disk_tier_get_into`` loads with
``get_into`` into a preallocated batch of slots instead. The figure is
baseline seconds / tier seconds (1.0 = as fast as plain files; goal >= 0.7).

``plain_files_unbatched`` drops each read at once, so its one 2 MiB buffer
stays in the CPU cache; it is reported for reference, not as the baseline: a
tier's consumer keeps what it loads.

    python benchmarks/bench_disk.py [--dir DIR] [--chunks 96] [--chunk-mib 2] [--out out/bench_disk.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvsdk.backend import TierContext
from kvsdk.backends.disk import DiskBackend, DiskOptions
from kvsdk.chunk_format import DEFAULT_CHECKSUM

NS = hashlib.blake2b(b"bench", digest_size=16).digest()


def baseline(root: Path, payloads: list[bytes], batch: int) -> float:
    """Plain files; reads are held per batch (as a consumer of a batched get
    holds them) or, with ``batch=1``, dropped one by one (cache-hot buffers)."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, p in enumerate(payloads):
        with open(root / f"{i}.bin", "wb") as f:
            f.write(p)
    total = 0
    for i in range(0, len(payloads), batch):
        held = []
        for j in range(i, min(i + batch, len(payloads))):
            with open(root / f"{j}.bin", "rb") as f:
                held.append(f.read())
        total += sum(len(v) for v in held)
    elapsed = time.perf_counter() - start
    assert total == sum(len(p) for p in payloads)
    return elapsed


def tier(
    root: Path, payloads: list[bytes], batch: int, io_threads: int, into: bool = False
) -> float:
    """``into``: load with ``get_into`` straight into a preallocated slab of
    one batch of slots, as a host tier would receive them."""
    ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=len(payloads[0]))
    backend = DiskBackend(DiskOptions(path=str(root), capacity=1 << 40, io_threads=io_threads), ctx)
    keys = [
        hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
        for i in range(len(payloads))
    ]
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        ok = backend.put(list(zip(keys[i : i + batch], payloads[i : i + batch])))
        assert all(ok)
    total = 0
    slab = np.empty((batch, len(payloads[0])), dtype=np.uint8)
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        if into:
            assert all(backend.get_into(part, [memoryview(row) for row in slab[: len(part)]]))
            total += slab[: len(part)].nbytes
        else:
            held = backend.get(part)
            assert all(v is not None for v in held)
            total += sum(len(v) for v in held if v is not None)
    elapsed = time.perf_counter() - start
    assert total == sum(len(p) for p in payloads)
    backend.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the file system to test")
    ap.add_argument("--chunks", type=int, default=96)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="out/bench_disk.json")
    args = ap.parse_args()

    size = int(args.chunk_mib * (1 << 20))
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(args.chunks)]
    total_bytes = size * args.chunks
    base = Path(tempfile.mkdtemp(prefix="kvsdk-bench-disk-", dir=args.dir))
    runs: dict[str, list[float]] = {
        "plain_files": [],
        "plain_files_unbatched": [],
        "disk_tier_1thread": [],
        "disk_tier_4threads": [],
        "disk_tier_get_into": [],
    }
    try:
        for r in range(args.repeats):
            # interleave so drift in the machine's load hits every variant alike
            for name in runs:
                d = base / f"{name}-{r}"
                if name == "plain_files":
                    runs[name].append(baseline(d, payloads, args.batch))
                elif name == "plain_files_unbatched":
                    runs[name].append(baseline(d, payloads, 1))
                elif name == "disk_tier_get_into":
                    runs[name].append(tier(d, payloads, args.batch, 1, into=True))
                else:
                    threads = 1 if name.endswith("1thread") else 4
                    runs[name].append(tier(d, payloads, args.batch, threads))
                shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {name: statistics.median(t) for name, t in runs.items()}
    gbps = {name: 2 * total_bytes / t / 1e9 for name, t in med.items()}
    best_tier = min(med["disk_tier_1thread"], med["disk_tier_4threads"])
    result = {
        "benchmark": "disk tier store+load vs plain sequential file write+read",
        "chunks": args.chunks,
        "chunk_bytes": size,
        "batch": args.batch,
        "repeats": args.repeats,
        "checksum": {1: "xxh3-128", 2: "blake2b-128"}[DEFAULT_CHECKSUM],
        "median_seconds": med,
        "throughput_gb_per_s": gbps,
        "ratio_1thread": med["plain_files"] / med["disk_tier_1thread"],
        "ratio_4threads": med["plain_files"] / med["disk_tier_4threads"],
        "ratio": med["plain_files"] / best_tier,
        "ratio_vs_unbatched_reads": med["plain_files_unbatched"] / best_tier,
        "ratio_get_into": med["plain_files"] / med["disk_tier_get_into"],
        "ratio_get_into_vs_unbatched_reads": med["plain_files_unbatched"]
        / med["disk_tier_get_into"],
        "goal": 0.7,
    }
    result["meets_goal"] = result["ratio"] >= 0.7
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name in runs:
        print(f"{name:24s} {med[name] * 1e3:8.1f} ms  {gbps[name]:6.2f} GB/s (write+read)")
    print(
        f"ratio tier/plain: {result['ratio']:.2f} (1 thread {result['ratio_1thread']:.2f}, "
        f"4 threads {result['ratio_4threads']:.2f}; goal >= 0.7)  -> {out}\n"
        f"vs unbatched plain reads: get {result['ratio_vs_unbatched_reads']:.2f}, "
        f"get_into {result['ratio_get_into_vs_unbatched_reads']:.2f}"
    )
    os.sync()


if __name__ == "__main__":
    main()
