"""kvsdk's scheduler-side CPU time per engine step, in one process, without a model.

vLLM's real ``Scheduler`` builds the real ``KVSDKConnector`` (kvsdk at its
defaults, vLLM at vLLM-CPU's 128-token blocks) and is stepped by hand: each
scheduled request samples one token, and every store and load a step asks
for is reported done by the next step (as a worker that always keeps up).
The trace has the shape of ``bench_vllm_connector.py``'s part 2: waves of
requests over shared prefixes, vLLM's own prefix cache reset between waves
(later waves load their prefixes from kvsdk).

It prints the connector hooks' thread CPU time per step, per hook, and with
``--profile`` the hottest functions (cProfile). In the EngineCore the same
hooks take 1.5-4x longer and vary by +-25 % from run to run (they run between
forward passes, on cold caches, beside vLLM's I/O threads), so a change to
the scheduler side is easier to judge here first; the comparison with
vLLM's native connector stays ``bench_vllm_connector.py``'s.

    python benchmarks/profile_scheduler_hooks.py [--waves 4] [--requests 64] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvsdk.plugins.vllm.messages import KVSDKWorkerMetadata
from kvsdk.plugins.vllm.workloads.model_free_scheduler import (
    model_free_scheduler,
    write_llama_config,
)

BLOCK = 128  # vLLM-CPU's default
LAYERS, KV_HEADS, HEAD = 8, 8, 64
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)


def build_scheduler(model_dir: str, num_blocks: int) -> Scheduler:
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
        kvsdk_config={"tiers": [{"backend": "cpu", "capacity": "512MiB"}]},  # else defaults
        block_size=BLOCK,
        num_blocks=num_blocks,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )


def timed_hooks(connector: Any, spent: dict[str, float], prof: cProfile.Profile | None) -> None:
    """Wrap each hook of the live connector: its thread CPU time into ``spent``."""
    for name in HOOKS:
        original: Callable[..., Any] = getattr(connector, name)

        def hook(*a: Any, _fn: Callable[..., Any] = original, _name: str = name, **kw: Any) -> Any:
            start = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                return _fn(*a, **kw)
            finally:
                if prof is not None:
                    prof.disable()
                spent[_name] = spent.get(_name, 0.0) + time.thread_time() - start

        setattr(connector, name, hook)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as model_dir:
        sched = build_scheduler(model_dir, num_blocks=2000)
    prof = cProfile.Profile() if args.profile else None
    spent: dict[str, float] = {}
    timed_hooks(sched.connector, spent, prof)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50, 30000) for _ in range(rng.randint(512, 1024))] for _ in range(8)]
    steps = 0
    try:
        for wave in range(args.waves):
            if wave:
                sched.reset_prefix_cache()  # later waves load their prefixes from kvsdk
            for i in range(args.requests):
                prompt = prefixes[i % 8] + [
                    rng.randrange(50, 30000) for _ in range(rng.randint(16, 200))
                ]
                sched.add_request(
                    Request(
                        f"w{wave}r{i}",
                        prompt,
                        SamplingParams(max_tokens=8, ignore_eos=True),
                        None,
                        block_hasher=get_request_block_hasher(BLOCK, sha256),
                    )
                )
            done: dict[int, int] = {}
            while sched.requests:
                so = sched.schedule()
                steps += 1
                meta = so.kv_connector_metadata
                ids = list(so.num_scheduled_tokens)
                worker = KVSDKWorkerMetadata(completed=dict(done)) if done else None
                done = {j.job_id: 1 for j in meta.stores} | {j: 1 for j in meta.loads}
                released = set(meta.release) if meta.release else None
                kv = (
                    KVConnectorOutput(finished_sending=released, kv_connector_worker_meta=worker)
                    if worker or released
                    else None
                )
                sched.update_from_output(
                    so,
                    ModelRunnerOutput(
                        req_ids=ids,
                        req_id_to_index={r: i for i, r in enumerate(ids)},
                        sampled_token_ids=[[7] for _ in ids],
                        kv_connector_output=kv,
                    ),
                )
    finally:
        sched.shutdown()
    total = sum(spent.values())
    print(
        f"{args.waves} waves x {args.requests} requests, {steps} steps: kvsdk's scheduler-side "
        f"hooks {1e6 * total / steps:.0f} us/step thread CPU ({1e3 * total:.1f} ms)"
    )
    for name, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:30s} {1e3 * secs:7.1f} ms")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(30)
        print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64, help="per wave")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the hooks (slower)")
    ap.add_argument("--sort", default="tottime", help="pstats order with --profile")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
