"""``kvsdk bench fleet``'s failover report: a run that killed a master is cut
into stretches by send time (before the kill, to the promotion, after it),
each with its requests' p50 TTFT and the fleet's figures the bench read at
the kill and the promotion; the tiers that need servers are configurations
like any other."""

from __future__ import annotations

from typing import Any

from kvsdk.plugins.vllm.workloads.bench_fleet import FleetSettings
from kvsdk.plugins.vllm.workloads.fleet_configs import parse_config
from kvsdk.plugins.vllm.workloads.fleet_metrics import engine_figures
from kvsdk.plugins.vllm.workloads.fleet_mooncake import master_gauge
from kvsdk.plugins.vllm.workloads.fleet_report import format_report, summarize
from kvsdk.plugins.vllm.workloads.fleet_workload import Workload, conversations

W = Workload(users=2, rounds=3, system_tokens=300, user_tokens=100, answer_tokens=50)
TTFT = [100.0, 110.0, 900.0, 1100.0, 120.0, 130.0]
"""Per request in send order: slow between the kill (1.0 s) and the promotion (2.5 s)."""


def _figures(loaded_shared: float, tokens: float, errors: float) -> dict[str, Any]:
    f = engine_figures({})
    f.update(kvsdk_hit_tokens=tokens, kvsdk_backend_errors=errors,
             kvsdk_loaded_bytes={"0": loaded_shared, "1": loaded_shared})  # fmt: skip
    return f


def _run(config: str, failover: bool) -> dict[str, Any]:
    reqs = [r for batch in conversations(W) for r in batch]
    records = [
        {"user": r.user, "round": r.round, "tokens": [5, 6], "error": None, "ttft_ms": ttft,
         "latency_ms": ttft + 50, "sent_s": 0.2 + 0.6 * i}
        for i, (r, ttft) in enumerate(zip(reqs, TTFT, strict=True))
    ]  # fmt: skip
    run: dict[str, Any] = {"config": config, "pass": 0, "records": records, "wall_s": 4.0,
                           "start_s": 1.0, "engines": [engine_figures({})]}  # fmt: skip
    if failover:
        run["failover"] = {
            "killed_master": "127.0.0.1:7001", "promoted_replica": "127.0.0.1:7004",
            "kill_after_share": 0.4, "kill_after_requests": 2, "kill_s": 1.0,
            "promoted_s": 2.5, "promotion_after_kill_s": 1.5, "workload_wall_s": 4.0,
            "error": None,
            "stretches": {"before_kill": _figures(2 << 20, 256, 0),
                          "kill_to_promotion": _figures(0, 0, 7),
                          "after_promotion": _figures(3 << 20, 384, 0)},
        }  # fmt: skip
    return run


def test_a_killed_masters_run_is_cut_into_stretches_by_send_time() -> None:
    name = "kvsdk-redis_cluster_failover-rr"
    r = summarize([_run("none-rr", False), _run(name, True)], ["none-rr", name], W,
                  FleetSettings(), 1, {})  # fmt: skip
    assert r["results"]["none-rr"]["failover_per_pass"] == []
    (f,) = r["results"][name]["failover_per_pass"]
    assert f["killed_master"] == "127.0.0.1:7001" and f["promotion_after_kill_s"] == 1.5
    st = f["stretches"]
    # sent at 0.2, 0.8 | 1.4, 2.0 | 2.6, 3.2
    assert [st[k]["requests"] for k in ("before_kill", "kill_to_promotion", "after_promotion")] == [
        2, 2, 2,
    ]  # fmt: skip
    assert st["before_kill"]["ttft_p50_ms"] == 105.0
    assert st["kill_to_promotion"]["ttft_p50_ms"] == 1000.0
    assert st["after_promotion"]["ttft_p50_ms"] == 125.0
    assert st["kill_to_promotion"]["backend_errors"] == 7
    assert st["after_promotion"]["shared_tier_read_bytes"] == 3 << 20
    assert st["after_promotion"]["kvsdk_hit_tokens"] == 384
    r["failover_plot"] = "/out/fleet-failover.png"
    text = format_report(r)
    assert (
        f"failover {name} pass 0: master 127.0.0.1:7001 killed at 1.0 s (after 2 of 6 "
        "requests), replica promoted 1.5 s later; before the kill / to the promotion / after "
        "it: requests 2/2/2, p50 TTFT 105/1000/125 ms, kvsdk tokens 256/0/384, read from the "
        "shared tier 2.0/0.0/3.0 MiB, backend errors 0/7/0"
    ) in text
    assert "TTFT over time around each kill: /out/fleet-failover.png" in text


def test_the_distributed_tiers_are_configurations() -> None:
    for tier, key in (("mooncake", ""), ("redis_cluster", ""),
                      ("redis_cluster_failover", "failover")):  # fmt: skip
        config = parse_config(f"kvsdk-{tier}-rr")
        assert config.tier is not None and config.tier.name == tier
        assert config.tier.record_key == key


def test_the_mooncake_masters_capacity_is_read_from_its_metrics() -> None:
    text = (
        "# TYPE master_total_capacity_bytes gauge\n"
        "master_total_capacity_bytes 6442450944\n"
        'segment_total_capacity_bytes{segment="127.0.0.1:13785"} 6442450944\n'
    )
    assert master_gauge(text, "master_total_capacity_bytes") == 6442450944
    assert master_gauge(text, "segment_total_capacity_bytes") == 6442450944
    assert master_gauge(text, "master_allocated_bytes") is None
