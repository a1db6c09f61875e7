"""``kvsdk bench faults``: a soak through the real vLLM engine with a faulty tier.

Many requests with shared prefixes and random lengths, aborts, preemptions
(a small KV budget), cache resets, and a lower tier that injects errors,
timeouts, dropped writes and corrupted/truncated reads. Afterwards: the job
ledger is empty, no host slot is pinned or leaked (every slot held is a
readable entry), the host tier filled up and evicted, the disk tier's files
stayed within its capacity, and every finished request's greedy tokens and
their logprobs (within ``LOGPROB_TOL``) equal a reference run of the same
prompts without kvsdk (a separate engine, in a subprocess).

vLLM runs with its default executor and block size (128 tokens on vLLM-CPU),
kvsdk with its default offload unit (the block size): the shared prefixes
(160-520 tokens) span one to four blocks, and prompt lengths fall anywhere
within a block. kvsdk's scheduler side lives in the EngineCore process. Its
counters (tokens served, backend errors, failed jobs) and vLLM's preemption
count reach this process through vLLM's stats path
(Prometheus); the end state the leak checks read (tracked requests, ledger
jobs and fences, pinned host entries, host slots, faults injected) is read
in the EngineCore, between steps, by ``kvsdk.plugins.vllm.workloads.stats_probe``
(named as the connector's module path: the same ``KVSDKConnector``).

    python -m kvsdk.plugins.vllm.workloads.soak --requests 1000 --out out/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads import engine_block_size, use_cpu_engine_defaults

HOST_CAPACITY = 4 << 20  # small on purpose: evictions and promotions from the faulty tier
DISK_CAPACITY = 16 << 20  # small as well: the disk tier evicts, its files must stay within it
KV_BUDGET_TOKENS = 1280  # vLLM's KV cache (whole blocks): preemptions, prefixes evicted
MAX_MODEL_LEN = 1024
LOGPROB_TOL = 1e-3
"""Largest difference of a sampled token's logprob from the reference's: KV loaded
from kvsdk is the bytes the engine computed, but a prefix hit changes the batch
shapes of what is computed after it (float32 sums in another order)."""


def workload(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 32000) for _ in range(rng.randint(160, 520))] for _ in range(8)]
    reqs = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 32000) for _ in range(rng.randint(1, 96))]
        reqs.append(
            {
                "id": f"r{i}",
                "prompt": prompt,
                # a fifth decode past a 128-token block boundary or two: preemptions
                "max_tokens": rng.randint(24, 64) if rng.random() < 0.2 else rng.randint(1, 12),
                "abort_after_steps": rng.randint(1, 4) if rng.random() < 0.05 else None,
            }
        )
    return reqs


def make_llm(model: str, kvsdk_config: dict[str, Any] | None) -> Any:
    use_cpu_engine_defaults(kv_cache_gib=1)
    from vllm import LLM

    kw: dict[str, Any] = {}
    if kvsdk_config is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "kvsdk.plugins.vllm.workloads.stats_probe",  # + the probe
            "kv_connector_extra_config": {"config": kvsdk_config},
        }
        # 1280 tokens of KV for 12 sequences: preemptions (how many varies from run to run:
        # the EngineCore steps on its own, and loads land when they land)
        block_size = engine_block_size(model, max_model_len=MAX_MODEL_LEN)  # vLLM's default
        kw["num_gpu_blocks_override"] = KV_BUDGET_TOKENS // block_size
        kw["disable_log_stats"] = False  # kvsdk's counters through vLLM's stats path
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        max_num_seqs=12,
        **kw,
    )


def drive(
    llm: Any, reqs: list[dict[str, Any]], *, aborts: bool, resets: bool, progress: Any = None
) -> dict[str, dict[str, list[Any]]]:
    """Per finished request: its greedy ``tokens`` and each one's ``logprobs``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    outputs: dict[str, dict[str, list[Any]]] = {}
    wave = 24
    for w in range(0, len(reqs), wave):
        if resets and w and w % (4 * wave) == 0:  # every 96 requests
            llm.reset_prefix_cache(reset_connector=True)
        batch = reqs[w : w + wave]
        steps_seen: dict[str, int] = {}
        for r in batch:
            sp = SamplingParams(
                temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=1
            )
            engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), sp)
        pending = {r["id"]: r for r in batch}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    outputs[out.request_id] = _tokens_and_logprobs(out.outputs[0])
                    del pending[out.request_id]
                    if progress:
                        progress(1)
            if aborts:
                to_abort = []
                for rid, r in list(pending.items()):
                    steps_seen[rid] = steps_seen.get(rid, 0) + 1
                    if (
                        r["abort_after_steps"] is not None
                        and steps_seen[rid] >= r["abort_after_steps"]
                    ):
                        to_abort.append(rid)
                        del pending[rid]
                        if progress:
                            progress(1)
                if to_abort:
                    engine.abort_request(to_abort)
    return outputs


def _tokens_and_logprobs(completion: Any) -> dict[str, list[Any]]:
    tokens = [int(t) for t in completion.token_ids]
    per_position = completion.logprobs or []
    return {
        "tokens": tokens,
        "logprobs": [float(lp[t].logprob) for t, lp in zip(tokens, per_position)],
    }


def compare(
    outputs: dict[str, dict[str, list[Any]]], reference: dict[str, dict[str, list[Any]]]
) -> dict[str, Any]:
    """Tokens equal, and each token's logprob within ``LOGPROB_TOL`` of the reference's."""
    compared = [rid for rid in outputs if rid in reference]
    mismatched = [rid for rid in compared if outputs[rid]["tokens"] != reference[rid]["tokens"]]
    worst: dict[str, float] = {}  # per request whose tokens match: the largest difference
    for rid in compared:
        if rid in mismatched:
            continue
        ours, ref = outputs[rid]["logprobs"], reference[rid]["logprobs"]
        if len(ours) != len(outputs[rid]["tokens"]) or len(ref) != len(ours):
            worst[rid] = float("inf")  # a logprob missing: never a pass
        else:
            worst[rid] = max((abs(a - b) for a, b in zip(ours, ref, strict=True)), default=0.0)
    off = [rid for rid, d in worst.items() if d > LOGPROB_TOL]
    return {
        "compared": len(compared),
        "mismatches": len(mismatched),
        "mismatched_ids": mismatched[:20],
        "logprobs_compared": sum(len(reference[rid]["logprobs"]) for rid in compared),
        "logprob_mismatches": len(off),
        "logprob_mismatched_ids": off[:20],
        "max_logprob_diff": max(worst.values(), default=0.0),
    }


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_soak(model: str, n: int, seed: int, workdir: Path, progress: Any = None) -> dict[str, Any]:
    from kvsdk.plugins.vllm.workloads import stats_probe

    config = {  # kvsdk's defaults but for the tiers (chunk_tokens unset: the block size)
        "tiers": [
            {"backend": "cpu", "capacity": HOST_CAPACITY},
            {  # rates per chunk: 4x those set for 32-token chunks, the same per token
                "backend": "faulty",
                "seed": seed,
                "error_rate": 0.08,
                "timeout_rate": 0.04,
                "timeout_ms": 20,
                "latency_ms": 0.5,
                "drop_write_rate": 0.2,
                "corrupt_read_rate": 0.2,
                "truncate_rate": 0.08,
                "wraps": {
                    "backend": "disk",
                    "path": str(workdir / "disk"),
                    "capacity": DISK_CAPACITY,
                },
            },
        ],
    }
    llm = make_llm(model, config)
    reqs = workload(n, seed)
    try:
        t0 = time.perf_counter()
        outputs = drive(llm, reqs, aborts=True, resets=True, progress=progress)
        drained = True
        try:  # the EngineCore lands the last stores on its own
            stats_probe.drain(llm, timeout=120)
        except RuntimeError:
            drained = False  # reported as a leak below
        elapsed = time.perf_counter() - t0
        state = stats_probe.probe(llm, "state")["kvsdk"]  # the end state, read in the EngineCore
        if drained:
            stats_probe.sync_stats(llm)  # every step's counters recorded in this process
        counters = stats_probe.kvsdk_counters()
        preemptions = int(stats_probe.vllm_counter("vllm:num_preemptions_total"))
    finally:
        stats_probe.shutdown(llm)
    return {
        "outputs": outputs,
        "elapsed_s": elapsed,
        "drained": drained,
        "faults": state["faults"],
        "pending_work": int(state["pending_work"]),
        "ledger_jobs": state["ledger_jobs"],
        "ledger_fences": state["ledger_fences"],
        "tracked_requests": state["tracked_requests"],
        "pinned_host_entries": state["pinned_host_entries"],
        "host_slots_used": state["host_slots_used"],
        "host_readable_entries": state["host_readable_entries"],
        "host_evictions": state["host_evictions"],
        "disk_capacity_bytes": DISK_CAPACITY,
        "disk_bytes_used": _disk_bytes(workdir / "disk"),
        "host_slots": state["host_slots"],
        "host_capacity_bytes": HOST_CAPACITY,
        "host_bytes_used": state["host_slots_used"] * state["host_slot_bytes"],
        "hit_tokens": counters.get("kvsdk_hit_tokens_total", 0.0),
        "backend_errors": counters.get("kvsdk_backend_errors_total", 0.0),
        "failed_jobs": counters.get("kvsdk_failed_jobs_total", 0.0),
        "aborted": sum(1 for r in reqs if r["abort_after_steps"] is not None),
        "preemptions": preemptions,
        "preemptions_seen_by_kvsdk": state["preemptions"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="kvsdk bench faults")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/soak.json")
    ap.add_argument("--model-dir", default="out/models/soak-llama")
    ap.add_argument("--reference", help=argparse.SUPPRESS)  # internal: write reference outputs
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(args.model_dir, seed=0))
    if args.reference:
        from kvsdk.plugins.vllm.workloads.stats_probe import shutdown

        llm = make_llm(model, None)
        reqs = [dict(r, abort_after_steps=None) for r in workload(args.requests, args.seed)]
        try:
            outputs = drive(llm, reqs, aborts=False, resets=False)
        finally:
            shutdown(llm)
        Path(args.reference).write_text(json.dumps(outputs))
        return
    print(
        format_report(
            run_bench(
                model, args.requests, args.seed, Path(args.out), progress=not args.no_progress
            )
        )
    )


def run_bench(model: str, n: int, seed: int, out: Path, *, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        ref_path = Path(tmp) / "reference.json"
        ref = subprocess.Popen(  # the reference engine runs at the same time, in its own process
            [
                sys.executable,
                "-m",
                "kvsdk.plugins.vllm.workloads.soak",
                "--requests",
                str(n),
                "--seed",
                str(seed),
                "--model-dir",
                str(Path(model)),
                "--reference",
                str(ref_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONSAFEPATH": "1"},  # the installed kvsdk, not ./kvsdk
        )
        bar = tqdm(total=n, desc="soak (kvsdk + faulty tier)", unit="req", disable=not progress)
        result = run_soak(model, n, seed, Path(tmp), progress=bar.update)
        bar.close()
        _, err = ref.communicate(timeout=1800)
        if ref.returncode:
            raise RuntimeError(f"reference run failed: {err[-2000:]}")
        reference = json.loads(ref_path.read_text())
    outputs = result.pop("outputs")
    result.update(compare(outputs, reference))
    result.update(
        {
            "requests": n,
            "served": len(outputs),
            "leaks": result["ledger_jobs"]
            + result["ledger_fences"]
            + result["tracked_requests"]
            + result["pinned_host_entries"]
            + result["pending_work"]
            + (result["host_slots_used"] - result["host_readable_entries"]),  # slots stuck
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def format_report(r: dict[str, Any]) -> str:
    lines = ["faults injected by kind:"]
    for kind, count in sorted(r["faults"].items()):
        lines.append(f"  {kind:<18} {count}")
    lines += [
        f"requests                {r['requests']} ({r['aborted']} aborted on purpose, "
        f"{r['preemptions']} preemptions; kvsdk saw {r['preemptions_seen_by_kvsdk']})",
        f"requests served         {r['served']}",
        f"outputs compared        {r['compared']} (greedy tokens vs a run without kvsdk)",
        f"mismatches              {r['mismatches']}",
        f"logprobs compared       {r['logprobs_compared']}: {r['logprob_mismatches']} off by "
        f"more than {LOGPROB_TOL} (largest difference {r['max_logprob_diff']:.2e})",
        f"leaks                   {r['leaks']} (ledger jobs {r['ledger_jobs']}, fences "
        f"{r['ledger_fences']}, requests {r['tracked_requests']}, pinned host entries "
        f"{r['pinned_host_entries']}, work still pending {r['pending_work']})",
        f"host tier               {r['host_bytes_used'] / 2**20:.1f} / "
        f"{r['host_capacity_bytes'] / 2**20:.1f} MiB used, {r['host_evictions']} evictions",
        f"disk tier               {r['disk_bytes_used'] / 2**20:.1f} / "
        f"{r['disk_capacity_bytes'] / 2**20:.1f} MiB on disk",
        f"tokens from kvsdk       {int(r['hit_tokens'])}",
        f"backend errors -> miss  {int(r['backend_errors'])}",
        f"elapsed                 {r['elapsed_s']:.1f} s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
