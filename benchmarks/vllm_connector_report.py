"""The report of ``bench_vllm_connector.py``: the summary of every run's figures
(ratios against each peer), the table it prints and the plot it writes."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_connector_engine import TP2_CONFIGS


def median(xs: Iterable[float]) -> float:
    return float(statistics.median(list(xs)))


def summarize(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    none, kvsdk, native = runs["none"], runs["kvsdk"], runs["native"]
    ttft: dict[str, dict[str, Any]] = {}
    for length in map(str, args.prompt_lens):

        def med(run: dict[str, Any], case: str, key: str = "s", length: str = length) -> float:
            return median(m[key] for m in run["ttft"][length][case])

        row: dict[str, Any] = {
            "cold_ms": 1e3 * med(none, "cold"),
            "local_hit_ms": 1e3 * med(none, "local_hit"),
            "kvsdk_warm_ms": 1e3 * med(kvsdk, "warm"),
            "native_warm_ms": 1e3 * med(native, "warm"),
            "kvsdk_cold_ms": 1e3 * med(kvsdk, "cold_with_connector"),
            "native_cold_ms": 1e3 * med(native, "cold_with_connector"),
            "cached_tokens": {
                "local_hit": med(none, "local_hit", "cached"),
                "kvsdk_warm": med(kvsdk, "warm", "cached"),
                "native_warm": med(native, "warm", "cached"),
            },
            "cpu_ms": {
                "cold": 1e3 * med(none, "cold", "cpu_s"),
                "local_hit": 1e3 * med(none, "local_hit", "cpu_s"),
                "kvsdk_warm": 1e3 * med(kvsdk, "warm", "cpu_s"),
                "native_warm": 1e3 * med(native, "warm", "cpu_s"),
            },
        }
        row["kvsdk_over_native"] = row["kvsdk_warm_ms"] / row["native_warm_ms"]
        row["kvsdk_over_local_hit"] = row["kvsdk_warm_ms"] / row["local_hit_ms"]
        row["native_over_local_hit"] = row["native_warm_ms"] / row["local_hit_ms"]
        row["cold_over_kvsdk"] = row["cold_ms"] / row["kvsdk_warm_ms"]
        row["same_token"] = all(
            m.get("same_token_as_first", True)
            for run in (none, kvsdk, native)
            for case in run["ttft"][length].values()
            for m in case
        )
        ttft[length] = row
    ks, ns = kvsdk["sched"], native["sched"]
    sched = {
        "kvsdk": ks,
        "native": ns,
        "kvsdk_us_per_step": ks["all_us_per_step"],
        "native_us_per_step": ns["all_us_per_step"],
        "kvsdk_over_native": ks["all_us_per_step"] / ns["all_us_per_step"],
        "kvsdk_over_native_cpu": ks["all_cpu_us_per_step"] / ns["all_cpu_us_per_step"],
        # the subset this benchmark reported before: it leaves out on_new_request, where
        # native does per-request work kvsdk does in get_num_new_matched_tokens
        "kvsdk_over_native_core_methods": ks["core_us_per_step"] / ns["core_us_per_step"],
        # wave by wave (the two connectors run each wave back to back)
        "per_wave_kvsdk_over_native": [
            k["us_per_step"] / n["us_per_step"]
            for k, n in zip(ks["waves"], ns["waves"], strict=True)
        ],
    }
    tn, tk = none["throughput"], kvsdk["throughput"]
    throughput = {
        "none": tn,
        "kvsdk": tk,
        "none_tokens_per_s": tn["median_tokens_per_s"],
        "kvsdk_tokens_per_s": tk["median_tokens_per_s"],
        "kvsdk_over_none": tk["median_tokens_per_s"] / tn["median_tokens_per_s"],
        "kvsdk_over_none_aggregate": tk["aggregate_tokens_per_s"] / tn["aggregate_tokens_per_s"],
        # the same round of both, run back to back: less exposed to load that comes and goes
        "kvsdk_over_none_paired": median(
            k["tokens_per_s"] / n["tokens_per_s"]
            for k, n in zip(tk["rounds"], tn["rounds"], strict=True)
        ),
        # tokens per CPU-second of the engine's processes (kvsdk's copy threads included)
        "kvsdk_over_none_cpu": tk["median_tokens_per_cpu_s"] / tn["median_tokens_per_cpu_s"],
    }
    tp2: dict[str, Any] | None = None
    if all(c in runs for c in TP2_CONFIGS):
        length = str(args.tp2_len)
        none2, kvsdk2 = (runs[c]["ttft"][length] for c in TP2_CONFIGS)

        def med2(cases: dict[str, Any], case: str, key: str = "s") -> float:
            return median(m[key] for m in cases[case])

        tp2 = {
            "tensor_parallel_size": 2,
            "prompt_len": args.tp2_len,
            "cold_ms": 1e3 * med2(none2, "cold"),
            "local_hit_ms": 1e3 * med2(none2, "local_hit"),
            "kvsdk_warm_ms": 1e3 * med2(kvsdk2, "warm"),
            "kvsdk_cold_ms": 1e3 * med2(kvsdk2, "cold_with_connector"),
            "cached_tokens": {
                "local_hit": med2(none2, "local_hit", "cached"),
                "kvsdk_warm": med2(kvsdk2, "warm", "cached"),
            },
            "cpu_ms": {
                "cold": 1e3 * med2(none2, "cold", "cpu_s"),
                "local_hit": 1e3 * med2(none2, "local_hit", "cpu_s"),
                "kvsdk_warm": 1e3 * med2(kvsdk2, "warm", "cpu_s"),
            },
            "same_token": all(
                m.get("same_token_as_first", True)
                for cases in (none2, kvsdk2)
                for case in cases.values()
                for m in case
            ),
        }
        tp2["kvsdk_over_local_hit"] = tp2["kvsdk_warm_ms"] / tp2["local_hit_ms"]
        tp2["cold_over_kvsdk"] = tp2["cold_ms"] / tp2["kvsdk_warm_ms"]
    worst_native = max(r["kvsdk_over_native"] for r in ttft.values())
    worst_local = max(r["kvsdk_over_local_hit"] for r in ttft.values())
    goals = {
        "ttft_kvsdk_le_native": {"goal": 1.0, "worst": worst_native, "met": worst_native <= 1.0},
        "ttft_kvsdk_le_1.2x_local_hit": {
            "goal": 1.2,
            "worst": worst_local,
            "met": worst_local <= 1.2,
        },
        "sched_time_le_0.5x_native": {
            "goal": 0.5,
            "value": sched["kvsdk_over_native"],
            "met": sched["kvsdk_over_native"] <= 0.5,
        },
        "no_reuse_throughput_ge_0.97": {
            "goal": 0.97,
            "value": throughput["kvsdk_over_none"],
            "met": throughput["kvsdk_over_none"] >= 0.97,
        },
    }
    return {
        "settings": {
            "model": {
                "path": args.model_dir,
                "hidden_size": args.hidden,
                "num_layers": args.layers,
                "num_heads": args.heads,
                "num_kv_heads": args.kv_heads,
                "dtype": "float32",
            },
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "executor": "vLLM default (EngineCore process + a worker process per rank)",
            "engine_client": {c: r["engine_client"] for c, r in runs.items()},
            "torch_threads": {c: r["torch_threads"] for c, r in runs.items()},  # per rank
            "omp_threads_bind": {c: r["omp_threads_bind"] for c, r in runs.items()},
            "tp2_len": args.tp2_len,
            "repeats": args.repeats,
            "prompt_lens": args.prompt_lens,
            "block_size": none["block_size"],  # vLLM's default; both connectors at their defaults
            "tier_bytes": int(args.tier_gib * 2**30),
            "vllm_kv_cache_gib": args.kv_space_gib,
            "max_num_batched_tokens": none["max_num_batched_tokens"],
            "trace": {
                "requests": args.trace_requests,
                "waves": args.trace_waves,
                "prefixes": args.trace_prefixes,
                "prefix_tokens": args.trace_prefix_tokens,
                "max_tokens": args.trace_max_tokens,
            },
            "throughput": {
                "requests": args.tp_requests,
                "prompt_tokens": args.tp_prompt_tokens,
                "max_tokens": args.tp_max_tokens,
                "rounds": args.tp_rounds,
            },
            "kv_transfer_config": {c: r["kv_transfer_config"] for c, r in runs.items()},
        },
        "ttft": ttft,
        "sched": sched,
        "throughput": throughput,
        "tp2": tp2,
        "goals": goals,
        "raw": runs,
    }


def format_table(s: dict[str, Any]) -> str:
    lines = []
    head = (
        f"{'prompt':>7} {'cold':>9} {'local hit':>10} {'kvsdk warm':>11} {'native warm':>12}"
        f" {'kvsdk/native':>13} {'kvsdk/local':>12} {'recomputed l/k/n':>17}"
    )
    lines += ["1. warm TTFT (median wall time of generate, max_tokens=1)", head, "-" * len(head)]
    for length, r in s["ttft"].items():
        c, n = r["cached_tokens"], int(length)  # recomputed: prompt tokens not served from a cache
        cached = f"{n - c['local_hit']:.0f}/{n - c['kvsdk_warm']:.0f}/{n - c['native_warm']:.0f}"
        lines.append(
            f"{length:>7} {r['cold_ms']:>7.0f}ms {r['local_hit_ms']:>8.1f}ms"
            f" {r['kvsdk_warm_ms']:>9.1f}ms {r['native_warm_ms']:>10.1f}ms"
            f" {r['kvsdk_over_native']:>12.2f}x {r['kvsdk_over_local_hit']:>11.2f}x {cached:>17}"
        )
    sc = s["sched"]
    lines += [
        "",
        "2. scheduler-side connector time per engine step (same trace,"
        f" {s['settings']['trace']['max_tokens']} output tokens per request)",
        f"   kvsdk {sc['kvsdk_us_per_step']:.0f} us/step over {sc['kvsdk']['steps']} steps;"
        f" native {sc['native_us_per_step']:.0f} us/step over {sc['native']['steps']} steps;"
        f" kvsdk/native {sc['kvsdk_over_native']:.2f}x"
        f" (thread CPU time {sc['kvsdk_over_native_cpu']:.2f}x; without on_new_request,"
        f" stats and the other hooks {sc['kvsdk_over_native_core_methods']:.2f}x)",
        "   per wave kvsdk/native: "
        + ", ".join(f"{r:.2f}x" for r in sc["per_wave_kvsdk_over_native"]),
    ]
    for name in ("kvsdk", "native"):
        top = sorted(sc[name]["methods"].items(), key=lambda kv: -kv[1]["total_ms"])
        lines.append(
            f"   {name}: "
            + ", ".join(f"{m} {v['total_ms']:.1f}ms/{v['calls']}" for m, v in top[:6])
        )
    tp = s["throughput"]
    lines += [
        "",
        "3. no-reuse throughput (prompt+generated tokens/s, median of rounds)"
        + (
            f" [{s['settings']['threads']} engine thread(s) on {s['settings']['cpus']} CPUs:"
            " kvsdk's copy thread has idle cores]"
            if s["settings"]["threads"] < s["settings"]["cpus"]
            else ""
        ),
        f"   no connector {tp['none_tokens_per_s']:.0f} tok/s; kvsdk {tp['kvsdk_tokens_per_s']:.0f}"
        f" tok/s; kvsdk/none {tp['kvsdk_over_none']:.3f}x"
        f" (aggregate {tp['kvsdk_over_none_aggregate']:.3f}x; median of paired rounds"
        f" {tp['kvsdk_over_none_paired']:.3f}x; per CPU-second {tp['kvsdk_over_none_cpu']:.3f}x)",
    ]
    rounds = tp["kvsdk"]["rounds"]
    if rounds and rounds[0].get("kvsdk_admission") is not None:
        lines.append(
            "   kvsdk's admission (second sight) after each round: chunks held "
            + ", ".join(str(r["kvsdk_held_chunks"]) for r in rounds)
            + "; storing only repeats: "
            + ", ".join("yes" if r["kvsdk_admission"]["selective"] else "no" for r in rounds)
        )
    t2 = s.get("tp2")
    if t2:
        c = t2["cached_tokens"]
        lines += [
            "",
            f"4. TP=2 (a worker process per rank, one CPU each), {t2['prompt_len']}-token prompt,"
            " median TTFT as in 1.",
            f"   cold {t2['cold_ms']:.0f} ms; vLLM local hit {t2['local_hit_ms']:.1f} ms"
            f" ({c['local_hit']:.0f} cached); kvsdk warm {t2['kvsdk_warm_ms']:.1f} ms"
            f" ({c['kvsdk_warm']:.0f} cached); kvsdk/local {t2['kvsdk_over_local_hit']:.2f}x;"
            f" cold/kvsdk {t2['cold_over_kvsdk']:.2f}x; same first token:"
            f" {'yes' if t2['same_token'] else 'NO'}",
        ]
    lines += ["", "goals:"]
    for name, g in s["goals"].items():
        value = g.get("worst", g.get("value"))
        lines.append(
            f"   {name:<32} {value:.3f} (goal {g['goal']}) {'MET' if g['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def plot(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t2 = s.get("tp2")
    ratios = [2.2, 1, 1] + ([1.1] if t2 else [])
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.6 * len(ratios) + 1, 4.5),
                             gridspec_kw={"width_ratios": ratios})  # fmt: skip
    ax = axes[0]
    lens = list(s["ttft"])
    cases = [("cold_ms", "cold (recompute)"), ("local_hit_ms", "vLLM local hit"),
             ("kvsdk_warm_ms", "kvsdk warm"), ("native_warm_ms", "native warm")]  # fmt: skip
    width = 0.2
    for i, (key, label) in enumerate(cases):
        xs = [j + (i - 1.5) * width for j in range(len(lens))]
        ys = [s["ttft"][n][key] for n in lens]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(lens)), [f"{n} tokens" for n in lens])
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title("1. warm TTFT (median)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    sc = s["sched"]
    vals = [sc["kvsdk_us_per_step"], sc["native_us_per_step"]]
    ax.bar(["kvsdk", "native"], vals, color=["tab:green", "tab:red"])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("us per engine step")
    ax.set_title(f"2. scheduler-side connector time\nkvsdk/native {sc['kvsdk_over_native']:.2f}x",
                 fontsize=10)  # fmt: skip
    ax = axes[2]
    tp = s["throughput"]
    vals = [tp["none_tokens_per_s"], tp["kvsdk_tokens_per_s"]]
    ax.bar(["no connector", "kvsdk"], vals, color=["tab:gray", "tab:green"])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"3. no-reuse throughput\nkvsdk/none {tp['kvsdk_over_none']:.3f}x", fontsize=10)
    if t2:
        ax = axes[3]
        vals = [t2["cold_ms"], t2["local_hit_ms"], t2["kvsdk_warm_ms"]]
        ax.bar(["cold", "vLLM local hit", "kvsdk warm"], vals,
               color=["tab:blue", "tab:orange", "tab:green"])  # fmt: skip
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms, log)")
        ax.set_title(f"4. TP=2, {t2['prompt_len']} tokens (median)\n"
                     f"kvsdk/local {t2['kvsdk_over_local_hit']:.2f}x", fontsize=10)  # fmt: skip
    fig.suptitle(
        f"vLLM-CPU: kvsdk vs native OffloadingConnector ({s['settings']['model']['num_layers']}"
        f" layers, hidden {s['settings']['model']['hidden_size']}, threads: {s['settings']['threads']}"
        ")",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
