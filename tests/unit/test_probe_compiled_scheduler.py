"""``benchmarks/probe_compiled_scheduler.py`` moves the built-in plugin
registrations out of the modules it compiles: in the rewritten copy (not
compiled here) kvsdk still finds its CPU backend and eviction policies, and no
compiled module keeps an ``@hookimpl``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe() -> object:
    spec = importlib.util.spec_from_file_location(
        "probe_compiled_scheduler", ROOT / "benchmarks" / "probe_compiled_scheduler.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rewritten_copy_registers_every_built_in_and_no_hot_module_has_a_hookimpl(
    tmp_path: Path,
) -> None:
    probe = _probe()
    probe.assemble_tree(tmp_path)  # type: ignore[attr-defined]
    probe.move_hookimpls(tmp_path)  # type: ignore[attr-defined]
    for rel in probe.HOT_MODULES:  # type: ignore[attr-defined]
        assert "@hookimpl" not in (tmp_path / rel).read_text(), rel
    code = (
        "import kvsdk, kvsdk.plugins_manager as pm; "
        f"assert kvsdk.__file__.startswith({str(tmp_path)!r}), kvsdk.__file__; "
        "print(sorted(pm.backends()), sorted(pm.eviction_policies()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    backends, policies = out.strip().split("] [")
    assert "'cpu'" in backends and "'disk'" in backends
    assert "'lru'" in policies and "'arc'" in policies
