"""``kvsdk bench pd``: the same requests on one engine and on a prefill/decode
pair behind vllm-router, TTFT and inter-token latency side by side, outputs
compared.

Two phases, one after the other on fresh processes (the machine's cores are
given to one deployment at a time):

1. **single**: one vLLM server with kvsdk (``kv_both``, host tier only), on
   one core (:func:`~kvsdk.plugins.vllm.workloads.pd_pair.start_single`);
   each prompt is sent cold (the TTFT and ITL compared), then once more,
   loaded from kvsdk: the reference whose logprobs a P/D output must equal
   bit for bit (its prompt split as the decode engine's: all but the last
   token loaded, the last computed);
2. **pd**: a ``kv_producer`` and a ``kv_consumer`` server over a shared tier,
   one core each, vllm-router's P/D mode in front
   (:func:`~kvsdk.plugins.vllm.workloads.pd_pair.start_pair`).

Each deployment gets the same warm-up first, through its endpoint
(:func:`~kvsdk.plugins.vllm.workloads.pd_workload.warm_up`). Then the
workload (:mod:`~kvsdk.plugins.vllm.workloads.pd_workload`) is sent one
request at a time; every engine's ``/metrics`` is read before and after each
prompt length, so the report says what each engine computed and loaded at
that length. Every process is stopped at the end of its phase, whatever the
run ended in (error, Ctrl-C, SIGTERM). The report is
:mod:`~kvsdk.plugins.vllm.workloads.pd_report`.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvsdk.plugins.vllm.workloads.fleet_configs import Shared
from kvsdk.plugins.vllm.workloads.fleet_metrics import delta, parse, total
from kvsdk.plugins.vllm.workloads.fleet_procs import Procs, sigterm_as_interrupt
from kvsdk.plugins.vllm.workloads.pd_pair import (
    Engine,
    PDSettings,
    open_tier,
    start_pair,
    start_single,
)
from kvsdk.plugins.vllm.workloads.pd_workload import PDWorkload, client, prompts, send, warm_up

METRIC_PREFIXES = (
    "vllm:prompt_tokens",
    "vllm:request_prefill_kv_computed_tokens",
    "vllm:prefix_cache",
    "vllm:external_prefix_cache",
    "vllm:request_success",
    "vllm:inter_token_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:kvsdk_",
)


def scrape(engine: Engine) -> dict[str, float]:
    return parse(httpx.get(f"{engine.url}/metrics", timeout=30).text, METRIC_PREFIXES)


def handoffs(d: dict[str, float]) -> dict[str, float]:
    """kvsdk's P/D hand-offs by outcome (``loaded``, ``timeout``, ``foreign``, ...)."""
    out: dict[str, float] = {}
    for key, v in d.items():
        if key.startswith("vllm:kvsdk_pd_handoffs_total{") and "outcome=" in key:
            outcome = key.split("outcome=", 1)[1].split('"', 1)[0].split(",", 1)[0]
            out[outcome] = out.get(outcome, 0.0) + v
    return out


def _mean_ms(d: dict[str, float], histogram: str) -> float:
    return 1e3 * total(d, histogram + "_sum") / max(1.0, total(d, histogram + "_count"))


def engine_figures(d: dict[str, float]) -> dict[str, Any]:
    """What one engine did over a span, from its metrics' difference ``d``
    (tokens; vLLM's own counters, and kvsdk's through vLLM's stats path)."""
    return {
        "requests": total(d, "vllm:request_success_total"),
        "prompt_tokens": total(d, "vllm:prompt_tokens_total"),
        "computed_tokens": total(d, "vllm:request_prefill_kv_computed_tokens_sum"),
        "cached_tokens": total(d, "vllm:prompt_tokens_cached_total"),
        "itl_engine_mean_ms": _mean_ms(d, "vllm:inter_token_latency_seconds"),
        "ttft_engine_mean_ms": _mean_ms(d, "vllm:time_to_first_token_seconds"),
        "e2e_engine_mean_ms": _mean_ms(d, "vllm:e2e_request_latency_seconds"),
        "local_hit_tokens": total(d, "vllm:prefix_cache_hits_total"),
        "external_hit_tokens": total(d, "vllm:external_prefix_cache_hits_total"),
        "kvsdk_hit_tokens": total(d, "vllm:kvsdk_hit_tokens_total"),
        "kvsdk_stored_bytes": total(d, "vllm:kvsdk_stored_bytes_total"),
        "kvsdk_corrupt_chunks": total(d, "vllm:kvsdk_corrupt_chunks_total"),
        "kvsdk_backend_errors": total(d, "vllm:kvsdk_backend_errors_total"),
        "kvsdk_pd_handoffs": handoffs(d),
    }


def run_phase(
    url: str,
    engines: list[Engine],
    model: str,
    w: PDWorkload,
    done: Callable[[], None],
    again: bool = False,
) -> dict[str, Any]:
    """The workload through ``url``: its records, and each engine's figures per
    length. With ``again``, each length's prompts are then sent a second time
    (after its figures were read) into ``reference``: on the single engine,
    loaded from kvsdk as the decode engine loads them."""
    records: list[dict[str, Any]] = []
    reference: list[dict[str, Any]] = []
    per_length: dict[str, dict[str, Any]] = {}
    todo = prompts(w)
    with client(url) as c:
        for length in w.prompt_tokens:
            mine = [p for p in todo if p.length == length]
            before = [scrape(e) for e in engines]
            for p in mine:
                records.append(send(c, model, p, w.max_tokens))
                done()
            time.sleep(0.5)  # the last request's finish reaches vLLM's counters
            after = [scrape(e) for e in engines]
            per_length[str(length)] = {
                e.name: engine_figures(delta(b, a))
                for e, b, a in zip(engines, before, after, strict=True)
            }
            for p in mine if again else []:
                reference.append(send(c, model, p, w.max_tokens))
                done()
    for e in engines:
        e.proc.check_alive()
    return {"records": records, "reference": reference, "engines": per_length}


def run_bench(
    model: str,
    out: Path,
    w: PDWorkload,
    s: PDSettings,
    progress: bool = True,
    model_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Both phases; writes ``out`` (JSON) and its ``.png``; returns the result
    (see :func:`~kvsdk.plugins.vllm.workloads.pd_report.summarize`)."""
    from tqdm import tqdm

    from kvsdk.plugins.vllm.workloads.pd_report import plot, summarize

    out, model = out.resolve(), str(Path(model).resolve())  # processes run in the log dir
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / f"{out.stem}-logs"
    logs.mkdir(exist_ok=True)
    bar = tqdm(total=3 * w.total, desc="bench pd", unit="req", disable=not progress)
    phases: dict[str, Any] = {}
    start_s: dict[str, float] = {}
    try:
        with sigterm_as_interrupt():
            bar.set_description("bench pd: single engine")
            t0 = time.perf_counter()
            with Procs() as procs:
                single = start_single(procs, model, s, logs)
                warm_up(single.url, model, w)
                start_s["single"] = time.perf_counter() - t0
                phases["single"] = run_phase(
                    single.url, [single], model, w, lambda: bar.update(1), again=True
                )
            bar.set_description(f"bench pd: prefill/decode over {s.tier}")
            with (
                tempfile.TemporaryDirectory(prefix=f".{out.stem}-work-", dir=out.parent) as tmp,
                Procs() as procs,  # stopped before the directory goes
            ):
                t0 = time.perf_counter()
                shared = Shared(Path(tmp).resolve(), procs, redis_maxmemory=s.redis_maxmemory)
                below = open_tier(shared, s)
                pair = start_pair(procs, model, s, logs, below)
                warm_up(pair.url, model, w)
                start_s["pd"] = time.perf_counter() - t0
                phases["pd"] = run_phase(
                    pair.url, [pair.prefill, pair.decode], model, w, lambda: bar.update(1)
                )
                pair.router.check_alive()
    finally:
        bar.close()
    result = summarize(phases, w, s, model_info or {}, start_s)
    result["logs"] = str(logs)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    return result
