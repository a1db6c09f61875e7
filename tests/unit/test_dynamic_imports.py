"""The one import rule ``lint-imports`` cannot see: a module named as a string.

pyproject's ``[tool.importlinter]`` contracts keep the core free of engines,
adapters and backends, but import-linter reads ``import`` statements only. A
call such as ``importlib.import_module("kvsdk.backends.disk")`` would pass it,
so this test keeps such calls out of the core, save in ``kvsdk.plugins_manager``,
which names the built-in backends the way pytest names its default plugins.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "kvsdk"
FORBIDDEN = ("vllm", "sglang", "kvsdk.plugins", "kvsdk.backends")
ALLOWED = {"plugins_manager.py"}


def named_imports(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``import_module("...")``/``__import__("...")``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        arg = node.args[0]
        if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
            out.append((node.lineno, str(arg.value)))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in ALLOWED:
            continue
        for line, name in named_imports(path.read_text()):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                found.append(f"{path.relative_to(root)}:{line} names {name}")
    return found


def test_the_core_names_no_engine_adapter_or_backend_as_a_string() -> None:
    assert violations(CORE) == []


def test_a_named_import_is_caught(tmp_path: Path) -> None:
    (tmp_path / "plugins_manager.py").write_text('import_module("kvsdk.backends.disk")\n')
    (tmp_path / "keys.py").write_text(
        'import importlib\nimportlib.import_module("vllm.config")\n__import__("json")\n'
    )
    assert violations(tmp_path) == ["keys.py:2 names vllm.config"]
