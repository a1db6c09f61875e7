"""Mooncake tier put+get throughput vs the raw Mooncake client moving the same bytes.

Both sides move the same payloads through the same Mooncake Store (a master and
a ``mooncake_client`` holder on loopback, TCP, started here) in the same
process, batch by batch as the tiered store's I/O threads do. The baseline
(``raw_client``) is a plain ``MooncakeDistributedStore``: ``batch_put_from``
out of the source slab's rows, then ``batch_get_into`` into the destination
slab's rows. The tier does ``put`` of the source rows (as memoryviews, as the
tiered store passes host slots) then ``get_into`` of the destination rows (as
a promotion does): framing, checksum, namespace-prefixed keys, the existence
check before writing, the size lookup before reading and the verification of
every frame read included. Neither side registers its buffers (TCP needs no
registration). The figure is baseline seconds / tier seconds (1.0 = as fast as
the raw client; goal >= 0.9), the median of the per-repeat ratios: each repeat
runs both back to back, so load from other processes hits both alike. Each
side's objects are removed after its run.

    python benchmarks/bench_mooncake.py [--chunks 64] [--chunk-mib 2] [--batch 16] \\
        [--repeats 11] [--segment-mib 512] [--out out/bench_mooncake.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvsdk.backend import TierContext
from kvsdk.backends.mooncake import MooncakeBackend, MooncakeOptions
from kvsdk.backends.mooncake_client import load_store_class
from kvsdk.chunk_format import DEFAULT_CHECKSUM, HEADER_SIZE

NS = hashlib.blake2b(b"bench-mooncake", digest_size=16).digest()
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited (rc {proc.returncode})")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"{what} is not listening on {port}")


@contextlib.contextmanager
def mooncake_store(segment_mib: int) -> Iterator[str]:
    """A master and one holder contributing ``segment_mib`` MiB, on loopback; yields
    the master's address."""
    master_port, metrics_port, holder_port = _free_port(), _free_port(), _free_port()
    master = f"127.0.0.1:{master_port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvsdk-bench-mooncake-") as tmp:
        try:
            with open(Path(tmp) / "master.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [str(BIN / "mooncake_master"), f"--rpc_port={master_port}",
                     "--rpc_address=127.0.0.1", f"--metrics_port={metrics_port}"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                ))  # fmt: skip
            _wait(master_port, procs[0], "mooncake_master")
            with open(Path(tmp) / "holder.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [str(BIN / "mooncake_client"), "--host=127.0.0.1", f"--port={holder_port}",
                     f"--global_segment_size={segment_mib}MB", "--metadata_server=P2PHANDSHAKE",
                     f"--master_server_address={master}", "--protocol=tcp"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                ))  # fmt: skip
            _wait(holder_port, procs[1], "mooncake_client")
            yield master
        finally:
            for p in reversed(procs):
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def raw_client(
    client: Any, names: list[str], src: np.ndarray, dst: np.ndarray, batch: int
) -> float:
    size = src.shape[1]
    start = time.perf_counter()
    for i in range(0, len(names), batch):
        part = range(i, min(i + batch, len(names)))
        codes = client.batch_put_from([names[j] for j in part],
                                      [int(src[j].ctypes.data) for j in part], [size] * len(part))  # fmt: skip
        assert all(c == 0 for c in codes), codes
    for i in range(0, len(names), batch):
        part = range(i, min(i + batch, len(names)))
        got = client.batch_get_into([names[j] for j in part],
                                    [int(dst[j].ctypes.data) for j in part], [size] * len(part))  # fmt: skip
        assert all(n == size for n in got), got
    return time.perf_counter() - start


def tier(backend: MooncakeBackend, keys: list[bytes], src: np.ndarray, dst: np.ndarray,
         batch: int) -> float:  # fmt: skip
    start = time.perf_counter()
    for i in range(0, len(keys), batch):
        part = range(i, min(i + batch, len(keys)))
        assert all(backend.put([(keys[j], memoryview(src[j])) for j in part]))
    for i in range(0, len(keys), batch):
        part = range(i, min(i + batch, len(keys)))
        assert all(backend.get_into([keys[j] for j in part], [memoryview(dst[j]) for j in part]))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--segment-mib", type=int, default=512, help="memory the holder contributes")
    ap.add_argument("--out", default="out/bench_mooncake.json")
    args = ap.parse_args()

    size = int(args.chunk_mib * (1 << 20))
    if 2 * args.chunks * (size + HEADER_SIZE) > args.segment_mib << 20:
        raise SystemExit("--segment-mib is too small for two runs' objects")
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (args.chunks, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
            for i in range(args.chunks)]  # fmt: skip
    names = [f"bench:raw:{k.hex()}" for k in keys]
    total_bytes = size * args.chunks
    runs: dict[str, list[float]] = {"raw_client": [], "mooncake_tier": []}
    with mooncake_store(args.segment_mib) as master:
        client = load_store_class()()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) == 0
        deadline = time.monotonic() + 30  # until the holder's segment is mounted
        while client.put_from("bench:probe", int(src[0].ctypes.data), 64) != 0:
            if time.monotonic() > deadline:
                raise SystemExit("the holder never took a put")
            time.sleep(0.2)
        client.remove("bench:probe", True)
        ctx = TierContext(namespace_fp=NS, namespace_hex=NS.hex(), chunk_bytes=size)
        backend = MooncakeBackend(MooncakeOptions(master=master, timeout=5.0), ctx)
        try:

            def run(name: str) -> float:
                dst[:] = 0
                if name == "raw_client":
                    t = raw_client(client, names, src, dst, args.batch)
                    client.batch_remove(names, True)
                else:
                    t = tier(backend, keys, src, dst, args.batch)
                    assert backend.delete(keys) == len(keys)
                assert np.array_equal(src, dst), f"{name}: the bytes read back differ"
                return t

            for name in runs:  # warm-up: connections, the holder's pages, page faults
                run(name)
            for rep in range(args.repeats):
                order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # no order bias
                for name in order:
                    runs[name].append(run(name))
            stats = backend.stats()
        finally:
            backend.close()
            client.close()

    med = {name: statistics.median(t) for name, t in runs.items()}
    gbps = {name: 2 * total_bytes / t / 1e9 for name, t in med.items()}
    paired = [r / t for r, t in zip(runs["raw_client"], runs["mooncake_tier"])]
    ratio = statistics.median(paired)
    result = {
        "benchmark": "mooncake tier put+get_into vs the raw Mooncake client's "
        "batch_put_from/batch_get_into of the same payloads",
        "transport": "tcp, loopback, one holder (mooncake_client), P2PHANDSHAKE",
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
        "ratio_of_medians": med["raw_client"] / med["mooncake_tier"],
        "ratio_of_best": min(runs["raw_client"]) / min(runs["mooncake_tier"]),
        "goal": 0.9,
        "meets_goal": ratio >= 0.9,
        "tier_stats": {
            k: stats[k]
            for k in ("puts", "put_failures", "hits", "misses", "corrupt", "errors", "timeouts")
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name in runs:
        print(f"{name:14s} {med[name] * 1e3:8.1f} ms  {gbps[name]:6.2f} GB/s (put+get)")
    print(
        f"ratio tier/raw: {ratio:.2f} (median of per-repeat ratios; of medians "
        f"{result['ratio_of_medians']:.2f}, of best runs {result['ratio_of_best']:.2f}; "
        f"goal >= 0.9)  -> {out}"
    )


if __name__ == "__main__":
    main()
