"""``kvsdk bench pd``'s report and figures without engines: a P/D output
counts as equal only when its token ids equal both single-engine runs' and
its logprobs equal the reference run's bit for bit; each engine's figures
(computed tokens, cached tokens, kvsdk's hand-offs by outcome) come from
vLLM's Prometheus text; the workload's prompts are seeded and share no
prefix."""

from __future__ import annotations

from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_metrics import delta, parse
from kvsdk.plugins.vllm.workloads.pd_bench import METRIC_PREFIXES, engine_figures
from kvsdk.plugins.vllm.workloads.pd_pair import PDSettings
from kvsdk.plugins.vllm.workloads.pd_report import format_report, summarize
from kvsdk.plugins.vllm.workloads.pd_workload import PDWorkload, prompts

W = PDWorkload(prompt_tokens=(256,), requests=3, max_tokens=3)
LOGPROBS = [-1.25, -2.5, -0.75]


def _rec(index: int, tokens: list[int], logprobs: list[float], cached: int | None = 0,
         error: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"length": 256, "index": index, "ttft_ms": 10.0 + index, "itl_ms": [2.0, 3.0],
            "latency_ms": 20.0 + index, "tokens": tokens, "logprobs": logprobs,
            "cached_tokens": cached, "usage_prompt_tokens": 256, "error": error}  # fmt: skip


def _phases(pd: list[dict[str, Any]]) -> dict[str, Any]:
    figures = engine_figures({})
    single = [_rec(i, [1, 2, 3], [x + 1e-6 for x in LOGPROBS]) for i in range(3)]  # cold
    reference = [_rec(i, [1, 2, 3], list(LOGPROBS), cached=255) for i in range(3)]
    return {
        "single": {"records": single, "reference": reference,
                   "engines": {"256": {"single": figures}}},
        "pd": {"records": pd, "engines": {"256": {"prefill": figures, "decode": figures}}},
    }  # fmt: skip


def test_pd_output_equal_only_bit_for_bit_with_the_reference() -> None:
    one_ulp = [*LOGPROBS[:2], -0.7500000000000001]
    pd = [
        _rec(0, [1, 2, 3], list(LOGPROBS)),  # equal
        _rec(1, [1, 2, 3], one_ulp),  # the last logprob one ulp off
        _rec(2, [1, 2, 4], list(LOGPROBS)),  # a different token
    ]
    r = summarize(_phases(pd), W, PDSettings(), {}, {})
    o = r["outputs"]
    assert (o["compared"], o["tokens_equal"], o["equal"]) == (3, 2, 1)
    assert [(c["tokens_equal"], c["logprobs_equal"]) for c in o["pairs"]] == [
        (True, True),
        (True, False),
        (False, True),
    ]
    assert o["pairs"][0]["reference_cached_tokens"] == 255
    assert 0 < o["logprob_max_abs_diff_cold"] < 1e-5
    row = r["lengths"]["256"]
    assert (row["compared"], row["tokens_equal"], row["outputs_equal"]) == (3, 2, 1)
    text = format_report(r)
    assert "1/3 (token ids alone: 2/3" in text
    assert "DIFFERS prompt 256 #1: tokens equal True" in text
    assert "DIFFERS prompt 256 #2: tokens equal False" in text


def test_failed_request_is_not_compared() -> None:
    pd = [_rec(i, [1, 2, 3], list(LOGPROBS)) for i in range(2)]
    pd.append(_rec(2, [], [], cached=None, error="HTTP 500: boom"))
    r = summarize(_phases(pd), W, PDSettings(), {}, {})
    assert (r["outputs"]["compared"], r["outputs"]["equal"]) == (2, 2)
    assert r["lengths"]["256"]["pd"]["errors"] == 1


METRICS_BEFORE = """\
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 0.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 100.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
"""
METRICS_AFTER = """\
vllm:prompt_tokens_total{engine="0",model_name="m"} 1124.0
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 1022.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 102.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1022.0
vllm:kvsdk_hit_tokens_total{detail="",engine="0",model_name="m"} 1022.0
vllm:kvsdk_pd_handoffs_total{detail="outcome=loaded",engine="0",model_name="m"} 2.0
vllm:kvsdk_pd_handoffs_total{detail="outcome=timeout",engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
"""


def test_engine_figures_from_vllm_metrics() -> None:
    d = delta(parse(METRICS_BEFORE, METRIC_PREFIXES), parse(METRICS_AFTER, METRIC_PREFIXES))
    f = engine_figures(d)
    assert f["requests"] == 2 and f["prompt_tokens"] == 1024
    assert f["computed_tokens"] == 2 and f["cached_tokens"] == 1022
    assert f["external_hit_tokens"] == f["kvsdk_hit_tokens"] == 1022
    assert f["kvsdk_pd_handoffs"] == {"loaded": 2.0, "timeout": 1.0}
    assert f["ttft_engine_mean_ms"] == 250.0 and f["itl_engine_mean_ms"] == 0.0


def test_prompts_are_seeded_and_share_no_prefix() -> None:
    w = PDWorkload(prompt_tokens=(64, 128), requests=3)
    ps = prompts(w)
    assert [(p.length, p.index) for p in ps] == [(64, 0), (64, 1), (64, 2), (128, 0), (128, 1),
                                                  (128, 2)]  # fmt: skip
    assert all(len(p.tokens) == p.length for p in ps)
    assert len({tuple(p.tokens[:8]) for p in ps}) == len(ps)
    assert [p.tokens for p in prompts(w)] == [p.tokens for p in ps]
    assert prompts(PDWorkload(prompt_tokens=(64,), seed=1))[0].tokens != ps[0].tokens
