"""What authenticating frames costs: the same work with and without a
deployment secret, in the same run.

Each figure is a ratio *with MAC / without MAC* of wall time (1.0: free);
issue 14's goals are throughput >= 0.95x (time ratio <= 1.053) on disk and
Redis, and <= 1.05x on a host hit:

- ``frame``: encode + decode of one chunk in memory (the raw cost of the
  MAC, one-time-key AES-GMAC, against the default checksum, xxh3-128 or BLAKE2b-128);
- ``disk_put_get``: a disk tier's ``put`` then ``get_into`` of every chunk
  (page cache, the tiered store's batch size), framing and verification
  included; variants alternate per repeat, each in a fresh directory removed after;
- ``host_hit``: a host-tier hit served by a ``cpu -> disk`` TieredStore whose
  disk tier MACs its frames (the MAC is never on that path);
- ``redis_put_get`` (with ``--redis URL``): a Redis tier's ``put`` then ``get``.

First it prints each checksum and MAC alone (GiB/s over one chunk): a put+get
round trip runs the MAC over every byte twice, so ``ratio - 1`` is about
``2 x (seconds per GiB of the MAC - of the checksum) / (seconds per GiB of the
round trip without)``. ``gmac-one-time`` is kvsdk's MAC (format version 5: key
derivation included); ``keyed-blake3`` (format version 4) and ``hmac-sha256``
(version 3) are the MACs it replaced, for comparison.

    python benchmarks/bench_frame_mac.py [--chunks 64] [--chunk-mib 2] [--repeat 5]
        [--redis redis://127.0.0.1:6379/0] [--out out/bench_frame_mac.json]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import xxhash

from kvsdk.backend import TierContext
from kvsdk.backends.disk import DiskBackend, DiskOptions
from kvsdk.chunk_format import DEFAULT_CHECKSUM, decode_chunk, encode_chunk, gmac_tag
from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.trust import DeploymentSecret

SECRET = DeploymentSecret(os.urandom(32))
CHECKSUM_NAME = {1: "xxh3-128", 2: "blake2b-128"}[DEFAULT_CHECKSUM]


def best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def namespace(chunk: int, secret: DeploymentSecret | None) -> Namespace:
    return Namespace("bench-mac", "uint8", (GroupLayout((chunk,), "|u1"),), 16, secret=secret)


def frame_cost(payloads: list[bytes], repeat: int) -> dict[str, float]:
    ns = namespace(len(payloads[0]), SECRET)
    key = hashlib.blake2b(b"k", digest_size=16).digest()
    mac = ns.frame_key
    out = {}
    for name, mac_key in (("without", None), ("with", mac)):

        def run(mac_key: bytes | None = mac_key) -> None:
            for p in payloads:
                f = encode_chunk(ns.public_fp, key, p, mac_key=mac_key)
                decode_chunk(f, namespace_fp=ns.public_fp, key=key, mac_key=mac_key)

        out[name] = best(run, repeat)
    return out


def _keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


def _variants(r: int) -> tuple[tuple[str, DeploymentSecret | None], ...]:
    """Without and with the secret, in alternating order per repeat: the
    machine's state (dirty pages, caches, other load) falls on both alike."""
    pair = (("without", None), ("with", SECRET))
    return pair if r % 2 == 0 else pair[::-1]


def disk_cost(payloads: list[bytes], repeat: int, root: Path) -> dict[str, float]:
    """Best put+get_into time of each variant; every repeat writes a fresh
    directory and removes it afterwards, so neither variant pays for the other's
    accumulated dirty pages (the old loop wrote 5 x 128 MiB per variant without
    removing any, and the second variant measured the kernel's writeback)."""
    keys = _keys(len(payloads))
    slots = [memoryview(bytearray(len(p))) for p in payloads]
    times: dict[str, list[float]] = {"without": [], "with": [], "put_without": [],
                                     "put_with": []}  # fmt: skip
    for r in range(repeat):
        for name, secret in _variants(r):
            ns = namespace(len(payloads[0]), secret)
            ctx = TierContext(
                namespace_fp=ns.public_fp,
                namespace_hex=ns.hex,
                chunk_bytes=len(payloads[0]),
                frame_key=ns.frame_key,
            )
            path = root / f"{name}{r}"
            d = DiskBackend(DiskOptions(path=str(path), shards=16), ctx)
            start = time.perf_counter()
            for i in range(0, len(keys), 16):
                assert all(d.put(list(zip(keys[i : i + 16], payloads[i : i + 16]))))
            mid = time.perf_counter()
            for i in range(0, len(keys), 16):
                assert all(d.get_into(keys[i : i + 16], slots[i : i + 16]))
            times[name].append(time.perf_counter() - start)
            times[f"put_{name}"].append(mid - start)
            d.close()
            shutil.rmtree(path)
    return {k: min(v) for k, v in times.items()}


def host_hit_cost(payloads: list[bytes], repeat: int, root: Path) -> dict[str, float]:
    out = {}
    chunk = len(payloads[0])
    keys = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()
            for i in range(len(payloads))]  # fmt: skip
    for name, secret in (("without", None), ("with", SECRET)):
        cfg = load_config({
            "chunk_tokens": 16,
            "tiers": [{"backend": "cpu", "capacity": chunk * (len(keys) + 1),
                       "pin_memory": "never"},
                      {"backend": "disk", "path": str(root / f"hit-{name}"), "capacity": "8GiB"}],
        })  # fmt: skip
        store = build_store(cfg, namespace(chunk, secret), chunk)
        plan = store.prepare_store(keys)
        assert plan is not None
        slab = store.host.slab.numpy()
        for k, slot in zip(plan.keys, plan.slots):
            slab[slot] = np.frombuffer(payloads[keys.index(k)], dtype=np.uint8)
        store.complete_store(list(plan.keys))

        def hits(store: Any = store, slab: Any = slab) -> None:
            for _ in range(200):
                for k in keys:
                    assert store.lookup(k).name == "HIT"
                slots = store.prepare_load(keys)
                _ = [bytes(slab[s][:64]) for s in slots]
                store.complete_load(keys)

        out[name] = best(hits, repeat)
        store.shutdown()
    return out


def redis_cost(payloads: list[bytes], repeat: int, url: str) -> dict[str, float]:
    from kvsdk.backends.redis import RedisBackend, RedisOptions

    keys = _keys(len(payloads))
    times: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(repeat):
        for name, secret in _variants(r):
            ns = namespace(len(payloads[0]), secret)
            ctx = TierContext(namespace_fp=ns.public_fp, namespace_hex=ns.hex,
                              chunk_bytes=len(payloads[0]), frame_key=ns.frame_key)  # fmt: skip
            rb = RedisBackend(RedisOptions(url=url, socket_timeout=10.0), ctx)
            start = time.perf_counter()
            for i in range(0, len(keys), 16):
                assert all(rb.put(list(zip(keys[i : i + 16], payloads[i : i + 16]))))
            for i in range(0, len(keys), 16):
                assert all(v is not None for v in rb.get(keys[i : i + 16]))
            times[name].append(time.perf_counter() - start)
            rb.clear()
            rb.close()
    return {k: min(v) for k, v in times.items()}


def mac_rates(payload: bytes, repeat: int) -> dict[str, float]:
    """GiB/s of each checksum and MAC alone over one chunk (what a frame adds per pass)."""
    key = os.urandom(32)
    view = memoryview(payload)
    header = os.urandom(136)
    fns: dict[str, Callable[[], object]] = {
        "xxh3-128": lambda: xxhash.xxh3_128(view).digest(),
        "gmac-one-time": lambda: gmac_tag(key, header, (view,)),
        "keyed-blake3": lambda: blake3.blake3(view, key=key).digest(16),
        "hmac-sha256": lambda: hmac.digest(key, view, "sha256"),
    }
    gib = len(payload) * 16 / (1 << 30)
    out = {}
    for name, fn in fns.items():

        def sixteen(fn: Callable[[], object] = fn) -> None:
            for _ in range(16):
                fn()

        out[name] = gib / best(sixteen, repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--redis", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    size = int(args.chunk_mib * (1 << 20))
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(args.chunks)]
    results: dict[str, Any] = {"chunk_bytes": size, "chunks": args.chunks,
                               "checksum_without_mac": CHECKSUM_NAME}  # fmt: skip
    rates = mac_rates(payloads[0], args.repeat)
    results["mac_gib_s"] = rates
    print("alone, GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        figures = {
            "frame": frame_cost(payloads, args.repeat),
            "disk_put_get": disk_cost(payloads, args.repeat, root),
            "host_hit": host_hit_cost(payloads[:16], args.repeat, root),
        }
        if args.redis:
            figures["redis_put_get"] = redis_cost(payloads, args.repeat, args.redis)
    gib = size * args.chunks / (1 << 30)
    for name, t in figures.items():
        if "put_with" in t:
            put_extra = f"put alone {t['put_without'] * 1e3:.1f} -> {t['put_with'] * 1e3:.1f} ms"
            results[f"{name}_put"] = {"without_s": t["put_without"], "with_s": t["put_with"]}
            print(f"{name:14s} {put_extra}")
        ratio = t["with"] / t["without"]
        results[name] = {"without_s": t["without"], "with_s": t["with"], "ratio": ratio}
        extra = ""
        if name in ("frame", "disk_put_get", "redis_put_get"):
            extra = (f"  ({gib / t['without']:.2f} -> {gib / t['with']:.2f} GiB/s, "
                     f"throughput {t['without'] / t['with']:.3f}x)")  # fmt: skip
        print(f"{name:14s} without {t['without'] * 1e3:8.1f} ms  with MAC "
              f"{t['with'] * 1e3:8.1f} ms  ratio {ratio:.2f}x{extra}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if isinstance(v, dict)}, default=float))


if __name__ == "__main__":
    main()
