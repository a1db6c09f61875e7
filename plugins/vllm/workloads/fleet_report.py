"""The report of ``kvsdk bench fleet``: per configuration, figures pooled over
its passes, ratios to the baselines (``none-rr``, ``none-cache_aware``), the
share of the recomputable prefix each pass reused (:mod:`.fleet_reuse`), a
killed master's stretches (before the kill, to the promotion, after it), the
outputs compared with ``none-rr``'s, the table and the plots."""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_configs import BASELINES, VLLM_CPU_BLOCK_SIZE
from kvsdk.plugins.vllm.workloads.fleet_metrics import merge_histograms
from kvsdk.plugins.vllm.workloads.fleet_reuse import recomputable_tokens, reuse_shares
from kvsdk.plugins.vllm.workloads.fleet_workload import conversations

SHARED_TIER = "1"
"""kvsdk's number for the tier below the host tier (metrics' ``tier`` label)."""


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _p50(run: dict[str, Any]) -> float:
    return percentile([x["ttft_ms"] for x in run["records"] if x["error"] is None], 0.5)


def _reuse(run: dict[str, Any], recomputable: int) -> dict[str, Any]:
    return reuse_shares(
        recomputable,
        sum(e["prefix_hits"] for e in run["engines"]),
        sum(e["kvsdk_hit_tokens"] for e in run["engines"]),
    )


def _failover(run: dict[str, Any]) -> dict[str, Any]:
    """A killed master's run: its record, and per stretch (before the kill, kill to
    promotion, after the promotion; by send time) the requests, their p50 TTFT,
    the tokens kvsdk loaded, the bytes read from the shared tier (chunks a lookup
    found there, promoted to the host tier, then loaded) and kvsdk's backend errors."""
    f = run["failover"]
    kill = f["kill_s"] if f["kill_s"] is not None else float("inf")
    promoted = f["promoted_s"] if f["promoted_s"] is not None else float("inf")
    bounds = {"before_kill": (0.0, kill), "kill_to_promotion": (kill, promoted),
              "after_promotion": (promoted, float("inf"))}  # fmt: skip
    stretches = {}
    for name, (lo, hi) in bounds.items():
        recs = [x for x in run["records"] if lo <= x["sent_s"] < hi and x["error"] is None]
        figures = f["stretches"].get(name) or {}
        stretches[name] = {
            "requests": len(recs),
            "ttft_p50_ms": percentile([x["ttft_ms"] for x in recs], 0.5),
            "shared_tier_read_bytes": figures.get("kvsdk_loaded_bytes", {}).get(SHARED_TIER, 0.0)
            if figures
            else None,
            "kvsdk_hit_tokens": figures.get("kvsdk_hit_tokens"),
            "backend_errors": figures.get("kvsdk_backend_errors"),
        }
    return {"pass": run["pass"], **{k: v for k, v in f.items() if k != "stretches"},
            "stretches": stretches}  # fmt: skip


def _config_figures(runs: list[dict[str, Any]], recomputable: int) -> dict[str, Any]:
    records = [rec for run in runs for rec in run["records"]]
    ttfts = [rec["ttft_ms"] for rec in records if rec["error"] is None]
    engines = [e for run in runs for e in run["engines"]]
    queries = sum(e["prefix_queries"] for e in engines)
    hist = merge_histograms([e["lookup_wait_async"] for e in engines])
    return {
        "requests": len(records),
        "errors": sum(rec["error"] is not None for rec in records),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p90_ms": percentile(ttfts, 0.9),
        "req_per_s": statistics.fmean(len(run["records"]) / run["wall_s"] for run in runs),
        "req_per_s_per_pass": [len(run["records"]) / run["wall_s"] for run in runs],
        "local_prefix_hit_share": sum(e["prefix_hits"] for e in engines) / queries
        if queries
        else 0.0,
        "kvsdk_loaded_tokens_per_pass": statistics.fmean(
            sum(e["kvsdk_hit_tokens"] for e in run["engines"]) for run in runs
        ),
        "lookup_wait_ms_per_request": 1e3 * hist["sum_s"] / max(1, len(records)),
        "lookup_waits": hist["count"],
        "lookup_wait_histogram": hist,
        "backend_errors": sum(e["kvsdk_backend_errors"] for e in engines),
        "failed_jobs": sum(e["kvsdk_failed_jobs"] for e in engines),
        "corrupt_chunks": sum(e["kvsdk_corrupt_chunks"] for e in engines),
        "engine_requests": [e["requests"] for e in engines],
        "start_s": statistics.fmean(run["start_s"] for run in runs),
        "reuse_per_pass": [_reuse(run, recomputable) for run in runs],
        "failover_per_pass": [_failover(run) for run in runs if "failover" in run],
    }


def _outputs(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Every request's greedy tokens against ``none-rr``'s first pass."""
    ref_run = next(r for r in runs if r["config"] == "none-rr" and r["pass"] == 0)
    ref = {(rec["user"], rec["round"]): rec["tokens"] for rec in ref_run["records"]}
    per_config: dict[str, dict[str, int]] = {n: {"matched": 0, "compared": 0} for n in names}
    mismatches = []
    for run in runs:
        for rec in run["records"]:
            want = ref.get((rec["user"], rec["round"]))
            if rec["error"] is not None or want is None:
                continue
            per_config[run["config"]]["compared"] += 1
            if rec["tokens"] == want:
                per_config[run["config"]]["matched"] += 1
            else:
                at = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(rec["tokens"], want, strict=False))
                        if a != b
                    ),
                    min(len(rec["tokens"]), len(want)),
                )
                mismatches.append(
                    {"config": run["config"], "pass": run["pass"], "user": rec["user"],
                     "round": rec["round"], "first_diff_at": at, "got": rec["tokens"],
                     "want": want}
                )  # fmt: skip
    matched = sum(c["matched"] for c in per_config.values())
    compared = sum(c["compared"] for c in per_config.values())
    return {"matched": matched, "compared": compared, "per_config": per_config,
            "mismatches": mismatches}  # fmt: skip


def summarize(
    runs: list[dict[str, Any]],
    names: list[str],
    workload: Any,
    settings: Any,
    passes: int,
    model_info: dict[str, Any],
) -> dict[str, Any]:
    recomputable = recomputable_tokens(
        ((req.user, req.prompt) for batch in conversations(workload) for req in batch),
        VLLM_CPU_BLOCK_SIZE,
    )
    results = {
        n: _config_figures([r for r in runs if r["config"] == n], recomputable) for n in names
    }
    ratios: dict[str, dict[str, Any]] = {}
    for base in (b for b in BASELINES if b in names):
        ratios[base] = {}
        for n in names:
            pairs = [
                (a, b)
                for a in runs
                if a["config"] == n
                for b in runs
                if b["config"] == base and b["pass"] == a["pass"]
            ]
            per_pass = [len(a["records"]) / a["wall_s"] / (len(b["records"]) / b["wall_s"])
                        for a, b in pairs]  # fmt: skip
            ratios[base][n] = {
                "ttft_p50": results[n]["ttft_p50_ms"] / results[base]["ttft_p50_ms"],
                "ttft_p90": results[n]["ttft_p90_ms"] / results[base]["ttft_p90_ms"],
                "throughput": statistics.fmean(per_pass),
                "throughput_per_pass": per_pass,
                "ttft_p50_per_pass": [_p50(a) / _p50(b) for a, b in pairs],
            }
    return {
        "workload": workload.as_dict()
        | {"requests_per_pass": workload.requests, "recomputable_tokens_per_pass": recomputable},
        "settings": asdict(settings),
        "model": model_info,
        "passes": passes,
        "configs": names,
        "cpus": len(os.sched_getaffinity(0)),
        "results": results,
        "ratios": ratios,
        "outputs": _outputs(runs, names),
        "runs": runs,
    }


def _name_width(names: list[str]) -> int:
    return max(24, *(len(n) + 2 for n in names))


def format_report(r: dict[str, Any]) -> str:
    names = r["configs"]
    w = _name_width(names)
    head = (
        f"{'config':<{w}}{'p50 ms':>9}{'p90 ms':>9}{'req/s':>8}{'local hit':>10}"
        f"{'kvsdk tok':>11}{'wait ms/req':>12}{'backend err':>12}{'req err':>8}"
    )
    lines = [head]
    for n in names:
        x = r["results"][n]
        lines.append(
            f"{n:<{w}}{x['ttft_p50_ms']:>9.0f}{x['ttft_p90_ms']:>9.0f}{x['req_per_s']:>8.3f}"
            f"{x['local_prefix_hit_share']:>10.2f}{x['kvsdk_loaded_tokens_per_pass']:>11.0f}"
            f"{x['lookup_wait_ms_per_request']:>12.1f}{x['backend_errors']:>12.0f}"
            f"{x['errors']:>8}"
        )
    for base, rows in r["ratios"].items():
        lines.append(
            f"vs {base}: p50 TTFT ratio (over every pass's requests; per pass), "
            "throughput ratio (mean of per-pass ratios)"
        )
        for n in names:
            if n != base:
                q = rows[n]
                each = "/".join(f"{x:.2f}" for x in q["ttft_p50_per_pass"])
                lines.append(f"  {n:<{w}}{q['ttft_p50']:>7.3f}x ({each})  {q['throughput']:>7.3f}x")
    lines += _reuse_lines(r)
    lines += _failover_lines(r)
    o = r["outputs"]
    lines.append(
        f"outputs (greedy token ids) equal to none-rr's: {o['matched']}/{o['compared']} "
        + "("
        + ", ".join(f"{n} {c['matched']}/{c['compared']}" for n, c in o["per_config"].items())
        + ")"
    )
    for m in o["mismatches"][:20]:
        lines.append(
            f"  MISMATCH {m['config']} pass {m['pass']} user {m['user']} round {m['round']}: "
            f"first differs at token {m['first_diff_at']}: {m['got']} vs {m['want']}"
        )
    w, s = r["workload"], r["settings"]
    lines.append(
        f"{w['users']} users x {w['rounds']} rounds x {r['passes']} passes per config; prompts "
        f"up to {w['system_tokens'] + w['rounds'] * w['user_tokens'] + (w['rounds'] - 1) * w['answer_tokens']} "
        f"tokens, {w['max_tokens']} streamed, {w['concurrency']} in flight; host tier "
        f"{s['host_bytes'] >> 20} MiB per engine; {r['cpus']} CPUs; model {r['model']}"
    )
    return "\n".join(lines)


def _shares(values: list[float | None]) -> str:
    return "/".join("-" if v is None else f"{v:.2f}" for v in values)


def _reuse_lines(r: dict[str, Any]) -> list[str]:
    w = _name_width(r["configs"])
    lines = [
        f"recomputable prefix: {r['workload']['recomputable_tokens_per_pass']} tokens per pass "
        f"(whole {VLLM_CPU_BLOCK_SIZE}-token blocks of each prompt an earlier turn of its user "
        "computed); per pass: kvsdk = kvsdk tokens / (recomputable - vLLM's own hits), "
        "fleet = (vLLM's own hits + kvsdk tokens) / recomputable"
    ]
    for n in r["configs"]:
        reuse = r["results"][n]["reuse_per_pass"]
        kvsdk = (
            "" if n.startswith("none-") else f"kvsdk {_shares([x['kvsdk_share'] for x in reuse])}  "
        )
        lines.append(f"  {n:<{w}}{kvsdk}fleet {_shares([x['fleet_share'] for x in reuse])}")
    return lines


def _ms(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.0f}"


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / (1 << 20):.1f}"


def _failover_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for n in r["configs"]:
        for f in r["results"][n]["failover_per_pass"]:
            if f["kill_s"] is None:
                lines.append(f"failover {n} pass {f['pass']}: no master killed ({f['error']})")
                continue
            after = (
                "not promoted"
                if f["promotion_after_kill_s"] is None
                else f"replica promoted {f['promotion_after_kill_s']:.1f} s later"
            )
            st = [
                f["stretches"][k] for k in ("before_kill", "kill_to_promotion", "after_promotion")
            ]
            lines.append(
                f"failover {n} pass {f['pass']}: master {f['killed_master']} killed at "
                f"{f['kill_s']:.1f} s (after {f['kill_after_requests']} of "
                f"{r['workload']['requests_per_pass']} requests), {after}; before the kill / to "
                f"the promotion / after it: requests {'/'.join(str(x['requests']) for x in st)}, "
                f"p50 TTFT {'/'.join(_ms(x['ttft_p50_ms']) for x in st)} ms, kvsdk tokens "
                f"{'/'.join(_ms(x['kvsdk_hit_tokens']) for x in st)}, read from the shared tier "
                f"{'/'.join(_mib(x['shared_tier_read_bytes']) for x in st)} MiB, backend errors "
                f"{'/'.join(_ms(x['backend_errors']) for x in st)}"
            )
    if any(r["results"][n]["failover_per_pass"] for n in r["configs"]) and r.get("failover_plot"):
        lines.append(f"TTFT over time around each kill: {r['failover_plot']}")
    return lines


def plot_failover(r: dict[str, Any], path: Path) -> bool:
    """TTFT against send time for each run that killed a master (none-rr's same
    pass in grey), the kill and the promotion marked; False: no such run."""
    runs = [run for run in r["runs"] if "failover" in run]
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        base = next((b for b in r["runs"] if b["config"] == "none-rr" and b["pass"] == run["pass"]),
                    None)  # fmt: skip
        for other, style in ((base, {"color": "0.6", "label": "none-rr"}),
                             (run, {"color": "C0", "label": run["config"]})):  # fmt: skip
            if other is None:
                continue
            ok = [x for x in other["records"] if x["error"] is None]
            ax.scatter([x["sent_s"] for x in ok], [x["ttft_ms"] for x in ok], s=12, **style)
        f = run["failover"]
        if f["kill_s"] is not None:
            ax.axvline(f["kill_s"], color="C3", linestyle="--", label="master killed")
        if f["promoted_s"] is not None:
            ax.axvline(f["promoted_s"], color="C2", linestyle="--", label="replica promoted")
        ax.set_xlabel("request sent (s since the workload began)")
        ax.set_ylabel("TTFT at the client (ms)")
        ax.set_title(f"{run['config']} pass {run['pass']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("a Redis Cluster master killed (kill -9) under load: TTFT over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = r["configs"]
    res = r["results"]
    xs = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.4
    axes[0].bar([x - width / 2 for x in xs], [res[n]["ttft_p50_ms"] for n in names], width,
                label="p50")  # fmt: skip
    axes[0].bar([x + width / 2 for x in xs], [res[n]["ttft_p90_ms"] for n in names], width,
                label="p90")  # fmt: skip
    axes[0].set_ylabel("TTFT at the client (ms)")
    axes[0].legend()
    axes[1].bar(list(xs), [res[n]["req_per_s"] for n in names])
    axes[1].set_ylabel("throughput (requests/s)")
    for ax in axes[:2]:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    hists = {
        n: res[n]["lookup_wait_histogram"] for n in names if res[n]["lookup_wait_histogram"]["le"]
    }
    ax = axes[2]
    if hists:
        le = next(iter(hists.values()))["le"]
        labels = [f"≤{b:g}s" if b != "+Inf" else ">5s" for b in le]
        bw = 0.8 / len(hists)
        for i, (n, h) in enumerate(hists.items()):
            ax.bar([j + i * bw for j in range(len(le))], h["counts"], bw, label=n)
        ax.set_xticks([j + 0.4 - bw / 2 for j in range(len(le))])
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    ax.set_ylabel("lookups waited on (count)")
    ax.set_title('kvsdk_lookup_delay_seconds{kind="async"}', fontsize=9)
    fig.suptitle("two vLLM-CPU engines behind vllm-router: TTFT, throughput, kvsdk's lookup waits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
