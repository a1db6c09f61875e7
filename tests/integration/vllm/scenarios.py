"""Scenarios on real vLLM-CPU with KVSDKConnector, one per process.

    python scenarios.py SCENARIO MODEL_DIR OUT_JSON

Each writes greedy tokens, logprobs (as float.hex, for bitwise comparison) and
``num_cached_tokens`` of every generation it ran. vLLM runs as users run it:
its default executor (the scheduler in an EngineCore process, the model
worker in another), with a fixed thread count so reruns of the same
computation are bitwise reproducible.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

# The tests run Python with PYTHONSAFEPATH=1, which leaves a script's own directory
# off sys.path; the sibling helper modules are imported from there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

KVSDK_CONFIG: dict[str, Any] = {
    "chunk_tokens": 32,
    "prompt_tail": False,  # compared with vLLM's own hit, which stops at a whole block
    "tiers": [{"backend": "cpu", "capacity": "64MiB"}],
}

rng = random.Random(1)
P = [rng.randrange(3, 32000) for _ in range(200)]
Q = P[:100] + [rng.randrange(3, 32000) for _ in range(60)]
D = [rng.randrange(3, 32000) for _ in range(700)]
"""For the defaults without the tail: vLLM-CPU's 128-token blocks stop at token
640 of it, and so does kvsdk's default chunk (the engine's block size; a
256-token chunk would stop at 512)."""
T = [rng.randrange(3, 32000) for _ in range(673)]
"""For the defaults (the prompt tail on): five whole 128-token blocks and a
33-token tail; 672 is a multiple of 32, so an engine with 32-token blocks
recomputes exactly its last token."""


def make_llm(
    model: str,
    *,
    module_path: bool = False,
    transfer: str | None = None,
    overrides: dict[str, Any] | None = None,
    kv_events: dict[str, Any] | None = None,
    log_stats: bool = False,
    **engine: Any,
) -> Any:
    from vllm import LLM

    config = dict(KVSDK_CONFIG, **(overrides or {}))
    if transfer:
        config["transfer"] = transfer
    ktc: dict[str, Any] = {
        "kv_connector": "KVSDKConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": config},
    }
    if module_path:
        ktc["kv_connector_module_path"] = "kvsdk.plugins.vllm"
    extra: dict[str, Any] = {"kv_events_config": kv_events} if kv_events else {}
    if log_stats:
        extra["disable_log_stats"] = False
    return LLM(
        **extra,
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        **({"block_size": 32} | engine),
        max_model_len=1024,
        seed=0,
        kv_transfer_config=ktc,
    )


def generate(
    llm: Any, prompt: list[int], max_tokens: int = 12, salt: str | None = None
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    tp = TokensPrompt(prompt_token_ids=prompt)
    if salt is not None:
        tp["cache_salt"] = salt
    out = llm.generate([tp], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [float(lp[t].logprob).hex() for t, lp in zip(c.token_ids, c.logprobs)],
        "cached": out.num_cached_tokens,
    }


def reset(llm: Any, reset_connector: bool = False) -> None:
    """``reset_prefix_cache`` once no finished request's blocks are held any
    more (kvsdk holds them for a step while its last stores land)."""
    for _ in range(100):
        if llm.reset_prefix_cache(reset_connector=reset_connector):
            return
        time.sleep(0.02)
    raise AssertionError("vLLM's prefix cache could not be reset")


def corrupt_host_tier() -> None:
    """Add noise to every byte kvsdk holds in host RAM (negative control): the
    engine's shared-memory segment, written from this (the client) process."""
    import mmap

    from engine_segments import open_segments

    from kvsdk.slab import HEADER_BYTES

    segments = open_segments()
    assert segments, "no kvsdk segment is open in any process"
    noise = random.Random(5).randbytes(1 << 20)
    for fd_path in segments.values():
        with open(fd_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            # slots are handed out from the start: the first 64 MiB hold what was stored
            for at in range(HEADER_BYTES, min(len(mm), 64 << 20), len(noise)):
                piece = noise[: min(len(noise), len(mm) - at)]
                mm[at : at + len(piece)] = piece


def fail_every_load() -> None:
    """Register a transfer worker whose loads fail: vLLM must recompute."""
    from kvsdk.hooks import hookimpl
    from kvsdk.plugins_manager import plugin_manager
    from kvsdk.transfer import Direction, TransferJob, TransferResult
    from kvsdk.transfer.cpu import CPUTransferWorker

    class FailingLoads(CPUTransferWorker):
        def _run(self, job: TransferJob) -> TransferResult:
            if job.direction is Direction.LOAD:
                return TransferResult(job.job_id, job.direction, False, 0, 0.0, "injected")
            return super()._run(job)

    class Plugin:
        @hookimpl
        def kvsdk_transfer_workers(self) -> dict[str, Any]:
            return {"failing-loads": FailingLoads}

    plugin_manager().register(Plugin(), name="failing-loads")


# vLLM spawns its EngineCore and worker processes; each re-imports this module
# (as __mp_main__), so the failing transfer worker is registered in all of them.
if os.environ.get("KVSDK_TEST_FAILING_LOADS") == "1":
    fail_every_load()


def main() -> None:
    from engine_segments import named_segments, open_segments, segment_mode

    scenario, model, out_path = sys.argv[1:4]
    res: dict[str, Any] = {}
    if scenario in ("basic", "hybrid"):
        llm = make_llm(model)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)
        reset(llm)
        res["kvsdk"] = generate(llm, P)
        segments = open_segments()  # while the engine runs
        res["segments"] = {
            "named": sorted(set(named_segments()) & set(segments)),
            "open": sorted(segments),
            "modes": sorted({segment_mode(p) for p in segments.values()}),
        }
        # the whole prompt again, now stored in kvsdk and not in vLLM
        reset(llm)
        res["kvsdk_again"] = generate(llm, P)
        # a different prompt sharing P's first 100 tokens: kvsdk's hit, then vLLM's own
        reset(llm)
        res["q_kvsdk"] = generate(llm, Q)
        reset(llm, reset_connector=True)
        res["after_full_reset"] = generate(llm, P)
        res["q_local"] = generate(llm, Q)
    elif scenario == "no_tail":
        # vLLM's defaults (block size, executor) and kvsdk's but prompt_tail off
        from vllm import LLM

        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            seed=0,
            kv_transfer_config={
                "kv_connector": "KVSDKConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"config": {"prompt_tail": False}},
            },
        )
        res["cold"] = generate(llm, D)
        res["local"] = generate(llm, D)
        reset(llm)
        res["kvsdk"] = generate(llm, D)
        reset(llm)
        corrupt_host_tier()
        res["corrupt"] = generate(llm, D)
    elif scenario == "defaults":
        # vLLM's defaults (block size, executor) and kvsdk's (no config at all:
        # the prompt tail is on)
        from vllm import LLM

        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_transfer_config={"kv_connector": "KVSDKConnector", "kv_role": "kv_both"},
        )
        res["cold"] = generate(llm, T)
        res["local"] = generate(llm, T)  # vLLM's own: whole blocks only
        reset(llm)
        res["kvsdk"] = generate(llm, T)
        reset(llm)
        res["other_tail"] = generate(llm, [*T[:-1], T[-1] + 1])
        reset(llm)
        res["salted"] = generate(llm, T, salt="tenant-b")
        reset(llm)
        corrupt_host_tier()
        res["corrupt"] = generate(llm, T)
    elif scenario == "tail_reference":
        # vLLM alone with 32-token blocks: its own prefix hit of T recomputes one token
        from vllm import LLM

        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  seed=0, block_size=32)  # fmt: skip
        res["cold"] = generate(llm, T)
        res["local"] = generate(llm, T)
        res["other_tail_cold"] = generate(llm, [*T[:-1], T[-1] + 1])
    elif scenario == "mla_refused":
        # vLLM-CPU runs MLA without prefix caching: its MLA prefill cannot
        # resume from cached KV (measured: a 192-token hit changed the 5th
        # greedy token), so kvsdk must refuse to start rather than serve
        try:
            make_llm(model, block_size=16)
        except Exception as exc:
            res["refused"] = f"{type(exc).__name__}: {exc}"
    elif scenario == "corrupt":
        llm = make_llm(model)
        res["cold"] = generate(llm, P)
        res["local"] = generate(llm, P)
        reset(llm)
        corrupt_host_tier()
        res["kvsdk"] = generate(llm, P)
    elif scenario == "tenants":
        llm = make_llm(model)
        res["a_cold"] = generate(llm, P, salt="tenant-a")
        reset(llm)
        res["b"] = generate(llm, P, salt="tenant-b")  # same tokens, other tenant: no sharing
        reset(llm)
        res["a_again"] = generate(llm, P, salt="tenant-a")
        reset(llm)
        res["unsalted"] = generate(llm, P)
    elif scenario in ("quota", "no_quota"):
        # 16 host slots of one 32-token chunk; the "greedy" tenant may hold 8 of them
        small: dict[str, Any] = {"tiers": [{"backend": "cpu", "capacity": 16 * 131072}]}
        if scenario == "quota":
            small["tenant_quotas"] = {"greedy": 0.5}
        llm = make_llm(model, overrides=small)
        res["calm_cold"] = generate(llm, P, salt="calm")
        flood = random.Random(7)
        for _ in range(6):
            generate(llm, [flood.randrange(3, 32000) for _ in range(200)], 2, salt="greedy")
        reset(llm)
        res["calm_again"] = generate(llm, P, salt="calm")
    elif scenario == "events":
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        endpoint = "ipc://" + os.path.join(os.path.dirname(out_path), "kv-events.sock")
        llm = make_llm(
            model,
            kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
        )
        sub = zmq.Context().socket(zmq.SUB)
        sub.connect(endpoint)  # vLLM's publisher binds ipc:// endpoints
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)  # let the subscription reach the publisher
        res["cold"] = generate(llm, P)
        reset(llm, reset_connector=True)
        generate(llm, [3, 4, 5], 1)  # one more step publishes the connector's last events
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events: list[dict[str, Any]] = []
        deadline = time.time() + 10
        while time.time() < deadline:
            if not sub.poll(500):
                if events:
                    break
                continue
            _topic, _seq, payload = sub.recv_multipart()
            for ev in decoder.decode(payload).events:
                events.append(
                    {
                        "type": type(ev).__name__,
                        "medium": getattr(ev, "medium", None),
                        "locality": getattr(ev, "locality", None),
                        "hashes": [
                            bytes(h).hex() if isinstance(h, bytes) else str(h)
                            for h in getattr(ev, "block_hashes", [])
                        ],
                    }
                )
        res["events"] = events
    elif scenario == "prometheus":
        import prometheus_client

        llm = make_llm(model, log_stats=True)
        res["cold"] = generate(llm, P)
        reset(llm)
        res["kvsdk"] = generate(llm, P)
        # the default host tier alone: prompts that never come back (28 chunks each)
        # stop being copied; one that comes back is stored on its second sight
        fresh = random.Random(11)
        for _ in range(8):
            generate(llm, [fresh.randrange(3, 32000) for _ in range(900)], 2)
        F = [fresh.randrange(3, 32000) for _ in range(900)]
        for sight in ("first", "second", "third"):
            reset(llm)
            res[f"returning_{sight}"] = generate(llm, F)
        res["metrics"] = [
            line
            for line in prometheus_client.generate_latest().decode().splitlines()
            if line.startswith("vllm:kvsdk_")
        ]
    elif scenario == "module_path":
        llm = make_llm(model, module_path=True)
        res["cold"] = generate(llm, P)
        reset(llm)
        res["kvsdk"] = generate(llm, P)
    elif scenario == "failing_loads":
        os.environ["KVSDK_TEST_FAILING_LOADS"] = "1"
        fail_every_load()
        import prometheus_client

        llm = make_llm(model, transfer="failing-loads", log_stats=True)
        res["cold"] = generate(llm, P)
        reset(llm)
        res["failed_load"] = generate(llm, P)
        res["after"] = generate(llm, P)
        res["metrics"] = [  # kvsdk's counters, through vLLM's stats path
            line
            for line in prometheus_client.generate_latest().decode().splitlines()
            if line.startswith("vllm:kvsdk_")
        ]
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if "segments" in res:
        del llm  # a clean exit of the engine
        import gc

        gc.collect()
        time.sleep(1)
        res["segments"]["after_exit"] = sorted(open_segments())
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
