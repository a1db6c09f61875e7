"""GPU ↔ pinned host bandwidth of the kvsdk CUDA transfer worker vs a raw copy.

For each block size (bytes of one layer's block, 16 KB .. 4 MB) the worker
stores (device → host), loads (host → device) and does both at once, moving
``--total-mib`` per direction as jobs of whole chunks whose engine blocks are
scattered (a random permutation: nothing coalesces on the engine side). The
reference is one raw ``copy_`` of the same total bytes between the same
pinned slab and a device buffer (and one per direction, on two streams, for
both at once). Each figure is the best of ``--repeats`` timed passes after a
warm-up; a pass's time runs from the first submit to the last completion, so
the worker's planning and enqueueing on the host count against it.

Every size is measured through the worker's automatic choice and through
each copy path forced (one ``cudaMemcpyAsync`` per run vs gather into device
staging + few large copies), which shows where the measured threshold falls.

Writes ``out/bench_cuda_copy.json`` and ``out/bench_cuda_copy.png``.

    python3 benchmarks/bench_cuda_copy.py [--total-mib 256] [--layout fused]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

SIZES = [16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]
LAYERS = 4
BLOCKS_PER_CHUNK = 4
JOB_BYTES = 32 << 20  # one engine step's stores or loads
GOAL_RATIO_FROM = 256 << 10
GOAL_RATIO = 0.9
GOAL_BIDIR_GBPS = 80.0


def human(n: int) -> str:
    return f"{n >> 20}MB" if n >= 1 << 20 else f"{n >> 10}KB"


def caches(layout: str, size: int, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """``LAYERS`` layer tensors of ``num_blocks`` blocks of ``size`` bytes."""
    if layout == "fused":  # one allocation, layer-outermost (vLLM >= 0.32, vLLM-CPU)
        big = torch.randint(0, 255, (LAYERS, num_blocks, size), dtype=torch.uint8, device=device)
        return list(big.unbind(0))
    if layout == "kv_dim0":  # FlashAttention: (2, num_blocks, half) per layer, separate
        return [
            torch.randint(0, 255, (2, num_blocks, size // 2), dtype=torch.uint8, device=device)
            for _ in range(LAYERS)
        ]
    raise SystemExit(f"unknown layout {layout!r}")


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_size(size: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from kvsdk.transfer import BlockCopies, Direction, GroupLayers, TransferJob
    from kvsdk.transfer.cuda import CUDATransferWorker

    total = args.total_mib << 20
    chunk = LAYERS * BLOCKS_PER_CHUNK * size
    chunks = max(1, total // chunk)
    total = chunks * chunk
    num_blocks = chunks * BLOCKS_PER_CHUNK
    src = caches(args.layout, size, num_blocks, device)  # stored from
    dst = caches(args.layout, size, num_blocks, device)  # loaded into
    slab = torch.empty((2 * chunks, chunk), dtype=torch.uint8, pin_memory=True)
    slab.view(-1)[:] = 7
    flat = slab.view(-1)
    dev_buf = torch.empty(total, dtype=torch.uint8, device=device)
    dev_buf2 = torch.empty(total, dtype=torch.uint8, device=device)
    s1 = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    s2 = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def raw_d2h() -> None:
        flat[:total].copy_(dev_buf, non_blocking=True)

    def raw_h2d() -> None:
        dev_buf.copy_(flat[total : 2 * total], non_blocking=True)

    def raw_both() -> None:
        with torch.cuda.stream(s1):
            flat[:total].copy_(dev_buf, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_buf2.copy_(flat[total : 2 * total], non_blocking=True)

    rng = np.random.default_rng(size)
    perm = rng.permutation(num_blocks).astype(np.int64)
    slots = np.repeat(np.arange(chunks, dtype=np.int64), BLOCKS_PER_CHUNK)
    offsets = np.tile(np.arange(BLOCKS_PER_CHUNK, dtype=np.int64), chunks)
    per_job = max(1, JOB_BYTES // chunk) * BLOCKS_PER_CHUNK
    counter = iter(range(1, 1 << 40))

    def jobs(direction: Direction) -> list[TransferJob]:
        group, base = (0, 0) if direction is Direction.STORE else (1, chunks)
        return [
            TransferJob(
                next(counter),
                direction,
                (
                    BlockCopies(
                        group,
                        perm[a : a + per_job],
                        slots[a : a + per_job] + base,
                        offsets[a : a + per_job],
                    ),
                ),
            )
            for a in range(0, num_blocks, per_job)
        ]

    out: dict[str, Any] = {"block_bytes": size, "total_bytes": total, "chunks": chunks}
    out["raw_d2h"] = total / timed(raw_d2h, args.repeats) / 1e9
    out["raw_h2d"] = total / timed(raw_h2d, args.repeats) / 1e9
    out["raw_both"] = 2 * total / timed(raw_both, args.repeats) / 1e9
    paths = {"auto": None, "direct": 1, "staged": 1 << 50}
    for name, threshold in paths.items():
        w = CUDATransferWorker(direct_min_run_bytes=threshold)
        w.register(
            [
                GroupLayers(0, tuple(src), BLOCKS_PER_CHUNK),
                GroupLayers(1, tuple(dst), BLOCKS_PER_CHUNK),
            ],
            slab,
        )
        if name == "auto":
            out["threshold"] = w.direct_min_run_bytes

        def run(*directions: Direction, w: CUDATransferWorker = w) -> Callable[[], None]:
            def go() -> None:
                batch = [jobs(d) for d in directions]
                ids = []
                for group in zip(*batch):  # interleave the directions' jobs
                    for j in group:
                        w.submit(j)
                        ids.append(j.job_id)
                w.wait(ids)
                results = w.poll()
                bad = [r for r in results if not r.ok]
                if bad or len(results) != len(ids):
                    raise SystemExit(
                        f"kvsdk jobs failed: {bad[:3]} ({len(results)}/{len(ids)} done)"
                    )

            return go

        out[f"{name}_d2h"] = total / timed(run(Direction.STORE), args.repeats) / 1e9
        out[f"{name}_h2d"] = total / timed(run(Direction.LOAD), args.repeats) / 1e9
        out[f"{name}_both"] = (
            2 * total / timed(run(Direction.STORE, Direction.LOAD), args.repeats) / 1e9
        )
        if name == "auto":
            out["auto_path"] = "direct" if w.stats["direct_jobs"] else "staged"
        w.shutdown()
    # the stored bytes are the source blocks (a cheap spot check of the last pass)
    b = int(perm[0])
    assert torch.equal(
        slab[0].view(LAYERS, BLOCKS_PER_CHUNK, size)[0, 0].to(device),
        src[0][b].reshape(-1)
        if args.layout == "fused"
        else torch.cat([src[0][0, b], src[0][1, b]]),
    ), "stored bytes differ from the source block"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per direction per pass")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layout", choices=["fused", "kv_dim0"], default="fused")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes, bytes")
    p.add_argument("--out", default="out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_cuda_copy: no CUDA device here (torch.cuda.is_available() is False); "
            "run it on a GPU host, e.g. scripts/gpu_check.sh",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    print(
        f"device: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"layout {args.layout}, {LAYERS} layers, {BLOCKS_PER_CHUNK} blocks per chunk, "
        f"{args.total_mib} MiB per direction per pass, best of {args.repeats}"
    )
    from kvsdk.transfer.cuda import time_copy_paths

    paths = time_copy_paths(device)
    print("\nstore path timing (32 MiB of scattered runs, device → pinned host):")
    print(f"{'run':>6} {'direct GB/s':>12} {'staged GB/s':>12}")
    for t in paths:
        print(
            f"{human(t.run_bytes):>6} {32 * 2**20 / t.direct_s / 1e9:12.1f} {32 * 2**20 / t.staged_s / 1e9:12.1f}"
        )
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows.append(measure_size(size, args, device))
        torch.cuda.empty_cache()
        r = rows[-1]
        print(
            f"  measured {human(size)}: auto={r['auto_path']} d2h {r['auto_d2h']:.1f} h2d {r['auto_h2d']:.1f} "
            f"both {r['auto_both']:.1f} GB/s",
            flush=True,
        )
    header = (
        f"\n{'block':>6} | {'raw D2H':>7} {'kvsdk':>6} {'ratio':>5} | {'raw H2D':>7} {'kvsdk':>6} {'ratio':>5} "
        f"| {'raw both':>8} {'kvsdk':>6} {'ratio':>5} | {'path':>6} | {'direct d2h/h2d/both':>20} | {'staged d2h/h2d/both':>20}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{human(r['block_bytes']):>6} | {r['raw_d2h']:7.1f} {r['auto_d2h']:6.1f} {r['auto_d2h'] / r['raw_d2h']:5.2f} "
            f"| {r['raw_h2d']:7.1f} {r['auto_h2d']:6.1f} {r['auto_h2d'] / r['raw_h2d']:5.2f} "
            f"| {r['raw_both']:8.1f} {r['auto_both']:6.1f} {r['auto_both'] / r['raw_both']:5.2f} "
            f"| {r['auto_path']:>6} | {r['direct_d2h']:6.1f}/{r['direct_h2d']:6.1f}/{r['direct_both']:6.1f} "
            f"| {r['staged_d2h']:6.1f}/{r['staged_h2d']:6.1f}/{r['staged_both']:6.1f}"
        )
    big = [r for r in rows if r["block_bytes"] >= GOAL_RATIO_FROM]
    worst = min(
        (min(r[f"auto_{d}"] / r[f"raw_{d}"] for d in ("d2h", "h2d", "both")) for r in big),
        default=float("nan"),
    )
    best_bidir = max(r["auto_both"] for r in rows)
    print(
        f"\ngoal: >= {GOAL_RATIO}x raw for blocks >= {human(GOAL_RATIO_FROM)}: worst {worst:.2f}x "
        f"({'met' if worst >= GOAL_RATIO else 'NOT met'}); >= {GOAL_BIDIR_GBPS:.0f} GB/s both "
        f"directions: best {best_bidir:.1f} GB/s ({'met' if best_bidir >= GOAL_BIDIR_GBPS else 'NOT met'}; "
        f"raw both-ways copy reached {max(r['raw_both'] for r in rows):.1f} GB/s on this host)"
    )
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    report = {
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layout": args.layout,
        "layers": LAYERS,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "total_mib": args.total_mib,
        "repeats": args.repeats,
        "path_timing": [t.__dict__ for t in paths],
        "rows": rows,
        "worst_ratio_from_256KB": worst,
        "best_bidirectional_gbps": best_bidir,
    }
    (outdir / "bench_cuda_copy.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {outdir / 'bench_cuda_copy.json'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return 0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    x = [r["block_bytes"] for r in rows]
    for ax, d, title in zip(
        axes, ("d2h", "h2d", "both"), ("device → host", "host → device", "both at once")
    ):
        ax.plot(x, [r[f"raw_{d}"] for r in rows], "k--", label="raw copy_ (same bytes)")
        ax.plot(x, [r[f"auto_{d}"] for r in rows], "o-", lw=2, label="kvsdk (auto)")
        ax.plot(x, [r[f"direct_{d}"] for r in rows], ":", label="kvsdk, copy per run")
        ax.plot(x, [r[f"staged_{d}"] for r in rows], ":", label="kvsdk, gather + staging")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [human(v) for v in x], rotation=45)
        ax.set_title(title)
        ax.set_xlabel("block size (one layer)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kvsdk CUDA transfer worker vs raw copy, {props.name} ({args.layout} layout)")
    fig.tight_layout()
    fig.savefig(outdir / "bench_cuda_copy.png", dpi=120)
    print(f"wrote {outdir / 'bench_cuda_copy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
