"""``kvsdk bench core``: the core's CPU cost per scheduler step and per looked-up chunk.

Drives the whole core (scheduler, planner, ledger, tiered store, CPU transfer
worker) with a synthetic multi-request trace: shared prefixes, a
full-attention and a sliding-window KV group. Reports the time spent inside
kvsdk's calls (not the synthetic engine's own work), and, as the ratio the
number needs, the same trace's cost of hashing the prompt tokens once with
BLAKE2b (what any prefix cache pays anyway).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvsdk.bench.synthetic import SyntheticEngine, TraceSpec, default_groups
from kvsdk.keys import token_chunk_hashes


def run_core_bench(
    spec: TraceSpec, *, out: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    groups = default_groups(tokens_per_block=16, blocks_per_chunk=4)
    engine = SyntheticEngine(
        groups,
        num_layers=4,
        block_bytes=2048,
        num_blocks=8192,
        config={"tiers": [{"backend": "cpu", "capacity": "1GiB"}], "chunk_tokens": 64},
    )
    bar = tqdm(total=spec.num_requests, desc="bench core", unit="req", disable=not progress)
    wall = time.perf_counter()
    stats = engine.run(spec, progress=bar.update)
    wall = time.perf_counter() - wall
    bar.close()
    snapshot = engine.store.metrics.snapshot()
    engine.close()

    # reference primitive: hashing the same prompts once (tokens -> 16-token block hashes)
    import random

    rng = random.Random(spec.seed)
    prompts = [
        [rng.randrange(32000) for _ in range(spec.prefix_tokens + rng.randint(*spec.suffix_tokens))]
        for _ in range(spec.num_requests)
    ]
    t0 = time.perf_counter()
    for prompt in prompts:
        token_chunk_hashes(prompt, 16)
    hash_seconds = time.perf_counter() - t0

    steps = stats.step_core_seconds
    result: dict[str, Any] = {
        "trace": asdict(spec),
        "groups": [
            f"{g.kind.value}(block={g.tokens_per_block}, chunk={g.tokens_per_chunk})"
            for g in groups
        ],
        "steps": stats.steps,
        "requests": spec.num_requests,
        "lookups": stats.lookups,
        "looked_up_chunks": stats.looked_up_chunks,
        "prompt_tokens": stats.prompt_tokens,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": stats.hit_tokens / max(1, stats.prompt_tokens),
        "loaded_blocks_checked": stats.loaded_blocks_checked,
        "mismatched_blocks": stats.mismatched_blocks,
        "core_seconds_total": stats.core_seconds,
        "core_us_per_step_mean": 1e6 * statistics.fmean(steps),
        "core_us_per_step_p50": 1e6 * statistics.median(steps),
        "core_us_per_step_p99": 1e6 * sorted(steps)[int(0.99 * (len(steps) - 1))],
        "core_us_per_looked_up_chunk": 1e6 * stats.core_seconds / max(1, stats.looked_up_chunks),
        "prompt_hashing_seconds": hash_seconds,
        "core_vs_prompt_hashing_ratio": stats.core_seconds / max(hash_seconds, 1e-9),
        "wall_seconds": wall,
        "metrics": snapshot["counters"],
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        _plot(steps, out.with_suffix(".png"))
    return result


def _plot(steps: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([1e6 * s for s in steps], lw=0.8)
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("kvsdk core time (µs)")
    ax.set_title("kvsdk core CPU time per scheduler step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(r: dict[str, Any]) -> str:
    rows = [
        ("requests / steps", f"{r['requests']} / {r['steps']}"),
        ("looked-up chunks", f"{r['looked_up_chunks']}"),
        ("hit rate (tokens)", f"{100 * r['hit_rate']:.1f}%"),
        (
            "loaded blocks checked / wrong",
            f"{r['loaded_blocks_checked']} / {r['mismatched_blocks']}",
        ),
        (
            "core time per step (mean/p50/p99)",
            f"{r['core_us_per_step_mean']:.0f} / {r['core_us_per_step_p50']:.0f} / "
            f"{r['core_us_per_step_p99']:.0f} µs",
        ),
        ("core time per looked-up chunk", f"{r['core_us_per_looked_up_chunk']:.2f} µs"),
        ("core time vs hashing the prompts once", f"{r['core_vs_prompt_hashing_ratio']:.2f}x"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
