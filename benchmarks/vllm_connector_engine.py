"""The engine side of ``bench_vllm_connector.py``: the configurations it compares,
the workloads, and the child process that runs one ``vllm.LLM`` and serves the
parent's tasks (``child_main``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("none", "kvsdk", "native")
TP2_CONFIGS = ("none-tp2", "kvsdk-tp2")
"""The TP=2 engines (part 4): tensor_parallel_size=2, started once the others exit."""
SPEC_NAME = "TorchCPUOffloadingSpec"
SPEC_MODULE = "kvsdk.plugins.vllm.workloads.native_offload"  # the spec kvsdk ships
PROBE_MODULE = "kvsdk.plugins.vllm.workloads.stats_probe"
"""Both connectors are loaded from here: the same classes, plus the EngineCore probe."""

# The connector methods the scheduler calls (kvsdk.plugins.vllm.workloads.stats_probe.CORE_HOOKS and
# OTHER_HOOKS; repeated here so the parent need not import vLLM); the first group is the
# core figure.
CORE_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
)
OTHER_METHODS = (
    "on_new_request",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 32000) for _ in range(n)]


def _ttft_prompt(length: int, rep: int) -> list[int]:
    return _tokens(random.Random(f"ttft-{length}-{rep}"), length)


TRACE_SUFFIX_TOKENS = (32, 96)
"""Each trace prompt's own tokens after its shared prefix (fewest, most)."""


def _trace(args: argparse.Namespace) -> list[list[list[int]]]:
    """Waves of prompts: ``prefix[i % prefixes] + unique suffix``."""
    rng = random.Random("trace")
    lo, hi = args.trace_prefix_tokens
    prefixes = [_tokens(rng, rng.randint(lo, hi)) for _ in range(args.trace_prefixes)]
    per_wave = args.trace_requests // args.trace_waves
    return [
        [
            prefixes[i % len(prefixes)] + _tokens(rng, rng.randint(*TRACE_SUFFIX_TOKENS))
            for i in range(per_wave)
        ]
        for _ in range(args.trace_waves)
    ]


def _throughput_prompts(args: argparse.Namespace, rnd: int) -> list[list[int]]:
    rng = random.Random(f"throughput-{rnd}")
    lo, hi = args.tp_prompt_tokens
    return [_tokens(rng, rng.randint(lo, hi)) for _ in range(args.tp_requests)]


# -- child: one engine configuration ---------------------------------------------------------------


def _tree_cpu() -> float:
    """CPU seconds of this process and its children (the EngineCore, the model
    workers): the whole engine, kvsdk's copy threads included."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


class Engine:
    """One engine configuration (runs in its own process): one ``vllm.LLM``."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        from kvsdk.plugins.vllm.workloads import stats_probe

        self.probe = stats_probe
        self.args = args
        self.config = config = args.child
        capacity = int(args.tier_gib * 2**30)
        ktc: dict[str, Any] | None = None
        if config in ("kvsdk", "kvsdk-tp2"):
            ktc = {
                "kv_connector": "KVSDKConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": PROBE_MODULE,
                "kv_connector_extra_config": {
                    "config": {  # --kvsdk-config's "tiers" replace the host tier
                        "tiers": [{"backend": "cpu", "capacity": capacity}],
                        **json.loads(args.kvsdk_config),
                    }
                },
            }
        elif config == "native":
            ktc = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_module_path": PROBE_MODULE,
                "kv_connector_extra_config": {
                    "spec_name": SPEC_NAME,
                    "spec_module_path": SPEC_MODULE,
                    "cpu_bytes_to_use": capacity,
                },
            }
        elif config == "lmcache":  # its server was started by the parent (lmcache_peer)
            from kvsdk.plugins.vllm.workloads.lmcache_peer import kv_transfer_config

            ktc = kv_transfer_config(args.lmcache_port)
        self.connector = ktc is not None
        max_len = max(
            max(args.prompt_lens) + 64,
            args.trace_prefix_tokens[1] + TRACE_SUFFIX_TOKENS[1] + args.trace_max_tokens,
            args.tp_prompt_tokens[1] + args.tp_max_tokens + 32,
            args.tp2_len + 64,
        )
        self.max_len = max_len
        tp = 2 if config in TP2_CONFIGS else 1
        t0 = time.perf_counter()
        self.llm = LLM(
            model=args.model_dir,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=max_len,
            seed=0,
            tensor_parallel_size=tp,
            kv_transfer_config=ktc,
        )
        state = self.probe.probe(self.llm, "state") if self.connector else {}
        self.info: dict[str, Any] = {
            "config": config,
            "init_s": time.perf_counter() - t0,
            "engine_client": type(self.llm.llm_engine.engine_core).__name__,
            "tensor_parallel_size": tp,
            # per model worker, asked through the probe (None: no connector, no probe)
            "torch_threads": (
                self.probe.probe(self.llm, "torch_threads")["per_rank"] if self.connector else None
            ),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "max_num_batched_tokens": self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "block_size": self.llm.llm_engine.vllm_config.cache_config.block_size,
            "max_model_len": max_len,
            "connector": state.get("connector"),
            "kv_transfer_config": ktc,
        }
        self.trace_waves: list[dict[str, Any]] = []
        self.hooks: dict[str, dict[str, float]] = {}
        self.steps = 0

    def drain(self) -> None:
        """The connector's work done (stores landed, held blocks freed): the
        EngineCore does it on its own; ask it until it is idle."""
        if self.connector:
            self.probe.drain(self.llm)

    def reset(self, *, connector: bool = False) -> dict[str, Any]:
        self.drain()
        self.probe.reset_caches(self.llm, connector=connector and self.connector)
        return {}

    def gen(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        tps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outs = self.llm.generate(tps, sp, use_tqdm=False)
        return time.perf_counter() - start, outs

    def gen1(self, prompt: list[int]) -> dict[str, Any]:
        c0 = _tree_cpu()
        secs, (out,) = self.gen([prompt], 1)
        return {
            "s": secs,
            "cpu_s": _tree_cpu() - c0,  # every process of the engine
            "cached": out.num_cached_tokens,
            "token": out.outputs[0].token_ids[0],
        }

    def warmup(self) -> None:
        """First-call costs, and the connector's store -> reset -> load path, out of the way."""
        rng = random.Random(f"warmup-{self.config}")
        for n in (64, min(512, self.max_len - 64)):
            p = _tokens(rng, n)
            self.gen1(p)
            self.reset()
            self.gen1(p)
        self.reset(connector=True)

    # -- tasks (one measurement each; the engine is idle between tasks) -----------------------
    def ttft(self, length: int, rep: int) -> dict[str, Any]:
        p = _ttft_prompt(length, rep)
        self.reset()
        first = self.gen1(p)
        self.drain()  # the connector's stores have landed (no-op without one)
        if self.connector:
            self.reset()  # only the connector holds the prefix now
        second = self.gen1(p)  # without a connector: vLLM's own prefix-cache hit
        second["same_token_as_first"] = second["token"] == first["token"]
        self.drain()
        if not self.connector:
            return {"cold": first, "local_hit": second}
        return {"cold_with_connector": first, "warm": second}

    def trace_wave(self, wave: int) -> dict[str, Any]:
        assert self.connector
        prompts = _trace(self.args)[wave]
        self.reset()  # later waves: the shared prefixes come from the connector
        self.probe.probe(self.llm, "timer_start")  # times this wave's steps in the EngineCore
        secs, outs = self.gen(prompts, self.args.trace_max_tokens)
        self.drain()  # the drain's steps are not timed
        timed = self.probe.probe(self.llm, "timer_stop")
        self.steps += timed["steps"]
        for m, v in timed["methods"].items():
            acc = self.hooks.setdefault(m, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0})
            for k in acc:
                acc[k] += v[k]
        info = {
            "requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "s": secs,
            "steps": timed["steps"],
            # this wave alone: the spread between waves shows what one figure is worth
            "us_per_step": 1e6
            * sum(v["wall_s"] for v in timed["methods"].values())
            / max(timed["steps"], 1),
        }
        self.trace_waves.append(info)
        return info

    def trace_summary(self) -> dict[str, Any]:
        hooks, steps = self.hooks, self.steps
        core_wall = sum(v["wall_s"] for m, v in hooks.items() if m in CORE_METHODS)
        core_cpu = sum(v["cpu_s"] for m, v in hooks.items() if m in CORE_METHODS)
        all_wall = sum(v["wall_s"] for v in hooks.values())
        all_cpu = sum(v["cpu_s"] for v in hooks.values())
        return {
            "waves": self.trace_waves,
            "steps": steps,
            "core_total_s": core_wall,
            "core_us_per_step": 1e6 * core_wall / max(steps, 1),
            "core_cpu_us_per_step": 1e6 * core_cpu / max(steps, 1),
            "all_total_s": all_wall,
            "all_us_per_step": 1e6 * all_wall / max(steps, 1),
            "all_cpu_us_per_step": 1e6 * all_cpu / max(steps, 1),
            "methods": {
                m: {"calls": int(v["calls"]), "total_ms": 1e3 * v["wall_s"]}
                for m, v in hooks.items()
                if v["calls"]
            },
        }

    def throughput_round(self, rnd: int) -> dict[str, Any]:
        prompts = _throughput_prompts(self.args, rnd)
        load = os.getloadavg()[0]
        c0, start = _tree_cpu(), time.perf_counter()
        secs, outs = self.gen(prompts, self.args.tp_max_tokens)
        self.drain()  # what the connector still has to store is charged to this round
        total = time.perf_counter() - start
        cpu = _tree_cpu() - c0  # every process of the engine: kvsdk's copies too
        # what kvsdk's admission stored of these fresh prompts (None for the others)
        kv = self.probe.probe(self.llm, "state").get("kvsdk") if self.connector else None
        n_prompt = sum(len(p) for p in prompts)
        n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "s": total,
            "generate_s": secs,
            "prompt_tokens": n_prompt,
            "generated_tokens": n_gen,
            "cached_tokens": sum(o.num_cached_tokens for o in outs),
            "tokens_per_s": (n_prompt + n_gen) / total,
            "cpu_s": cpu,
            "tokens_per_cpu_s": (n_prompt + n_gen) / cpu,
            "loadavg_1min": load,
            "kvsdk_held_chunks": kv["host_readable_entries"] if kv else None,
            "kvsdk_admission": kv["admission"] if kv else None,
        }


def _say(tag: str, payload: Any) -> None:
    print(f"@@{tag} {json.dumps(payload)}", flush=True)


def child_main(args: argparse.Namespace) -> None:
    """Serve tasks from the parent, one at a time: ``{"task": name, **kwargs}`` per line."""
    engine = Engine(args)
    engine.warmup()
    _say("ready", engine.info)
    for line in sys.stdin:
        msg = json.loads(line)
        task = msg.pop("task")
        if task == "exit":
            break
        if task == "trace_summary":
            _say("result", engine.trace_summary())
            continue
        _say("result", getattr(engine, task)(**msg))
    engine.probe.shutdown(engine.llm)  # the engine's processes exit before this one does
    _say("bye", {})
