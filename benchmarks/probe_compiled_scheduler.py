"""How much a compiled scheduler path would buy: kvsdk's scheduler-side hooks
pure Python against the same modules compiled with mypyc, beside vLLM's native
connector, on ``profile_scheduler_hooks.py``'s trace.

kvsdk ships pure Python. This probe copies ``kvsdk/`` to a scratch directory,
compiles its scheduler hot path there with mypyc (the modules below; ~5 min
on one core), and runs ``profile_scheduler_hooks.py`` alternately with the
repository's kvsdk and with the compiled copy first on ``PYTHONPATH``. Two
built-in plugin registrations (``@hookimpl`` functions: pluggy marks them with
an attribute, which a compiled function cannot carry) move to a generated
module in the copy; nothing else changes. It needs mypy (the test extra) and
a C compiler.

    python benchmarks/probe_compiled_scheduler.py [--requests 10] [--waves 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "benchmarks" / "profile_scheduler_hooks.py"
HOT_MODULES = (
    "kvsdk/scheduler/offload.py",
    "kvsdk/scheduler/chunk_keys.py",
    "kvsdk/scheduler/lookup.py",
    "kvsdk/scheduler/load_jobs.py",
    "kvsdk/scheduler/store_pacing.py",
    "kvsdk/scheduler/request.py",
    "kvsdk/scheduler/store_jobs.py",
    "kvsdk/scheduler/tail.py",
    "kvsdk/scheduler/steps.py",
    "kvsdk/planner.py",
    "kvsdk/ledger.py",
    "kvsdk/keys.py",
    "kvsdk/backends/cpu.py",
    "kvsdk/eviction.py",
    "kvsdk/store/tiered.py",
    "kvsdk/events.py",
    "kvsdk/plugins/vllm/scheduler_side.py",
)
"""Everything the scheduler-side hooks run per request and per step (kvsdk.metrics
stays pure: mypyc does not compile its nested class)."""
PLUGIN_HOOKS = {
    "kvsdk/backends/cpu.py": "kvsdk_backends",
    "kvsdk/eviction.py": "kvsdk_eviction_policies",
}
"""Compiled modules that register a built-in plugin: their ``@hookimpl`` moves out."""
PROBE_PLUGIN = "kvsdk_compiled_probe_hooks"


def move_hookimpls(tree: Path) -> None:
    """Move each ``@hookimpl`` function of ``PLUGIN_HOOKS`` into one generated,
    uncompiled plugin module that imports what they return."""
    out = [  # annotations unevaluated: the moved functions keep theirs as written
        "from __future__ import annotations",
        "from typing import Any",
        "from kvsdk.hooks import hookimpl",
    ]
    for rel, hook in PLUGIN_HOOKS.items():
        src = (tree / rel).read_text()
        head, sep, impl = src.partition(f"@hookimpl\ndef {hook}(")
        if not sep:
            raise SystemExit(f"{rel}: no @hookimpl {hook}; update {Path(__file__).name}")
        body = sep + impl
        module = rel.removesuffix(".py").replace("/", ".")
        names = sorted(set(re.findall(r'"\w+": (\w+)', body)))
        out.append(f"from {module} import {', '.join(names)}")
        out.append(body)
        (tree / rel).write_text(head)
    (tree / "kvsdk" / f"{PROBE_PLUGIN}.py").write_text("\n".join(out) + "\n")
    pm = tree / "kvsdk" / "plugins_manager.py"
    text = pm.read_text()
    for rel in PLUGIN_HOOKS:
        text = text.replace(f'"{rel.removesuffix(".py").replace("/", ".")}",', "", 1)
    pm.write_text(
        text.replace(
            "DEFAULT_PLUGINS: tuple[str, ...] = (",
            f'DEFAULT_PLUGINS: tuple[str, ...] = ("kvsdk.{PROBE_PLUGIN}",',
            1,
        )
    )


def assemble_tree(tree: Path) -> None:
    """Copy the ``kvsdk`` package into ``tree`` as installed: the core from
    ``kvsdk/``, the adapters from ``plugins/`` and the backends from ``backends/``
    (pyproject's ``package-dir``)."""
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "kvsdk", tree / "kvsdk", ignore=skip)
    shutil.copytree(ROOT / "plugins", tree / "kvsdk" / "plugins", ignore=skip)
    shutil.copytree(ROOT / "backends", tree / "kvsdk" / "backends", ignore=skip)


def compile_copy(tree: Path) -> None:
    assemble_tree(tree)
    shutil.copy(ROOT / "pyproject.toml", tree)  # mypy's settings
    move_hookimpls(tree)
    log = tree / "mypyc.log"
    print(f"compiling {len(HOT_MODULES)} modules with mypyc in {tree} (log: {log}) ...", flush=True)
    start = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "mypyc", *HOT_MODULES], cwd=tree, stdout=f, stderr=f
        )
    if rc:
        raise SystemExit(f"mypyc failed (rc {rc}); see {log}")
    print(f"compiled in {time.monotonic() - start:.0f} s", flush=True)


def profile(args: argparse.Namespace, pythonpath: str | None) -> tuple[float, float]:
    """kvsdk's and native's scheduler-side us/step in one run of the profile."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [
            sys.executable,
            str(PROFILE),
            "--requests",
            str(args.requests),
            "--waves",
            str(args.waves),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    per = dict(re.findall(r"^(kvsdk|native): .* hooks (\d+) us/step", out, re.M))
    return float(per["kvsdk"]), float(per["native"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10, help="per wave")
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each build, alternating")
    ap.add_argument("--keep", type=Path, help="compile into (and keep) this directory")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "probe_compiled_scheduler.json")
    args = ap.parse_args()
    tree = args.keep or Path(tempfile.mkdtemp(prefix="kvsdk-mypyc-"))
    try:
        if not (tree / "kvsdk").exists():
            compile_copy(tree)
        runs: dict[str, list[tuple[float, float]]] = {"pure": [], "compiled": []}
        for i in range(args.repeats):
            for build, path in (("pure", None), ("compiled", str(tree))):
                runs[build].append(profile(args, path))
                k, n = runs[build][-1]
                print(
                    f"run {i + 1} {build:8s}: kvsdk {k:.0f} us/step, native {n:.0f}: {k / n:.2f}x"
                )
        for build, rs in runs.items():
            k = statistics.median(r[0] for r in rs)
            ratio = statistics.median(r[0] / r[1] for r in rs)
            print(f"{build:8s}: kvsdk median {k:.0f} us/step, kvsdk/native median {ratio:.2f}x")
        pure = statistics.median(r[0] for r in runs["pure"])
        comp = statistics.median(r[0] for r in runs["compiled"])
        print(f"compiled/pure kvsdk scheduler-side time: {comp / pure:.2f}x")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "trace": {"requests": args.requests, "waves": args.waves},
            "modules": HOT_MODULES,
            "us_per_step": {
                b: [{"kvsdk": k, "native": n} for k, n in rs] for b, rs in runs.items()
            },
            "compiled_over_pure": comp / pure,
        }
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    finally:
        if args.keep is None:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main()
