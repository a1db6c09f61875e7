"""``kvsdk`` command line: the core's commands (config, inspect, clear, plugins, bench core).

Every other command comes from a plugin through the ``kvsdk_register_commands``
hook (:mod:`kvsdk.commands`): the engine adapters add theirs (``kvsdk demo``,
``kvsdk bench serve``, ``kvsdk config check --engine sglang``...); this module
names no engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from kvsdk import plugins_manager
from kvsdk.commands import CommandRegistry, ModelArgs
from kvsdk.config import ConfigError, KVSDKConfig, dump_json_schema, load_config
from kvsdk.trust import redact


def _config_check(args: argparse.Namespace) -> int:
    engine = args.config_engines[args.engine] if args.engine else None
    if args.model is not None and (engine is None or engine.check_model is None):
        able = sorted(n for n, e in args.config_engines.items() if e.check_model)
        print(
            f"{args.file}: --model needs --engine {' or '.join(able) or '(none installed)'}: "
            "the engine computes a chunk's bytes from the model",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = (engine.load if engine else load_config)(Path(args.file))
        note = None
        if args.model is not None and engine is not None and engine.check_model is not None:
            model = ModelArgs(Path(args.model), args.block_size, args.dtype)
            note = engine.check_model(Path(args.file), cfg, model)
    except ConfigError as exc:
        print(f"{args.file}: {redact(str(exc))}", file=sys.stderr)
        return 2
    for warning in _config_warnings(cfg):
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    if note:
        print(f"{args.file}: {note}")
    tiers = ", ".join(t.backend for t in cfg.tiers)
    print(
        f"{args.file}: OK (tiers: {tiers}; chunk_tokens={cfg.chunk_tokens or 'engine block size'}; "
        f"eviction={cfg.eviction})"
    )
    return 0


SMALL_TIER_BYTES = 1 << 20
"""Below this a tier holds no chunk of any real model (the vLLM adapter refuses such a host tier)."""


def _config_warnings(cfg: KVSDKConfig) -> list[str]:
    """What the schema allows but an engine would refuse, where the engine's
    geometry (bytes per chunk) is not known here."""
    return [
        f"tiers[{i}].capacity: {capacity} bytes holds no chunk of a real model (a chunk is "
        "chunk_tokens, by default the engine's block size, x the model's KV bytes per token: "
        "128 KiB per token for Llama-3-8B in bf16); write a size with a unit, e.g. 8GiB "
        "(--engine vllm --model DIR gives a model's exact chunk size)"
        for i, tier in enumerate(cfg.tiers)
        if isinstance(capacity := getattr(tier.options, "capacity", None), int)
        and capacity < SMALL_TIER_BYTES
    ]


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
    try:
        cfg = load_config(Path(args.config))
    except ConfigError as exc:
        print(f"{args.config}: {redact(str(exc))}", file=sys.stderr)
        return 2
    backends = plugins_manager.backends()
    report = []
    for i, tier in enumerate(cfg.tiers):
        cls = backends[tier.backend]
        rows, error = [], _path_problem(tier.options)
        if error is None:
            try:
                rows = cls.inventory(tier.options)
            except Exception as exc:  # an unreachable tier is reported, then exit 1
                error = f"{type(exc).__name__}: {redact(str(exc))}"
        report.append(
            {
                "tier": i,
                "backend": tier.backend,
                "medium": cls.medium.value,
                "locality": cls.locality.value,
                "namespaces": rows,
                # entries that are not the tier's own (skipped), where it counts them
                "foreign_entries": int(getattr(rows, "foreign_entries", 0)),
                "error": error,
            }
        )
    failed = [t for t in report if t["error"]]
    for t in failed:
        print(f"{args.config}: tiers[{t['tier']}] ({t['backend']}): {t['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
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
        if t["foreign_entries"]:
            print(f"  {t['foreign_entries']} foreign entries skipped (not kvsdk chunks)")
    return 1 if failed else 0


NAMESPACE_NAME = re.compile(r"[0-9a-f]{32}")
"""A namespace's name in the tiers: its public fingerprint in lowercase hex."""


def _clear(args: argparse.Namespace) -> int:
    """The full wipe of a config's shared tiers (an engine's reset never does it)."""
    if args.namespace is not None and not NAMESPACE_NAME.fullmatch(args.namespace):
        print(
            f"{args.config}: --namespace {args.namespace!r} is not a namespace's name: "
            "expected its 32 lowercase hex digits, as kvsdk inspect lists them",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = load_config(Path(args.config))
    except ConfigError as exc:
        print(f"{args.config}: {redact(str(exc))}", file=sys.stderr)
        return 2
    backends = plugins_manager.backends()
    what = "every namespace" if args.namespace is None else f"namespace {args.namespace}"
    if not args.yes:
        print(
            f"{args.config}: would delete {what} from every disk and Redis tier it names, "
            "for every engine sharing them; run again with --yes to do it",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for i, tier in enumerate(cfg.tiers):
        try:
            n = backends[tier.backend].wipe(tier.options, args.namespace)
        except Exception as exc:  # an unreachable tier is reported, then exit 1
            print(
                f"{args.config}: tiers[{i}] ({tier.backend}): "
                f"{type(exc).__name__}: {redact(str(exc))}",
                file=sys.stderr,
            )
            failed += 1
            continue
        print(f"tier {i}: {tier.backend}: {n} chunks deleted ({what})")
    return 1 if failed else 0


def _path_problem(options: object) -> str | None:
    """For a tier with a ``path`` option: why that directory cannot be used, or
    None (it exists, or it can be created at the first start)."""
    raw = getattr(options, "path", None)
    if not isinstance(raw, str):
        return None
    path = Path(raw)
    if path.is_dir():
        return None
    if path.exists():
        return f"path {raw!r} is not a directory"
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"path {raw!r} cannot be created: {str(parent)!r} is not a writable directory"
    return None


def _plugins(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsdk", description="KV-cache offloading for LLM engines")
    sub = p.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="validate a config file or export its schema")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    check = cfg_sub.add_parser("check", help="validate a YAML config file")
    check.add_argument("file")
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

    clear = sub.add_parser(
        "clear",
        help="delete what a config's shared tiers (disk, Redis) hold, for every engine sharing them",
    )
    clear.add_argument("config")
    clear.add_argument("--namespace", help="only this namespace (its hex name, see inspect)")
    clear.add_argument("--yes", action="store_true", help="really delete (else: say what, exit 2)")
    clear.set_defaults(func=_clear)

    plugins = sub.add_parser("plugins", help="list installed plugins and the hooks they implement")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=_plugins)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    core = bench_sub.add_parser("core", help="core CPU time per step and per looked-up chunk")
    core.add_argument("--requests", type=int, default=300)
    core.add_argument("--prefix-tokens", type=int, default=2048)
    core.add_argument("--seed", type=int, default=0)
    core.add_argument("--out", default="out/bench_core.json")
    core.add_argument("--no-progress", action="store_true")
    core.set_defaults(func=_bench_core)

    commands = CommandRegistry(sub, bench_sub)
    plugins_manager.register_commands(commands)
    engines = commands.config_engines
    check.add_argument(
        "--engine",
        choices=sorted(engines),
        help="read the file as this engine does (default: kvsdk's own schema, host tier first); "
        + "; ".join(f"{name}: {engines[name].help}" for name in sorted(engines)),
    )
    check.add_argument(
        "--model",
        metavar="DIR",
        help="a local model directory (config.json): check the config against one chunk of "
        "this model as the engine computes it (needs --engine)",
    )
    check.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="with --model: the engine's block size (default: what the engine picks itself)",
    )
    check.add_argument(
        "--dtype", default="auto", help="with --model: the model dtype flag given to the engine"
    )
    check.set_defaults(config_engines=engines)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvsdk: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
