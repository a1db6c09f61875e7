"""The deployments ``kvsdk bench pd`` compares, started as users start them.

- :func:`start_single`: one ``vllm serve`` (vLLM's OpenAI server) with kvsdk,
  ``kv_role: kv_both``, on one core, vLLM's own prefix cache off: a prompt
  sent again is loaded from kvsdk, split as the decode engine splits it
  (all but the last token loaded), which makes it the reference a P/D
  output must equal bit for bit.
- :func:`start_pair`: a prefill server (``kv_role: kv_producer``) and a decode
  server (``kv_role: kv_consumer``), one core each, kvsdk in both over one
  shared tier below each engine's host tier (a shared disk directory, or one
  loopback Redis: :data:`~kvsdk.plugins.vllm.workloads.fleet_configs.TIERS`),
  and ``vllm-router --vllm-pd-disaggregation --prefill URL --decode URL`` in
  front of them.

vllm-router's vLLM P/D mode drives any connector: for each request it sends
the client's body to the prefill server with ``max_tokens=1``, ``stream:
false`` and ``kv_transfer_params: {"do_remote_decode": true, ...}``, then the
client's body to the decode server with the prefill response's
``kv_transfer_params`` copied verbatim, and answers with the decode server's
(streamed) response: what vLLM's documented P/D proxy does. So the harness
needs no proxy of its own.

Processes come from :mod:`~kvsdk.plugins.vllm.workloads.fleet_procs` (each
in its own process group, stopped whole by :class:`Procs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_configs import TIERS, Shared
from kvsdk.plugins.vllm.workloads.fleet_procs import (
    Proc,
    Procs,
    engine_argv,
    free_port,
    pinned,
    router_binary,
)

PD_TIERS = ("disk", "redis")


@dataclass(frozen=True)
class PDSettings:
    tier: str = "disk"
    host_bytes: int = 1 << 30
    kv_cache_gib: int = 1
    redis_maxmemory: str = "4gb"
    max_model_len: int = 8192
    pin: bool = True
    start_timeout_s: float = 600.0


@dataclass
class Engine:
    name: str
    proc: Proc
    url: str


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    router: Proc
    url: str
    """The router's: what clients send to."""


def kv_transfer(role: str, host_bytes: int, below: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvsdk in ``role``: its defaults but a
    host tier of ``host_bytes`` and, when given, the shared tier ``below`` it."""
    tiers = [{"backend": "cpu", "capacity": host_bytes}, *([below] if below else [])]
    return {
        "kv_connector": "KVSDKConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"config": {"tiers": tiers}},
    }


def cores(pin: bool, n: int) -> list[int | None]:
    """The first ``n`` cores this process may use, or None each (unpinned)."""
    mine = sorted(os.sched_getaffinity(0))
    if not pin or len(mine) < n:
        return [None] * n
    return [*mine[:n]]


def _engine(
    procs: Procs, name: str, model: str, kv: dict[str, Any], core: int | None,
    s: PDSettings, logs: Path, extra: list[str] | None = None,
) -> Engine:  # fmt: skip
    port = free_port()
    argv, env = pinned(engine_argv(model, port, kv, s.max_model_len, extra), core)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_gib)
    return Engine(name, procs.add(Proc(name, argv, logs, env)), f"http://127.0.0.1:{port}")


def start_single(procs: Procs, model: str, s: PDSettings, logs: Path) -> Engine:
    """One engine with kvsdk (host tier alone, ``kv_both``), vLLM's prefix cache off; ready."""
    kv = kv_transfer("kv_both", s.host_bytes, None)
    core = cores(s.pin, 1)[0]
    engine = _engine(procs, "single", model, kv, core, s, logs, ["--no-enable-prefix-caching"])
    engine.proc.wait_http(f"{engine.url}/health", s.start_timeout_s)
    return engine


def open_tier(shared: Shared, s: PDSettings) -> dict[str, Any]:
    """Start what the shared tier needs (Redis), empty it; its kvsdk tier entry."""
    if s.tier not in PD_TIERS:
        raise ValueError(f"tier {s.tier!r}: expected one of {', '.join(PD_TIERS)}")
    spec = TIERS[s.tier]
    spec.open(shared)
    spec.reset(shared)
    entry = spec.tier(shared)
    assert entry is not None
    return entry


def pd_router_argv(port: int, prefill: str, decode: str, log_dir: Path) -> list[str]:
    exe = router_binary()
    if exe is None:
        raise RuntimeError("vllm-router is not installed (scripts/install_vllm_router.sh)")
    return [
        exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
        "--prefill", prefill, "--decode", decode, "--policy", "round_robin",
        "--worker-startup-check-interval", "1", "--log-dir", str(log_dir),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip


def start_pair(procs: Procs, model: str, s: PDSettings, logs: Path, below: dict[str, Any]) -> Pair:
    """Prefill and decode engines over the shared tier ``below``, the router; ready."""
    core_p, core_d = cores(s.pin, 2)
    prefill = _engine(
        procs, "prefill", model, kv_transfer("kv_producer", s.host_bytes, below), core_p, s, logs
    )
    decode = _engine(
        procs, "decode", model, kv_transfer("kv_consumer", s.host_bytes, below), core_d, s, logs
    )
    for e in (prefill, decode):
        e.proc.wait_http(f"{e.url}/health", s.start_timeout_s)
    port = free_port()
    argv = pd_router_argv(port, prefill.url, decode.url, logs / "router")
    router = procs.add(Proc("router", argv, logs))
    url = f"http://127.0.0.1:{port}"
    router.wait_http(f"{url}/health", 120)
    return Pair(prefill, decode, router, url)
