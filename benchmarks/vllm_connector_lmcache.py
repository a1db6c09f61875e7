"""The LMCache peer's part of ``bench_vllm_connector.py``'s report: its figures
beside native's (warm TTFT, scheduler-side time), and the check that every
engine gave every prompt the same greedy token.

Scheduler-side time is compared over the whole trace, not per engine step:
LMCache looks a request's prefix up asynchronously (its
``get_num_new_matched_tokens`` answers "not yet" until its server replies, and
vLLM retries on the next step), so its engine runs many more, mostly empty,
steps for the same requests, and a per-step figure would credit it for them.
The per-step figures are kept in the JSON. vLLM calls a connector's
``request_finished_all_groups`` or its ``request_finished``, never both;
LMCache's first calls its second, which the timer wraps too, so that time is
counted once here."""

from __future__ import annotations

from typing import Any

from vllm_connector_report import median

LMCACHE = "lmcache"


def same_tokens(runs: dict[str, dict[str, Any]], configs: tuple[str, ...]) -> dict[str, Any]:
    """Part 1's first tokens compared across engines: for each prompt (length,
    repeat), the greedy token of every run of it (cold, local hit, each
    connector's cold and warm run) must be one token. Returns the count of
    prompts compared and the ones that disagree (``{"length/rep": {...}}``)."""
    compared, differ = 0, {}
    lengths = runs[configs[0]]["ttft"]
    for length in lengths:
        reps = len(runs[configs[0]]["ttft"][length]["cold"])
        for rep in range(reps):
            seen = {
                f"{config}/{case}": ms[rep]["token"]
                for config in configs
                for case, ms in runs[config]["ttft"][length].items()
            }
            compared += 1
            if len(set(seen.values())) != 1:
                differ[f"{length}/{rep}"] = seen
    return {"prompts": compared, "differ": differ, "all_same": not differ}


def _total_ms(sched: dict[str, Any]) -> float:
    """Scheduler-side wall time over the trace, ``request_finished`` counted
    once where ``request_finished_all_groups`` called it (see the module doc)."""
    methods = sched["methods"]
    total = 1e3 * float(sched["all_total_s"])
    if "request_finished_all_groups" in methods and "request_finished" in methods:
        total -= methods["request_finished"]["total_ms"]
    return total


def summarize_lmcache(
    summary: dict[str, Any], runs: dict[str, dict[str, Any]], configs: tuple[str, ...]
) -> None:
    """Adds LMCache's figures to ``summary`` (``vllm_connector_report.summarize``'s)."""
    lm = runs[LMCACHE]
    for length, row in summary["ttft"].items():

        def med(case: str, key: str = "s", length: str = length) -> float:
            return median(m[key] for m in lm["ttft"][length][case])

        row["lmcache_warm_ms"] = 1e3 * med("warm")
        row["lmcache_cold_ms"] = 1e3 * med("cold_with_connector")
        row["cached_tokens"]["lmcache_warm"] = med("warm", "cached")
        row["cpu_ms"]["lmcache_warm"] = 1e3 * med("warm", "cpu_s")
        row["kvsdk_over_lmcache"] = row["kvsdk_warm_ms"] / row["lmcache_warm_ms"]
        row["lmcache_over_local_hit"] = row["lmcache_warm_ms"] / row["local_hit_ms"]
        row["lmcache_over_native"] = row["lmcache_warm_ms"] / row["native_warm_ms"]
        row["lmcache_same_token"] = all(
            m.get("same_token_as_first", True) for case in lm["ttft"][length].values() for m in case
        )
    sc, ls = summary["sched"], lm["sched"]
    sc[LMCACHE] = ls
    ks = sc["kvsdk"]
    sc["lmcache_us_per_step"] = ls["all_us_per_step"]
    sc["lmcache_total_ms"] = _total_ms(ls)
    sc["kvsdk_total_ms"] = _total_ms(ks)
    # the same trace's requests: total scheduler-side time (see the module doc)
    sc["kvsdk_over_lmcache"] = sc["kvsdk_total_ms"] / sc["lmcache_total_ms"]
    sc["kvsdk_over_lmcache_per_step"] = ks["all_us_per_step"] / ls["all_us_per_step"]
    summary["same_tokens"] = same_tokens(runs, configs)
    summary["settings"]["lmcache"] = lm.get("lmcache_server")


def format_lmcache(s: dict[str, Any]) -> str:
    """The LMCache rows, printed after the main table."""
    head = (
        f"{'prompt':>7} {'lmcache warm':>13} {'kvsdk/lmcache':>14} {'lmcache/native':>15}"
        f" {'lmcache/local':>14} {'recomputed':>11}"
    )
    lines = ["LMCache (multi-process server, LMCacheMPConnector): 1. warm TTFT", head]
    lines.append("-" * len(head))
    for length, r in s["ttft"].items():
        recomputed = int(length) - r["cached_tokens"]["lmcache_warm"]
        lines.append(
            f"{length:>7} {r['lmcache_warm_ms']:>11.1f}ms {r['kvsdk_over_lmcache']:>13.2f}x"
            f" {r['lmcache_over_native']:>14.2f}x {r['lmcache_over_local_hit']:>13.2f}x"
            f" {recomputed:>11.0f}"
        )
    sc = s["sched"]
    lines.append(
        f"   2. scheduler-side connector time over the whole trace: lmcache"
        f" {sc['lmcache_total_ms']:.1f} ms ({sc[LMCACHE]['steps']} steps), kvsdk"
        f" {sc['kvsdk_total_ms']:.1f} ms ({sc['kvsdk']['steps']} steps);"
        f" kvsdk/lmcache {sc['kvsdk_over_lmcache']:.2f}x"
    )
    top = sorted(sc[LMCACHE]["methods"].items(), key=lambda kv: -kv[1]["total_ms"])
    lines.append(
        "   lmcache: " + ", ".join(f"{m} {v['total_ms']:.1f}ms/{v['calls']}" for m, v in top[:6])
    )
    st = s["same_tokens"]
    verdict = "yes" if st["all_same"] else f"NO ({', '.join(st['differ'])})"
    lines.append(
        f"   same greedy token from every engine and run, {st['prompts']} prompts: {verdict}"
    )
    return "\n".join(lines)
