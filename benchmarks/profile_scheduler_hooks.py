"""kvsdk's scheduler-side CPU time per engine step, in one process, without a model.

vLLM's real ``Scheduler`` builds the real ``KVSDKConnector`` (kvsdk at its
defaults, vLLM at vLLM-CPU's 128-token blocks) and is stepped by hand: each
scheduled request samples one token, and every store and load a step asks
for is reported done by the next step (as a worker that always keeps up).
The trace has the shape of ``bench_vllm_connector.py``'s part 2: waves of
requests over shared prefixes, vLLM's own prefix cache reset between waves
(later waves load their prefixes from kvsdk).

The same trace runs with vLLM's native ``OffloadingConnector`` (the CPU spec
kvsdk ships for it, a host tier of the same size, its worker faked the same
way: loads asynchronous as native's are on vLLM-CPU), and the ratio of the
two is printed. It prints each connector's hook thread CPU time per step, per
hook, split between the steps that look requests up (their admission: lookups,
loads, and for kvsdk the prompts' stores) and the others (decodes, loads
landing, native's prompt stores), and with ``--profile`` kvsdk's hottest
functions (cProfile). The split is by lookups, not by requests scheduled:
native's loads are asynchronous, so it looks a request up in a step that
schedules nothing new and admits it steps later.

Between steps, and between building a wave's requests and adding them to the
scheduler, it writes ``--evict-mib`` of memory (default 64), as vLLM-CPU's
forward pass evicts the caches the hooks then run on (the EngineCore's input
thread builds each request, block hashes included, while the engine runs a
step; the engine thread adds it between steps): with it the figures
match the EngineCore's (kvsdk 340-346 us/step and native 454-464 against
336-362 and 435-444 in ``bench_vllm_connector.py`` at the same 32 requests a wave),
where without it both run about 1.5x faster than there. ``--evict-mib 0`` is the
hot case: a scheduler process on a core of its own, as beside a GPU. The
engine's own figure varies by +-15 % from run to run; this one by a few
percent, so a change to the scheduler side is easier to judge here first;
the comparison with vLLM's native connector stays ``bench_vllm_connector.py``'s.

Each request generates ``--max-tokens`` tokens (default 8: nearly every step
admits or finishes requests, the hardest case for the ratio, since admitting a
request costs both connectors far more than a decode step). A comma list runs
the trace at each length and draws the curve; at 32
requests a wave (``--repeats 2 --requests 32 --waves 6 --max-tokens
8,16,32,64,128,256``) kvsdk/native per step measures 0.72-0.76x at 8 tokens,
0.58-0.72x at 16, 0.47-0.49x at 32, 0.41-0.42x at 64, 0.33-0.35x at 128 (the
output length of ``vllm bench serve``'s random dataset) and 0.29-0.31x at
256. ``--out DIR`` writes ``profile_scheduler_hooks.json`` and a PNG of it there.

    python benchmarks/profile_scheduler_hooks.py [--waves 4] [--requests 64] [--repeats 3] [--profile]
        [--evict-mib 64] [--kvsdk-config '{"prompt_tail": false}'] [--max-tokens 8,64,256]
        [--out out/profile_scheduler_hooks]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvsdk.plugins.vllm.messages import KVSDKConnectorMetadata, KVSDKWorkerMetadata
from kvsdk.plugins.vllm.workloads.model_free_scheduler import (
    model_free_scheduler,
    write_llama_config,
)
from kvsdk.plugins.vllm.workloads.stats_probe import CORE_HOOKS, OTHER_HOOKS

BLOCK = 128  # vLLM-CPU's default
LAYERS, KV_HEADS, HEAD = 8, 8, 64
TIER_BYTES = 2 << 30  # room for the whole trace: both connectors hit every prefix


def build_scheduler(
    model_dir: str, num_blocks: int, connector: str, kvsdk_config: dict[str, Any]
) -> Scheduler:
    write_llama_config(
        model_dir,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=LAYERS,
        num_attention_heads=16,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    return model_free_scheduler(
        model_dir,
        engine_id=f"profile-{uuid.uuid4()}",
        # else defaults
        kvsdk_config={"tiers": [{"backend": "cpu", "capacity": TIER_BYTES}], **kvsdk_config},
        native_bytes=TIER_BYTES if connector == "native" else None,
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )


def timed_hooks(
    connector: Any, spent: dict[str, float], calls: dict[str, int], prof: cProfile.Profile | None
) -> None:
    """Wrap each scheduler-side hook of the live connector (those the
    benchmark's probe times): its thread CPU time into ``spent``, its calls into ``calls``."""
    for name in CORE_HOOKS + OTHER_HOOKS:
        original: Callable[..., Any] | None = getattr(connector, name, None)
        if original is None:
            continue

        def hook(*a: Any, _fn: Callable[..., Any] = original, _name: str = name, **kw: Any) -> Any:
            start = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                out = _fn(*a, **kw)
                if _name == "take_events" and out is not None and not isinstance(out, list):
                    out = list(out)  # may be a generator: time its consumption too
                return out
            finally:
                if prof is not None:
                    prof.disable()
                spent[_name] = spent.get(_name, 0.0) + time.thread_time() - start
                calls[_name] = calls.get(_name, 0) + 1

        setattr(connector, name, hook)


Done = tuple[dict[int, int], set[str]]
"""Jobs a faked worker finished in a step, and the requests whose loads did."""


def worker_output(meta: Any, done: Done) -> tuple[Done, KVConnectorOutput | None]:
    """What a worker that finishes every job within a step reports for the
    previous step's jobs (``done``), and the jobs of this step's ``meta``."""
    if isinstance(meta, KVSDKConnectorMetadata):
        worker = KVSDKWorkerMetadata(completed=dict(done[0])) if done[0] else None
        now: Done = ({j.job_id: 1 for j in meta.stores} | {j: 1 for j in meta.loads}, set())
        released = set(meta.release) if meta.release else None
        kv = (
            KVConnectorOutput(finished_sending=released, kv_connector_worker_meta=worker)
            if worker or released
            else None
        )
        return now, kv
    native = OffloadingWorkerMetadata(completed_jobs=dict(done[0])) if done[0] else None
    jobs = meta.load_jobs | meta.store_jobs
    then: Done = ({j: 1 for j in jobs}, {job.req_id for job in meta.load_jobs.values()})
    kv = (
        KVConnectorOutput(finished_recving=done[1] or None, kv_connector_worker_meta=native)
        if native or done[1]
        else None
    )
    return then, kv


@dataclass
class Result:
    steps: int
    loads: int
    spent: dict[str, float]
    """Per hook, thread CPU seconds."""
    looking_up: list[float] = field(default_factory=list)
    """Per step that looked requests up, its hooks' seconds (from its
    ``schedule`` through its ``update_from_output``)."""
    other: list[float] = field(default_factory=list)
    """The same for every other step (decodes, loads landing, stores draining)."""

    @property
    def total(self) -> float:
        return sum(self.spent.values())


def run_trace(
    connector: str, args: argparse.Namespace, max_tokens: int, prof: cProfile.Profile | None
) -> Result:
    with tempfile.TemporaryDirectory() as model_dir:
        sched = build_scheduler(
            model_dir, num_blocks=2000, connector=connector, kvsdk_config=args.kvsdk_config
        )
    freeze_gc_heap()  # as vLLM's EngineCore does once it is built
    evict = bytearray(args.evict_mib << 20) if args.evict_mib else None
    zeros = bytes(len(evict)) if evict is not None else b""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    timed_hooks(sched.connector, spent, calls, prof)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50, 30000) for _ in range(rng.randint(512, 1024))] for _ in range(8)]
    res = Result(0, 0, spent)
    try:
        for wave in range(args.waves):
            if wave:
                sched.reset_prefix_cache()  # later waves load their prefixes from the connector
            wave_requests = [
                Request(
                    f"w{wave}r{i}",
                    prefixes[i % 8]
                    + [rng.randrange(50, 30000) for _ in range(rng.randint(16, 200))],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256),
                )
                for i in range(args.requests)
            ]
            if evict is not None:
                # the EngineCore's input thread built them while the engine ran a
                # forward pass: the engine thread adds them on cold caches
                evict[:] = zeros
            before = sum(spent.values())  # (adding may call hooks: in the first step's share)
            for request in wave_requests:
                sched.add_request(request)
            done: Done = ({}, set())
            while sched.requests:
                lookups = calls.get("get_num_new_matched_tokens", 0)
                so = sched.schedule()
                res.steps += 1
                ids = list(so.num_scheduled_tokens)
                meta: Any = so.kv_connector_metadata
                res.loads += len(
                    meta.loads if isinstance(meta, KVSDKConnectorMetadata) else meta.load_jobs
                )
                done, kv = worker_output(meta, done)
                if evict is not None:  # the forward pass between the hooks: caches cold
                    evict[:] = zeros
                sched.update_from_output(
                    so,
                    ModelRunnerOutput(
                        req_ids=ids,
                        req_id_to_index={r: i for i, r in enumerate(ids)},
                        sampled_token_ids=[[7] for _ in ids],
                        kv_connector_output=kv,
                    ),
                )
                took = sum(spent.values()) - before
                before += took
                looked_up = calls.get("get_num_new_matched_tokens", 0) > lookups
                (res.looking_up if looked_up else res.other).append(took)
    finally:
        sched.shutdown()
    # the scheduler was frozen into the permanent generation above: let it go,
    # or each run's host tier (2 GiB of shared memory) stays mapped to the end
    del sched
    gc.unfreeze()
    gc.collect()
    return res


def report(connector: str, args: argparse.Namespace, max_tokens: int, res: Result) -> None:
    total = res.total
    print(
        f"{connector}: {args.waves} waves x {args.requests} requests, {max_tokens} output "
        f"tokens each, {res.steps} steps, {res.loads} load jobs: scheduler-side hooks "
        f"{1e6 * total / res.steps:.0f} us/step thread CPU ({1e3 * total:.1f} ms)"
    )
    for name, secs in sorted(res.spent.items(), key=lambda kv: -kv[1]):
        if secs:
            print(f"  {name:30s} {1e3 * secs:7.1f} ms")
    for kind, took in (("steps looking requests up", res.looking_up), ("other steps", res.other)):
        if took:
            print(
                f"  {kind}: {len(took)}, {1e3 * sum(took):.1f} ms"
                f" (median {1e6 * statistics.median(took):.0f} us)"
            )


def ratios(runs: list[tuple[Result, Result]]) -> dict[str, list[float]]:
    """kvsdk/native per run (pairs of kvsdk's and native's result)."""
    return {
        "per_step": [k.total / k.steps / (n.total / n.steps) for k, n in runs],
        "whole_trace": [k.total / n.total for k, n in runs],
        "lookup_steps": [sum(k.looking_up) / sum(n.looking_up) for k, n in runs],
        "other_steps": [sum(k.other) / sum(n.other) for k, n in runs],
    }


def summary(max_tokens: int, results: dict[str, list[Result]]) -> dict[str, Any]:
    """One output length's figures (per connector us/step; ratios when both ran)."""
    out: dict[str, Any] = {
        "max_tokens": max_tokens,
        "us_per_step": {
            c: [round(1e6 * r.total / r.steps, 1) for r in rs] for c, rs in results.items()
        },
        "steps": {c: [r.steps for r in rs] for c, rs in results.items()},
    }
    if len(results) == 2:
        r = ratios(list(zip(results["kvsdk"], results["native"], strict=True)))
        out["kvsdk_over_native"] = {k: [round(x, 3) for x in v] for k, v in r.items()}
        print(
            f"kvsdk/native scheduler-side CPU at {max_tokens} output tokens, per step: "
            + ", ".join(f"{x:.2f}x" for x in r["per_step"])
            + "; whole trace: "
            + ", ".join(f"{x:.2f}x" for x in r["whole_trace"])
            + "; all steps looking requests up: "
            + ", ".join(f"{x:.2f}x" for x in r["lookup_steps"])
            + "; all other steps: "
            + ", ".join(f"{x:.2f}x" for x in r["other_steps"])
        )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """us/step of each connector and kvsdk/native per step, against the output length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [row["max_tokens"] for row in rows]
    for connector in rows[0]["us_per_step"]:
        ys = [statistics.median(row["us_per_step"][connector]) for row in rows]
        left.plot(xs, ys, marker="o", label=connector)
    left.set(xscale="log", xlabel="output tokens per request", ylabel="us/step (median of runs)")
    left.set_title("scheduler-side hook CPU per engine step")
    left.legend()
    if "kvsdk_over_native" in rows[0]:
        ys = [statistics.median(row["kvsdk_over_native"]["per_step"]) for row in rows]
        right.plot(xs, ys, marker="o", color="C2", label="kvsdk / native")
        right.axhline(0.5, color="grey", linestyle="--", label="0.5x")
        right.set(xscale="log", xlabel="output tokens per request", ylabel="ratio per step")
        right.set_ylim(0, max(1.0, *ys))
        right.set_title("kvsdk / native, per step")
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> None:
    prof = cProfile.Profile() if args.profile else None
    rows = []
    for max_tokens in args.max_tokens:
        results: dict[str, list[Result]] = {}
        for _ in range(args.repeats):
            for connector in args.connectors.split(","):
                result = run_trace(
                    connector, args, max_tokens, prof if connector == "kvsdk" else None
                )
                report(connector, args, max_tokens, result)
                results.setdefault(connector, []).append(result)
        rows.append(summary(max_tokens, results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        setup = {k: v for k, v in vars(args).items() if k not in ("out", "profile", "sort")}
        doc = {"setup": setup, "rows": rows}
        (args.out / "profile_scheduler_hooks.json").write_text(json.dumps(doc, indent=1) + "\n")
        plot(rows, args.out / "profile_scheduler_hooks.png")
        print(f"wrote {args.out}/profile_scheduler_hooks.json and .png")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(30)
        print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64, help="per wave")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--connectors", default="kvsdk,native", help="kvsdk, native or both (each run in turn)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each connector, alternating")
    ap.add_argument("--profile", action="store_true", help="cProfile kvsdk's hooks (slower)")
    ap.add_argument(
        "--kvsdk-config",
        type=json.loads,
        default={},
        help="kvsdk settings over its defaults, as JSON (e.g. '{\"prompt_tail\": false}')",
    )
    ap.add_argument(
        "--evict-mib",
        type=int,
        default=64,
        help="write this much memory between steps, as a forward pass evicts the caches",
    )
    ap.add_argument("--sort", default="tottime", help="pstats order with --profile")
    ap.add_argument(
        "--max-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[8],
        help="output tokens per request; a comma list runs the trace at each (e.g. 8,64,256)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="write profile_scheduler_hooks.json and .png here"
    )
    run(ap.parse_args())


if __name__ == "__main__":
    main()
