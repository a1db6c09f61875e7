"""What a store into host-tier pages never touched costs, and what prefaulting
(``kvsdk.prefault``, the cpu tier's ``prefault: true``) buys, in one run.

Slot-sized copies (``--slot-kib``, default 512 KiB: one 128-token chunk of
the tiny Llama) from an engine-like source into a host tier's shared slab,
``--mib`` in all, one torch thread (the copy a vLLM-CPU worker makes after a
forward pass):

- ``fresh``: a new slab, no prefault (each page faults on its first store:
  allocated, zeroed, mapped);
- ``prefaulted``: a new slab whose prefault thread finished first;
- ``attached``: a second mapping of the prefaulted slab, as a vLLM worker has
  it, that prefaulted its own page tables;
- ``attached_plain``: a second mapping without prefault (pages exist, page
  tables do not);
- ``touched``: the same slab copied into again: the raw ``copy_``.

Each is timed ``--repeat`` times (fresh slabs each time) and the best kept;
ratios are to ``touched``. It also prints how long the prefault of the
whole slab took, and the walks' time in the creator and a worker against the
worker's alone (where the creator copies nothing: a host tier alone under
vLLM, whose scheduler process then does not walk).

    python benchmarks/bench_slab_prefault.py [--mib 512] [--slot-kib 512] [--repeat 3]
        [--out out/bench_slab_prefault.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

import torch

from kvsdk.slab import SharedSlab, SlabGeometry, segment_name


def copy_into(slab: SharedSlab, src: torch.Tensor) -> float:
    start = time.perf_counter()
    for i in range(slab.geometry.num_slots):
        slab.tensor[i].copy_(src)
    return time.perf_counter() - start


def walk(slab: SharedSlab) -> float:
    """Prefault the whole of ``slab``'s mapping in this process; seconds it took."""
    started = time.perf_counter()
    slab.prefault()
    slab.stores_reached(slab.geometry.num_slots)  # the walk keeps ahead of stores: all of it
    assert slab.prefaulting is not None
    slab.prefaulting.join()
    return time.perf_counter() - started


def one_round(slots: int, slot_bytes: int, src: torch.Tensor) -> dict[str, float]:
    geometry = SlabGeometry(slots, slot_bytes, 1)
    out: dict[str, float] = {}
    fresh = SharedSlab.create(segment_name(f"bench-prefault-{uuid.uuid4()}"), geometry)
    try:
        out["fresh"] = copy_into(fresh, src)
        out["touched"] = copy_into(fresh, src)
        plain = SharedSlab.attach(fresh.name)
        out["attached_plain"] = copy_into(plain, src)
    finally:
        fresh.unlink()
    pre = SharedSlab.create(segment_name(f"bench-prefault-{uuid.uuid4()}"), geometry)
    try:
        out["prefault_s"] = walk(pre)
        out["prefaulted"] = copy_into(pre, src)
        other = SharedSlab.attach(pre.name)
        out["attach_walk_s"] = walk(other)
        out["attached"] = copy_into(other, src)
    finally:
        pre.unlink()
    alone = SharedSlab.create(segment_name(f"bench-prefault-{uuid.uuid4()}"), geometry)
    try:  # the creator copies nothing (a host tier alone under vLLM): the worker walks alone
        out["worker_alone_walk_s"] = walk(SharedSlab.attach(alone.name))
    finally:
        alone.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--slot-kib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="out/bench_slab_prefault.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    slot_bytes = args.slot_kib << 10
    slots = (args.mib << 20) // slot_bytes
    src = torch.randint(0, 255, (slot_bytes,), dtype=torch.uint8)
    rounds = [one_round(slots, slot_bytes, src) for _ in range(args.repeat)]
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    gib = slots * slot_bytes / 2**30
    print(f"{slots} copies of {args.slot_kib} KiB ({gib:.2f} GiB), 1 thread, best of "
          f"{args.repeat}; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for case in ("touched", "prefaulted", "attached", "fresh", "attached_plain"):
        print(f"  {case:15s} {best[case] * 1e3:8.1f} ms  {gib / best[case]:6.2f} GiB/s  "
              f"{best[case] / best['touched']:6.2f}x the raw copy_")  # fmt: skip
    print(f"  prefault of the slab in the creating process: {best['prefault_s'] * 1e3:.0f} ms "
          f"({gib / best['prefault_s']:.2f} GiB/s, on a background thread)")  # fmt: skip
    both = best["prefault_s"] + best["attach_walk_s"]
    print(f"  walks in the creator and a worker: {both * 1e3:.0f} ms; the worker's alone "
          f"(the creator copies nothing): {best['worker_alone_walk_s'] * 1e3:.0f} ms, "
          f"{best['worker_alone_walk_s'] / both:.2f}x")  # fmt: skip
    result = {"slots": slots, "slot_bytes": slot_bytes, "rounds": rounds, "best_s": best,
              "over_touched": {k: best[k] / best["touched"] for k in best if not k.endswith("_s")},
              "load_avg_1m": os.getloadavg()[0]}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
