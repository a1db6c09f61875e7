"""``kvsdk bench fleet``'s share of the recomputable prefix: whole blocks of a
prompt that an earlier prompt of the same user computed (never the last
token), and the shares of it vLLM's own cache and kvsdk returned."""

from __future__ import annotations

from typing import Any

import pytest

from kvsdk.plugins.vllm.workloads.bench_fleet import FleetSettings
from kvsdk.plugins.vllm.workloads.fleet_metrics import engine_figures
from kvsdk.plugins.vllm.workloads.fleet_report import format_report, summarize
from kvsdk.plugins.vllm.workloads.fleet_reuse import recomputable_tokens, reuse_shares
from kvsdk.plugins.vllm.workloads.fleet_workload import Workload, conversations

BLOCK = 128


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_recomputable_is_whole_blocks_of_what_the_same_user_computed_before() -> None:
    a = toks(0, 300)
    b = a + toks(10_000, 50) + toks(20_000, 100)  # a's prompt, a seeded answer, a new message
    c = b + toks(30_000, 50) + toks(40_000, 100)
    requests = [
        (0, a),  # first turn: nothing before it
        (1, a),  # the same tokens, another user: not counted
        (0, b),  # 300 tokens of a: 2 whole blocks
        (0, c),  # 450 tokens of b: 3 whole blocks
    ]
    assert recomputable_tokens(requests, BLOCK) == 256 + 384


def test_the_last_token_of_a_prompt_is_never_recomputable() -> None:
    p = toks(0, 256)
    assert recomputable_tokens([(0, p), (0, p)], BLOCK) == 128  # 255 tokens: one block
    assert recomputable_tokens([(0, p), (0, [*p, 7])], BLOCK) == 256


def test_answer_tokens_in_the_history_were_never_computed() -> None:
    first = toks(0, 200)
    # the next prompt holds the first one's 200 tokens and a 100-token answer: only the
    # first 200 tokens were computed (the model's own answer differed), so one block
    second = first + toks(5_000, 100) + toks(6_000, 100)
    assert recomputable_tokens([(0, first), (0, second)], BLOCK) == 128
    # the longest common prefix with any earlier prompt of the user: third shares 300
    # tokens with second (computed as second's prompt), 200 with first
    third = first + toks(5_000, 100) + toks(9_000, 100)
    assert recomputable_tokens([(0, first), (0, second), (0, third)], BLOCK) == 128 + 256


def test_shares_of_the_recomputable_prefix() -> None:
    s = reuse_shares(1000, local_hits=400, kvsdk_tokens=570)
    assert s["kvsdk_share"] == pytest.approx(570 / 600)
    assert s["fleet_share"] == pytest.approx(970 / 1000)
    assert reuse_shares(512, local_hits=512, kvsdk_tokens=0)["kvsdk_share"] is None
    assert reuse_shares(0, 0, 0)["fleet_share"] is None


def test_the_bench_workload_counts_each_history_once() -> None:
    w = Workload(users=3, rounds=3, system_tokens=300, user_tokens=100, answer_tokens=50)
    prompts = [(r.user, r.prompt) for batch in conversations(w) for r in batch]
    # round 1 reuses the 400-token first prompt (3 blocks), round 2 the 550-token second (4)
    assert recomputable_tokens(prompts, BLOCK) == 3 * (384 + 512)


def _run(config: str, p: int, local: list[int], kvsdk: list[int], w: Workload) -> dict[str, Any]:
    records = [
        {"user": r.user, "round": r.round, "tokens": [1, 2], "error": None, "ttft_ms": 10.0,
         "latency_ms": 20.0, "sent_s": 0.1 * i}
        for i, r in enumerate(x for batch in conversations(w) for x in batch)
    ]  # fmt: skip
    engines = []
    for hits, loaded in zip(local, kvsdk, strict=True):
        e = engine_figures({})
        e.update(prefix_hits=hits, prefix_queries=2000, kvsdk_hit_tokens=loaded)
        engines.append(e)
    return {"config": config, "pass": p, "records": records, "wall_s": 2.0, "start_s": 1.0,
            "engines": engines}  # fmt: skip


def test_the_report_gives_each_pass_its_shares() -> None:
    w = Workload(users=3, rounds=2, system_tokens=300, user_tokens=100, answer_tokens=50)
    recomputable = 3 * 384
    runs = [
        _run("none-rr", 0, [384, 0], [0, 0], w),
        _run("kvsdk-redis-rr", 0, [384, 0], [768, 0], w),
        _run("none-rr", 1, [0, 0], [0, 0], w),
        _run("kvsdk-redis-rr", 1, [0, 0], [640, 384], w),
    ]
    r = summarize(runs, ["none-rr", "kvsdk-redis-rr"], w, FleetSettings(), 2, {})
    assert r["workload"]["recomputable_tokens_per_pass"] == recomputable
    kv = r["results"]["kvsdk-redis-rr"]["reuse_per_pass"]
    assert [x["kvsdk_share"] for x in kv] == [1.0, pytest.approx(1024 / 1152)]
    assert [x["fleet_share"] for x in kv] == [1.0, pytest.approx(1024 / 1152)]
    none = r["results"]["none-rr"]["reuse_per_pass"]
    assert [x["fleet_share"] for x in none] == [pytest.approx(384 / 1152), 0.0]
    text = format_report(r)
    assert "kvsdk-redis-rr          kvsdk 1.00/0.89  fleet 1.00/0.89" in text
    assert "none-rr                 fleet 0.33/0.00" in text
