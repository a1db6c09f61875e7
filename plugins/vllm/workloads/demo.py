"""``kvsdk demo``: real vLLM with kvsdk's default host-RAM tier, cold vs warm.

Builds a small random-weight Llama locally (no model hub), starts vLLM with
``KVSDKConnector`` and runs a shared-prefix workload (a long document asked
several questions, a multi-turn conversation whose every turn repeats the
previous ones) three times:

- **cold**: every cache is reset before each request: each prompt is computed in full;
- **warm**: the requests in order with kvsdk on; vLLM's own prefix cache is
  reset before each request, so every reused token comes from kvsdk (as
  when vLLM's KV memory is too small to keep earlier requests);
- **reference**: the same requests in order, both caches emptied once
  before the first: each request reuses the earlier ones' KV from vLLM's
  *own* prefix cache (kvsdk, holding the same chunks, has nothing to add:
  the tokens it served here are counted and shown), at the same split as
  the warm run (kvsdk's chunk is one vLLM block here), so the greedy tokens
  and logprobs must equal the warm run's bit for bit.

vLLM runs with its default executor (the scheduler in an EngineCore
process, the model in a worker process): kvsdk's counters (tokens served,
bytes loaded and stored) reach this process through vLLM's stats path, as
``vllm:kvsdk_*`` Prometheus metrics. A cache reset is retried until vLLM
accepts it: kvsdk keeps a finished request's blocks until its stores land,
which the EngineCore finishes on its own after ``generate`` returns.

It prints a table (TTFT cold vs warm, tokens served from kvsdk, bytes moved,
whether the outputs matched) and writes JSON plus a PNG plot.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads import use_cpu_engine_defaults


@dataclass
class Step:
    label: str
    prompt: list[int]
    max_tokens: int = 16


def _workload(seed: int, doc_tokens: int, questions: int, turns: int) -> list[Step]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    doc = toks(doc_tokens)
    steps = [Step(f"doc q{i + 1}", doc + toks(32)) for i in range(questions)]
    system = toks(512)
    convo = list(system)
    for t in range(turns):
        convo = convo + toks(96)
        steps.append(Step(f"chat turn {t + 1}", list(convo)))
        convo = convo + toks(16)  # stands in for the assistant's previous answer
    return steps


def _quiet_cache_resets(out_dir: Path) -> None:
    """vLLM's own log config, but the block pool's "Successfully reset prefix
    cache" (one line per reset, in the EngineCore process: the demo resets
    before every request) only at WARNING, and no chat-template warm-up
    traceback. Unless the caller set a log config."""
    import copy
    import logging
    import os

    if (
        os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0"
    ):
        return
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config: dict[str, Any] = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    config["handlers"]["vllm"]["level"] = level
    config["loggers"]["vllm"]["level"] = level
    for name, quiet in (("vllm.v1.core.block_pool", "WARNING"), ("vllm.renderers.base", "ERROR")):
        config["loggers"][name] = {"handlers": ["vllm"], "level": quiet, "propagate": False}
    # the model has no tokenizer (token-id prompts): vLLM's chat-template warm-up
    # fails by design, with a traceback at WARNING, in this process
    logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
    path = out_dir / "vllm-logging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path.resolve())


def run_demo(
    out: Path,
    *,
    model_dir: Path,
    doc_tokens: int = 2048,
    questions: int = 4,
    turns: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    use_cpu_engine_defaults(kv_cache_gib=2)
    _quiet_cache_resets(out.parent)
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsdk.plugins.vllm.workloads.stats_probe import (
        kvsdk_counters,
        reset_caches,
        shutdown,
        sync_stats,
    )
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    model = make_tiny_llama(
        model_dir,
        seed=seed,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=8192,
    )
    # vLLM's defaults (executor, block size, compilation) and kvsdk's (no config:
    # its 4 GiB host-RAM tier, chunks of the engine's block size)
    ktc = {"kv_connector": "KVSDKConnector", "kv_role": "kv_both"}
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=8192,
        seed=0,
        kv_transfer_config=ktc,
        disable_log_stats=False,
    )
    steps = _workload(seed, doc_tokens, questions, turns)
    sp = SamplingParams(temperature=0.0, logprobs=1, ignore_eos=True)

    def run(step: Step) -> dict[str, Any]:
        params = sp.clone()
        params.max_tokens = step.max_tokens
        t0 = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=step.prompt)], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        c = o.outputs[0]
        ttft = getattr(o.metrics, "first_token_latency", 0.0) or wall
        logprobs: Any = c.logprobs or []
        return {
            "tokens": list(c.token_ids),
            "logprobs": [
                float(lp[t].logprob).hex() for t, lp in zip(c.token_ids, logprobs, strict=True)
            ],
            "cached": o.num_cached_tokens,
            "ttft": ttft,
            "wall": wall,
        }

    def measure() -> tuple[list[Any], ...]:
        run(Step("warmup", steps[0].prompt[:64], 2))  # first-call costs out of the measurement
        bar = tqdm(total=3 * len(steps), desc="kvsdk demo", unit="req", disable=not progress)
        cold = []
        for step in steps:
            reset_caches(llm, connector=True)
            cold.append(run(step))
            bar.update()
        reset_caches(llm, connector=True)
        sync_stats(llm, probed=False)  # every earlier step's counters recorded here
        counters = [kvsdk_counters()]
        warm = []
        for step in steps:
            reset_caches(llm)  # vLLM forgets; kvsdk keeps
            warm.append(run(step))
            bar.update()
        sync_stats(llm, probed=False)
        counters.append(kvsdk_counters())
        reset_caches(llm, connector=True)
        reference = []
        for step in steps:  # the same order, reusing earlier requests through vLLM's own cache
            reference.append(run(step))
            bar.update()
        sync_stats(llm, probed=False)
        counters.append(kvsdk_counters())
        bar.close()
        return cold, warm, reference, counters

    try:
        cold, warm, reference, (before, after, end) = measure()
    finally:
        shutdown(llm)

    def delta(name: str, a: dict[str, float] = before, b: dict[str, float] = after) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    rows = []
    for step, c, w, ref in zip(steps, cold, warm, reference, strict=True):
        assert ref["cached"] == w["cached"], (step.label, ref["cached"], w["cached"])
        rows.append(
            {
                "request": step.label,
                "prompt_tokens": len(step.prompt),
                "kvsdk_tokens": w["cached"],
                "ttft_cold_ms": 1e3 * c["ttft"],
                "ttft_warm_ms": 1e3 * w["ttft"],
                "speedup": c["ttft"] / max(w["ttft"], 1e-9),
                "outputs_match": ref["tokens"] == w["tokens"] and ref["logprobs"] == w["logprobs"],
                "tokens_match_cold": c["tokens"] == w["tokens"],
            }
        )
    result = {
        "model": {"path": str(model), "hidden": 512, "layers": 8, "dtype": "float32"},
        "rows": rows,
        "total_ttft_cold_s": sum(c["ttft"] for c in cold),
        "total_ttft_warm_s": sum(w["ttft"] for w in warm),
        "tokens_from_kvsdk": delta("kvsdk_hit_tokens_total"),  # kvsdk's counter
        "cached_tokens_warm": sum(r["kvsdk_tokens"] for r in rows),  # vLLM's per-request count
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "bytes_loaded": delta("kvsdk_loaded_bytes_total"),
        "bytes_stored": delta("kvsdk_stored_bytes_total"),
        "reference_tokens_from_kvsdk": delta("kvsdk_hit_tokens_total", after, end),
        "outputs_matched": sum(r["outputs_match"] for r in rows),
        "tokens_matched_cold": sum(r["tokens_match_cold"] for r in rows),
        "requests": len(rows),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _plot(result, out.with_suffix(".png"))
    return result


def format_report(r: dict[str, Any]) -> str:
    head = (
        f"{'request':<14}{'prompt':>8}{'from kvsdk':>12}{'TTFT cold':>12}{'TTFT warm':>12}"
        f"{'speedup':>9}  outputs"
    )
    lines = [head, "-" * len(head)]
    for row in r["rows"]:
        lines.append(
            f"{row['request']:<14}{row['prompt_tokens']:>8}{row['kvsdk_tokens']:>12}"
            f"{row['ttft_cold_ms']:>10.1f}ms{row['ttft_warm_ms']:>10.1f}ms"
            f"{row['speedup']:>8.2f}x  {'match' if row['outputs_match'] else 'DIFFER'}"
            + ("  (fills the cache)" if row["kvsdk_tokens"] == 0 else "")
        )
    lines.append("-" * len(head))
    lines.append(
        "(fills the cache): the first request of its workload; nothing to reuse yet, its "
        "prefix is stored for the requests after it"
    )
    lines.append(
        f"total TTFT {1e3 * r['total_ttft_cold_s']:.0f} ms cold -> "
        f"{1e3 * r['total_ttft_warm_s']:.0f} ms warm "
        f"({r['total_ttft_cold_s'] / max(r['total_ttft_warm_s'], 1e-9):.2f}x); "
        f"{r['tokens_from_kvsdk']:.0f}/{r['prompt_tokens']} prompt tokens served from kvsdk; "
        f"{r['bytes_loaded'] / 2**20:.1f} MiB loaded, {r['bytes_stored'] / 2**20:.1f} MiB stored; "
        f"outputs matched {r['outputs_matched']}/{r['requests']} (greedy tokens and logprobs, "
        f"bitwise, vs vLLM's own prefix hit of the same length; kvsdk served "
        f"{r['reference_tokens_from_kvsdk']:.0f} tokens in that reference run); greedy tokens "
        f"equal to the cold run: {r['tokens_matched_cold']}/{r['requests']}"
    )
    return "\n".join(lines)


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(
        [i - 0.2 for i in x], [row["ttft_cold_ms"] for row in rows], 0.4, label="cold (recompute)"
    )
    ax.bar(
        [i + 0.2 for i in x],
        [row["ttft_warm_ms"] for row in rows],
        0.4,
        label="warm (KV from kvsdk)",
    )
    for i, row in enumerate(rows):
        ax.annotate(
            f"{row['kvsdk_tokens']}",
            (i + 0.2, row["ttft_warm_ms"]),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(x), [row["request"] for row in rows], rotation=30, ha="right")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(
        f"vLLM-CPU + kvsdk: TTFT cold vs warm (labels: tokens from kvsdk); "
        f"outputs matched {r['outputs_matched']}/{r['requests']}",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
