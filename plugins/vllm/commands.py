"""The vLLM adapter's ``kvsdk`` commands: ``demo``, ``bench serve``, ``bench faults``,
``bench fleet``, ``bench pd``
and ``config check --engine vllm`` (with ``--model DIR``: the host tier against
one chunk of that model, :mod:`kvsdk.plugins.vllm.model_geometry`).

Registered through the ``kvsdk`` entry-point group like any plugin. Importing
this module imports no vLLM: each command imports its workload
(:mod:`kvsdk.plugins.vllm.workloads`) when it runs, and says so in one line
when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from kvsdk.commands import CommandRegistry, ModelArgs
from kvsdk.config import ConfigError, KVSDKConfig
from kvsdk.hooks import hookimpl


def _serve_model(model_dir: str) -> str:
    """The tiny Llama ``bench serve`` runs (the demo builds the same shape itself)."""
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    return str(
        make_tiny_llama(
            model_dir,
            seed=0,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=8192,
        )
    )


def _have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None  # finds, does not import


def _vllm_missing(command: str) -> bool:
    """True (and one line on stderr) when vLLM is not installed."""
    if _have_vllm():
        return False
    print(
        f"kvsdk {command} needs vLLM (pip install vllm; in this repository: scripts/setup.sh vllm)",
        file=sys.stderr,
    )
    return True


def _demo(args: argparse.Namespace) -> int:
    if _vllm_missing("demo"):
        return 2
    from kvsdk.plugins.vllm.workloads.demo import format_report, run_demo

    out = Path(args.out)
    result = run_demo(
        out,
        model_dir=Path(args.model_dir),
        doc_tokens=args.doc_tokens,
        progress=not args.no_progress,
    )
    print(format_report(result))
    print(f"\nJSON: {out}  plot: {out.with_suffix('.png')}")
    return 0 if result["outputs_matched"] == result["requests"] else 1


def _bench_faults(args: argparse.Namespace) -> int:
    if _vllm_missing("bench faults"):
        return 2
    from kvsdk.plugins.vllm.workloads import soak
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(args.model_dir, seed=0))
    result = soak.run_bench(
        model, args.requests, args.seed, Path(args.out), progress=not args.no_progress
    )
    print(soak.format_report(result))
    print(f"\nJSON: {args.out}")
    return 0 if result["mismatches"] == 0 and result["leaks"] == 0 else 1


def _bench_serve(args: argparse.Namespace) -> int:
    if _vllm_missing("bench serve"):
        return 2
    from kvsdk.plugins.vllm.workloads import bench_serve

    model = _serve_model(args.model_dir)
    result = bench_serve.run_bench(
        model,
        Path(args.out),
        reuses=sorted(args.reuse),
        users=args.users,
        rounds=args.rounds,
        seed=args.seed,
        threads=args.threads,
        configs=("none", *(c for c in args.configs.split(",") if c and c != "none")),
        repeats=args.repeats,
        progress=not args.no_progress,
        kvsdk_config=json.loads(args.kvsdk_config),
    )
    print(bench_serve.format_report(result))
    print(f"\nJSON: {args.out}  plot: {Path(args.out).with_suffix('.png')}")
    return 0


def _bench_fleet(args: argparse.Namespace) -> int:
    if _vllm_missing("bench fleet"):
        return 2
    from kvsdk.plugins.vllm.workloads import bench_fleet, fleet_configs, fleet_report
    from kvsdk.plugins.vllm.workloads.fleet_procs import router_binary
    from kvsdk.plugins.vllm.workloads.fleet_workload import Workload
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    if router_binary() is None:
        print(
            "kvsdk bench fleet needs vllm-router (scripts/install_vllm_router.sh)",
            file=sys.stderr,
        )
        return 2
    try:
        configs = fleet_configs.parse_configs(
            args.configs or ",".join(fleet_configs.DEFAULT_CONFIGS)
        )
    except ValueError as exc:
        print(f"kvsdk bench fleet: --configs: {exc}", file=sys.stderr)
        return 2
    heads = max(1, args.hidden // 128)  # head_dim 128; two query heads per KV head
    model_info = {"layers": args.layers, "hidden": args.hidden, "heads": heads,
                  "kv_heads": max(1, heads // 2), "dtype": "float32"}  # fmt: skip
    w = Workload(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    max_model_len = max(4096, w.max_prompt() + w.max_tokens)
    model_dir = args.model_dir or f"out/models/fleet-llama-{args.layers}x{args.hidden}"
    model = str(
        make_tiny_llama(
            model_dir,
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=model_info["kv_heads"],
            max_position_embeddings=max_model_len,
            tokenizer=True,
        )
    )
    settings = bench_fleet.FleetSettings(
        host_bytes=args.host_tier_mib << 20,
        kv_cache_gib=args.kv_cache_gib,
        redis_maxmemory=args.redis_maxmemory,
        max_model_len=max_model_len,
        pin=not args.no_pin,
    )
    out = Path(args.out)
    result = bench_fleet.run_bench(
        model, out, configs, w, settings, passes=args.passes,
        progress=not args.no_progress, model_info=model_info,
    )  # fmt: skip
    print(fleet_report.format_report(result))
    print(f"\nJSON: {out}  plot: {out.with_suffix('.png')}  logs: {result['logs']}")
    return 0


def _bench_pd(args: argparse.Namespace) -> int:
    if _vllm_missing("bench pd"):
        return 2
    from kvsdk.plugins.vllm.workloads import pd_bench, pd_report
    from kvsdk.plugins.vllm.workloads.fleet_procs import router_binary
    from kvsdk.plugins.vllm.workloads.pd_pair import PDSettings
    from kvsdk.plugins.vllm.workloads.pd_workload import PDWorkload
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    if router_binary() is None:
        print("kvsdk bench pd needs vllm-router (scripts/install_vllm_router.sh)", file=sys.stderr)
        return 2
    if min(args.prompt_tokens) < 1 or args.requests < 1 or args.max_tokens < 2:
        print(
            "kvsdk bench pd: --prompt-tokens and --requests must be at least 1, "
            "--max-tokens at least 2 (an inter-token latency needs two tokens)",
            file=sys.stderr,
        )
        return 2
    w = PDWorkload(
        prompt_tokens=tuple(args.prompt_tokens),
        requests=args.requests,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    heads = max(1, args.hidden // 128)  # head_dim 128; two query heads per KV head
    model_info = {"layers": args.layers, "hidden": args.hidden, "heads": heads,
                  "kv_heads": max(1, heads // 2), "dtype": "float32"}  # fmt: skip
    max_model_len = max(4096, -(-(w.max_prompt() + w.max_tokens) // 1024) * 1024)
    model_dir = args.model_dir or f"out/models/pd-llama-{args.layers}x{args.hidden}"
    model = str(
        make_tiny_llama(
            model_dir,
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=model_info["kv_heads"],
            max_position_embeddings=max_model_len,
            tokenizer=True,
        )
    )
    settings = PDSettings(
        tier=args.tier,
        host_bytes=args.host_tier_mib << 20,
        kv_cache_gib=args.kv_cache_gib,
        redis_maxmemory=args.redis_maxmemory,
        max_model_len=max_model_len,
        pin=not args.no_pin,
    )
    out = Path(args.out)
    result = pd_bench.run_bench(
        model, out, w, settings, progress=not args.no_progress, model_info=model_info
    )
    print(pd_report.format_report(result))
    print(f"\nJSON: {out}  plot: {out.with_suffix('.png')}  logs: {result['logs']}")
    o = result["outputs"]
    return 0 if o["equal"] == o["compared"] == w.total else 1


def _check_model(path: Path, cfg: KVSDKConfig, model: ModelArgs) -> str:
    """One chunk of ``model`` as the adapter computes it at start; a host tier
    smaller than that is refused (the engine would refuse it)."""
    if not _have_vllm():
        raise ConfigError(
            "--model: computing a chunk needs vLLM (pip install 'kvsdk[vllm]'; "
            "in this repository: scripts/setup.sh vllm)"
        )
    from kvsdk.plugins.vllm.model_geometry import model_chunk

    chunk = model_chunk(path, model.model, block_size=model.block_size, dtype=model.dtype)
    detail = (
        f"{chunk.tokens} tokens x {chunk.chunk_bytes // chunk.tokens} B of KV per token: "
        f"{chunk.layers} layers in {chunk.dtype}, block size {chunk.block_size}"
    )
    host = getattr(cfg.tiers[0].options, "capacity", None)
    if isinstance(host, int) and host < chunk.chunk_bytes:
        raise ConfigError(
            f"tiers[0].capacity: got {host} bytes; one chunk of {model.model} is "
            f"{chunk.chunk_bytes} bytes ({detail}): the host tier needs at least "
            f"{chunk.chunk_bytes} bytes ({_mib(chunk.chunk_bytes)})"
        )
    held = f"; the host tier holds {host // chunk.chunk_bytes}" if isinstance(host, int) else ""
    return f"one chunk of {model.model} is {chunk.chunk_bytes} bytes ({detail}){held}"


def _mib(n: int) -> str:
    """``n`` bytes rounded up to a size with a unit (a value the config takes)."""
    return f"{-(-n // (1 << 20))}MiB" if n >= 1 << 20 else f"{-(-n // 1024)}KiB"


def _load_vllm_config(path: Path) -> KVSDKConfig:
    # vLLM runs kvsdk's whole chain, host tier first; the server's start-up check
    from kvsdk.plugins.vllm import load_vllm_config

    return load_vllm_config(path)


@hookimpl
def kvsdk_register_commands(commands: CommandRegistry) -> None:
    note = "" if _have_vllm() else " [needs vLLM]"
    commands.config_engine(
        "vllm",
        help="the whole tier chain, a host tier of at least 1 MiB first (the server's check)",
        load=_load_vllm_config,
        check_model=_check_model,
    )

    demo = commands.command(
        "demo", help="real vLLM + kvsdk on a local model: TTFT cold vs warm" + note, run=_demo
    )
    demo.add_argument("--out", default="out/demo.json")
    demo.add_argument("--model-dir", default="out/models/demo-llama")
    demo.add_argument("--doc-tokens", type=int, default=2048)
    demo.add_argument("--no-progress", action="store_true")

    faults = commands.bench(
        "faults",
        help="soak through real vLLM with a faulty tier: mismatches and leaks" + note,
        run=_bench_faults,
    )
    faults.add_argument("--requests", type=int, default=1000)
    faults.add_argument("--seed", type=int, default=0)
    faults.add_argument("--out", default="out/soak.json")
    faults.add_argument("--model-dir", default="out/models/soak-llama")
    faults.add_argument("--no-progress", action="store_true")

    serve = commands.bench(
        "serve",
        help="multi-round chat on real vLLM: no connector vs kvsdk vs native offloading" + note,
        run=_bench_serve,
    )
    serve.add_argument("--reuse", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    serve.add_argument("--users", type=int, default=4)
    serve.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="turns per user (8: a p50 over 32 requests; over 4 rounds one late-batched "
        "round moves it by 10-30 %%)",
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--threads",
        type=int,
        help="OpenMP threads per engine (OMP_NUM_THREADS); default: vLLM's (every core)",
    )
    serve.add_argument(
        "--configs",
        default="none,kvsdk,native",
        help="comma-separated, of none,kvsdk,native,null (none always runs: the baseline; "
        "null: a connector that moves nothing, the cost of vLLM's connector hooks alone)",
    )
    serve.add_argument(
        "--repeats", type=int, default=1, help="passes in both orders (1: each config twice)"
    )
    serve.add_argument(
        "--kvsdk-config",
        default="{}",
        help="kvsdk config keys (JSON) over its defaults, e.g. "
        '\'{"tiers": [{"backend": "cpu", "capacity": "1GiB", "prefault": false}]}\'',
    )
    serve.add_argument("--out", default="out/bench_serve.json")
    serve.add_argument("--model-dir", default="out/models/serve-llama")
    serve.add_argument("--no-progress", action="store_true")

    fleet = commands.bench(
        "fleet",
        help="two vLLM engines behind vllm-router, with and without kvsdk's shared tier" + note,
        run=_bench_fleet,
    )
    fleet.add_argument(
        "--configs",
        help="comma-separated: none-POLICY or kvsdk-TIER-POLICY (tiers: redis, disk, host, "
        "mooncake, redis_cluster, redis_cluster_failover; policies: rr, cache_aware, kv_aware); "
        "none-rr always runs (the baseline). Default: none-rr, "
        "none-cache_aware, kvsdk-redis-rr, kvsdk-redis-cache_aware, kvsdk-disk-rr",
    )
    fleet.add_argument("--users", type=int, default=8)
    fleet.add_argument("--rounds", type=int, default=5)
    fleet.add_argument("--system-tokens", type=int, default=1000, help="per user")
    fleet.add_argument("--user-tokens", type=int, default=200, help="new tokens per turn")
    fleet.add_argument(
        "--answer-tokens", type=int, default=100, help="an answer kept in the history"
    )
    fleet.add_argument("--max-tokens", type=int, default=16, help="tokens streamed per request")
    fleet.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    fleet.add_argument("--passes", type=int, default=2, help="every config per pass, fresh engines")
    fleet.add_argument("--seed", type=int, default=0)
    fleet.add_argument("--layers", type=int, default=8, help="of the local random Llama")
    fleet.add_argument("--hidden", type=int, default=1024, help="of the local random Llama")
    fleet.add_argument("--host-tier-mib", type=int, default=1024, help="kvsdk host tier per engine")
    fleet.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    fleet.add_argument("--redis-maxmemory", default="6gb")
    fleet.add_argument("--no-pin", action="store_true", help="do not pin each engine to a core")
    fleet.add_argument("--out", default="out/bench_fleet.json")
    fleet.add_argument("--model-dir", help="default: out/models/fleet-llama-LAYERSxHIDDEN")
    fleet.add_argument("--no-progress", action="store_true")

    pd = commands.bench(
        "pd",
        help="one engine vs a prefill/decode pair behind vllm-router over kvsdk's shared tier"
        + note,
        run=_bench_pd,
    )
    pd.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths"
    )
    pd.add_argument("--requests", type=int, default=3, help="prompts per length")
    pd.add_argument("--max-tokens", type=int, default=32, help="tokens streamed per request")
    pd.add_argument("--tier", choices=("disk", "redis"), default="disk", help="the shared tier")
    pd.add_argument("--seed", type=int, default=0)
    pd.add_argument("--layers", type=int, default=8, help="of the local random Llama")
    pd.add_argument("--hidden", type=int, default=1024, help="of the local random Llama")
    pd.add_argument("--host-tier-mib", type=int, default=1024, help="kvsdk host tier per engine")
    pd.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    pd.add_argument("--redis-maxmemory", default="4gb")
    pd.add_argument("--no-pin", action="store_true", help="do not pin each engine to a core")
    pd.add_argument("--out", default="out/bench_pd.json")
    pd.add_argument("--model-dir", help="default: out/models/pd-llama-LAYERSxHIDDEN")
    pd.add_argument("--no-progress", action="store_true")
