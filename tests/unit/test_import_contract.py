"""The import rules that keep kvsdk's shape, checked on every module's source.

- The core (``kvsdk`` outside ``kvsdk.backends`` and ``kvsdk.plugins``) imports
  no engine, no adapter and no backend module; built-in backends arrive through
  the plugin manager, which alone may name them (as strings, the way pytest
  names its default plugins).
- Backends import no engine and no adapter.
- The vLLM and SGLang adapters never import each other (nor each other's engine).

Every ``import`` counts, at module level or inside a function, and so does a
string literal passed to ``importlib.import_module``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}: {self.rule}"


def package_dirs(root: Path) -> dict[str, Path]:
    """``package -> folder`` as the build maps them (pyproject's ``package-dir``,
    or each package in the folder of its name)."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = conf.get("tool", {}).get("setuptools", {}).get("package-dir", {"kvsdk": "kvsdk"})
    return {pkg: root / folder for pkg, folder in mapping.items()}


def modules(dirs: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    """Every module of the distribution, each under its most specific package."""
    seen: dict[Path, str] = {}
    for pkg, folder in sorted(dirs.items(), key=lambda kv: -kv[0].count(".")):
        for path in sorted(folder.rglob("*.py")):
            if path in seen:
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            seen[path] = ".".join([pkg, *parts])
    for path, name in sorted(seen.items(), key=lambda kv: kv[1]):
        yield name, path


def imported_names(module: str, path: Path) -> Iterator[tuple[int, str, bool]]:
    """``(line, module name, named as a string)`` for every import in ``path``,
    relative ones resolved; the flag marks ``import_module("...")`` literals."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target, False
            for alias in node.names:  # `from pkg import submodule`
                yield node.lineno, f"{target}.{alias.name}", False
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, True


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def check(root: Path) -> list[Violation]:
    out: list[Violation] = []
    for module, path in modules(package_dirs(root)):
        backend = _within(module, "kvsdk.backends")
        adapter = next((e for e in ENGINES if _within(module, f"kvsdk.plugins.{e}")), None)
        core = not backend and not _within(module, "kvsdk.plugins")
        for line, name, by_string in imported_names(module, path):
            engine = next((e for e in ENGINES if _within(name, e)), None)
            if core and engine:
                out.append(Violation(module, line, name, "the core imports no engine"))
            elif core and _within(name, "kvsdk.plugins"):
                out.append(Violation(module, line, name, "the core imports no adapter"))
            elif (
                core
                and _within(name, "kvsdk.backends")
                and not (module == "kvsdk.plugins_manager" and by_string)
            ):
                out.append(
                    Violation(
                        module, line, name,
                        "the core imports no backend (built-ins arrive through the plugin manager)",
                    )
                )  # fmt: skip
            elif backend and (engine or _within(name, "kvsdk.plugins")):
                out.append(Violation(module, line, name, "backends import no engine or adapter"))
            elif adapter and (
                (engine and engine != adapter)
                or any(_within(name, f"kvsdk.plugins.{e}") for e in ENGINES if e != adapter)
            ):
                out.append(Violation(module, line, name, "the adapters never import each other"))
    return out


def test_the_tree_keeps_the_import_rules() -> None:
    violations = check(ROOT)
    assert not violations, "import rules broken:\n" + "\n".join(f"  {v}" for v in violations)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "kvsdk"\n')
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_each_rule_catches_its_violation(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "kvsdk/__init__.py": "",
            "kvsdk/cli.py": "def main():\n    from kvsdk.plugins.vllm import demo\n",
            "kvsdk/store.py": "from .backends import disk\nimport vllm.config\n",
            "kvsdk/plugins_manager.py": (
                "import importlib\nimportlib.import_module('kvsdk.backends.disk')\n"
                "from kvsdk.backends import cpu\n"
            ),
            "kvsdk/lazy.py": "import importlib\nimportlib.import_module('kvsdk.plugins.sglang')\n",
            "kvsdk/backends/__init__.py": "",
            "kvsdk/backends/disk.py": "from kvsdk.plugins.vllm.layout import x\n",
            "kvsdk/plugins/__init__.py": "",
            "kvsdk/plugins/vllm/__init__.py": "from ..sglang import storage\n",
            "kvsdk/plugins/sglang/__init__.py": "def f():\n    import vllm\n",
            "kvsdk/plugins/sglang/storage.py": "from kvsdk.backends import disk\nimport sglang\n",
        },
    )
    found = {(v.module, v.imported) for v in check(root)}
    assert found == {
        ("kvsdk.cli", "kvsdk.plugins.vllm"),
        ("kvsdk.cli", "kvsdk.plugins.vllm.demo"),
        ("kvsdk.store", "kvsdk.backends"),
        ("kvsdk.store", "kvsdk.backends.disk"),
        ("kvsdk.store", "vllm.config"),
        ("kvsdk.plugins_manager", "kvsdk.backends"),  # a plain import, not a name
        ("kvsdk.plugins_manager", "kvsdk.backends.cpu"),
        ("kvsdk.lazy", "kvsdk.plugins.sglang"),
        ("kvsdk.backends.disk", "kvsdk.plugins.vllm.layout"),
        ("kvsdk.backends.disk", "kvsdk.plugins.vllm.layout.x"),
        ("kvsdk.plugins.vllm", "kvsdk.plugins.sglang"),
        ("kvsdk.plugins.vllm", "kvsdk.plugins.sglang.storage"),
        ("kvsdk.plugins.sglang", "vllm"),
    }
