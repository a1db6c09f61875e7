"""``kvsdk`` command line: config check / schema, plugins, bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvsdk.config import ConfigError, dump_json_schema, load_config


def _config_check(args: argparse.Namespace) -> int:
    try:
        if args.engine == "sglang":  # SGLang brings its own host tier
            from kvsdk.plugins.sglang.config import load_storage_config

            cfg, _ = load_storage_config(Path(args.file))
        else:
            cfg = load_config(Path(args.file))
    except ConfigError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    tiers = ", ".join(t.backend for t in cfg.tiers)
    print(
        f"{args.file}: OK (tiers: {tiers}; chunk_tokens={cfg.chunk_tokens}; "
        f"eviction={cfg.eviction})"
    )
    return 0


def _config_schema(args: argparse.Namespace) -> int:
    text = dump_json_schema()
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def _config_reference(args: argparse.Namespace) -> int:
    from kvsdk.config_reference import reference_markdown

    text = reference_markdown()
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from kvsdk import plugins_manager

    try:
        cfg = load_config(Path(args.config))
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    backends = plugins_manager.backends()
    report = []
    for i, tier in enumerate(cfg.tiers):
        cls = backends[tier.backend]
        try:
            rows = cls.inventory(tier.options)
            error = None
        except Exception as exc:  # an unreachable tier is reported, not raised
            rows, error = [], f"{type(exc).__name__}: {exc}"
        report.append(
            {
                "tier": i,
                "backend": tier.backend,
                "medium": cls.medium.value,
                "locality": cls.locality.value,
                "namespaces": rows,
                "error": error,
            }
        )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for t in report:
        print(f"tier {t['tier']}: {t['backend']} ({t['medium']}, {t['locality']})")
        if t["error"]:
            print(f"  unreachable: {t['error']}")
        elif not t["namespaces"]:
            print("  nothing to inspect from outside (process-local) or empty")
        for row in t["namespaces"]:
            extra = {k: v for k, v in row.items() if k not in ("namespace", "entries", "bytes")}
            print(
                f"  namespace {row['namespace']}: {row['entries']} chunks, "
                f"{row['bytes'] / 2**20:.1f} MiB {extra if extra else ''}".rstrip()
            )
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from kvsdk import plugins_manager

    infos = plugins_manager.list_plugins()
    if args.json:
        print(json.dumps([i.__dict__ for i in infos], indent=2))
        return 0
    w = max(len(i.name) for i in infos)
    for i in infos:
        print(f"{i.name:<{w}}  {i.source:<10}  {', '.join(i.hooks)}")
    print()
    print("backends:          ", ", ".join(sorted(plugins_manager.backends())))
    print("eviction policies: ", ", ".join(sorted(plugins_manager.eviction_policies())))
    print("transfer workers:  ", ", ".join(sorted(plugins_manager.transfer_workers())))
    return 0


def _bench_core(args: argparse.Namespace) -> int:
    from kvsdk.bench.core import format_table, run_core_bench
    from kvsdk.bench.synthetic import TraceSpec

    spec = TraceSpec(num_requests=args.requests, prefix_tokens=args.prefix_tokens, seed=args.seed)
    result = run_core_bench(spec, out=Path(args.out), progress=not args.no_progress)
    print(format_table(result))
    print(f"\nJSON: {args.out}  plot: {Path(args.out).with_suffix('.png')}")
    return 0 if result["mismatched_blocks"] == 0 else 1


def _demo(args: argparse.Namespace) -> int:
    try:
        from kvsdk.plugins.vllm.demo import format_report, run_demo
    except ImportError as exc:
        print(
            f"kvsdk demo needs vLLM (pip install kvsdk[vllm]; here: scripts/setup.sh vllm): {exc}",
            file=sys.stderr,
        )
        return 2
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
    try:
        from kvsdk.plugins.vllm import soak
        from kvsdk.plugins.vllm.tiny_model import make_tiny_llama
    except ImportError as exc:
        print(f"kvsdk bench faults needs vLLM: {exc}", file=sys.stderr)
        return 2
    model = str(make_tiny_llama(args.model_dir, seed=0))
    result = soak.run_bench(
        model, args.requests, args.seed, Path(args.out), progress=not args.no_progress
    )
    print(soak.format_report(result))
    print(f"\nJSON: {args.out}")
    return 0 if result["mismatches"] == 0 and result["leaks"] == 0 else 1


def _bench_serve(args: argparse.Namespace) -> int:
    try:
        from kvsdk.plugins.vllm import bench_serve
        from kvsdk.plugins.vllm.tiny_model import make_tiny_llama
    except ImportError as exc:
        print(f"kvsdk bench serve needs vLLM: {exc}", file=sys.stderr)
        return 2
    model = str(
        make_tiny_llama(
            args.model_dir,
            seed=0,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=8192,
        )
    )
    result = bench_serve.run_bench(
        model,
        Path(args.out),
        reuses=sorted(args.reuse),
        users=args.users,
        rounds=args.rounds,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(bench_serve.format_report(result))
    print(f"\nJSON: {args.out}  plot: {Path(args.out).with_suffix('.png')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsdk", description="KV-cache offloading for LLM engines")
    sub = p.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="validate a config file or export its schema")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    check = cfg_sub.add_parser("check", help="validate a YAML config file")
    check.add_argument("file")
    check.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="sglang: the tiers are HiCache's storage level (no host tier needed)",
    )
    check.set_defaults(func=_config_check)
    schema = cfg_sub.add_parser("schema", help="print the config's JSON Schema")
    schema.add_argument("-o", "--output")
    schema.set_defaults(func=_config_schema)
    reference = cfg_sub.add_parser("reference", help="print the configuration reference (Markdown)")
    reference.add_argument("-o", "--output")
    reference.set_defaults(func=_config_reference)

    inspect_p = sub.add_parser("inspect", help="what each tier of a config holds, per namespace")
    inspect_p.add_argument("config")
    inspect_p.add_argument("--json", action="store_true")
    inspect_p.set_defaults(func=_inspect)

    plugins = sub.add_parser("plugins", help="list installed plugins and the hooks they implement")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=_plugins)

    demo = sub.add_parser("demo", help="real vLLM + kvsdk on a local model: TTFT cold vs warm")
    demo.add_argument("--out", default="out/demo.json")
    demo.add_argument("--model-dir", default="out/models/demo-llama")
    demo.add_argument("--doc-tokens", type=int, default=2048)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    core = bench_sub.add_parser("core", help="core CPU time per step and per looked-up chunk")
    core.add_argument("--requests", type=int, default=300)
    core.add_argument("--prefix-tokens", type=int, default=2048)
    core.add_argument("--seed", type=int, default=0)
    core.add_argument("--out", default="out/bench_core.json")
    core.add_argument("--no-progress", action="store_true")
    core.set_defaults(func=_bench_core)
    faults = bench_sub.add_parser(
        "faults", help="soak through real vLLM with a faulty tier: mismatches and leaks"
    )
    faults.add_argument("--requests", type=int, default=1000)
    faults.add_argument("--seed", type=int, default=0)
    faults.add_argument("--out", default="out/soak.json")
    faults.add_argument("--model-dir", default="out/models/soak-llama")
    faults.add_argument("--no-progress", action="store_true")
    faults.set_defaults(func=_bench_faults)
    serve = bench_sub.add_parser(
        "serve", help="multi-round chat on real vLLM: no connector vs kvsdk vs native offloading"
    )
    serve.add_argument("--reuse", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    serve.add_argument("--users", type=int, default=4)
    serve.add_argument("--rounds", type=int, default=4)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--out", default="out/bench_serve.json")
    serve.add_argument("--model-dir", default="out/models/serve-llama")
    serve.add_argument("--no-progress", action="store_true")
    serve.set_defaults(func=_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvsdk: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
