"""kvsdk installed from its wheel, away from the checkout: every module is in the
wheel, the CLI finds the adapters' commands through the wheel's entry points,
and what ``kvsdk bench serve`` hands vLLM (the native-offload comparison spec)
resolves from the installed package, not from ``benchmarks/``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "kvsdk", "plugins", "backends")
"""What the wheel is built from."""
PACKAGE_DIRS = {"kvsdk": "kvsdk", "plugins": "kvsdk/plugins", "backends": "kvsdk/backends"}
"""Each top-level folder and where its modules lie in the wheel (pyproject's package-dir)."""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path
    workdir: Path

    def python(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """This interpreter with only the installed wheel importable as kvsdk, run from
        a directory outside the checkout."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSDK_")}
        env["PYTHONPATH"] = str(self.site)
        return subprocess.run(
            [sys.executable, *args],
            cwd=self.workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a clean copy: no stale build/ or egg-info from the checkout
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("kvsdk-*.whl")
    site = tmp / "site"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    workdir = tmp / "elsewhere"
    workdir.mkdir()
    return Installed(wheel, site, workdir)


def test_the_wheel_holds_every_module_of_the_checkout(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    missing = [
        f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, target in PACKAGE_DIRS.items()
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
        and f"{target}/{path.relative_to(ROOT / folder).as_posix()}" not in names
    ]
    assert missing == [], "not in the wheel (a package missing from pyproject's packages?)"


def test_kvsdk_is_imported_from_the_install_not_the_checkout(installed: Installed) -> None:
    res = installed.python(
        "-c",
        "import json, kvsdk, kvsdk.plugins.vllm.commands as c; "
        "print(json.dumps([kvsdk.__file__, c.__file__]))",
    )
    assert res.returncode == 0, res.stderr
    for file in json.loads(res.stdout):
        assert Path(file).is_relative_to(installed.site), file


def test_the_cli_lists_the_adapters_commands_from_the_wheel(installed: Installed) -> None:
    top = installed.python("-m", "kvsdk.cli", "--help")
    assert top.returncode == 0, top.stderr
    assert "demo" in top.stdout
    bench = installed.python("-m", "kvsdk.cli", "bench", "--help")
    assert bench.returncode == 0, bench.stderr
    assert {"core", "serve", "faults"} <= set(
        bench.stdout.split("{", 1)[1].split("}")[0].split(",")
    )
    serve = installed.python("-m", "kvsdk.cli", "bench", "serve", "--help")
    assert serve.returncode == 0, serve.stderr
    assert "--reuse" in serve.stdout
    check = installed.python("-m", "kvsdk.cli", "config", "check", "--help")
    assert "{sglang,vllm}" in check.stdout


def test_the_console_script_runs_from_the_wheel(installed: Installed) -> None:
    script = installed.site / "bin" / "kvsdk"
    assert script.exists()
    res = installed.python(str(script), "bench", "serve", "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: kvsdk bench serve" in res.stdout


def test_importing_the_workloads_leaves_the_environment_alone(installed: Installed) -> None:
    res = installed.python(
        "-c",
        "import os; before = dict(os.environ)\n"
        "import kvsdk.plugins.vllm.workloads.demo, kvsdk.plugins.vllm.workloads.soak\n"
        "import kvsdk.plugins.vllm.workloads.bench_serve\n"
        "print(sorted(set(os.environ.items()) ^ set(before.items())))",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_bench_serves_native_offload_spec_resolves_from_the_wheel(installed: Installed) -> None:
    """The spec module ``kvsdk bench serve`` names in the native engine's config, resolved
    as vLLM resolves it (``OffloadingSpecFactory``) when vLLM is installed."""
    find = (
        "import importlib.util, json\n"
        "from kvsdk.plugins.vllm.workloads import bench_serve\n"
        "spec = importlib.util.find_spec(bench_serve.NATIVE_SPEC_MODULE)\n"
        "print(json.dumps(spec.origin if spec else None))\n"
    )
    res = installed.python("-c", find)
    assert res.returncode == 0, res.stderr
    origin = json.loads(res.stdout)
    assert origin is not None and Path(origin).is_relative_to(installed.site), origin
    if importlib.util.find_spec("vllm") is None:
        return  # the module is there; loading it needs vLLM
    load = (
        "import json, sys\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory\n"
        "from kvsdk.plugins.vllm.workloads import bench_serve\n"
        "cls = OffloadingSpecFactory.get_spec_cls({'spec_name': 'TorchCPUOffloadingSpec',"
        " 'spec_module_path': bench_serve.NATIVE_SPEC_MODULE})\n"
        "print(json.dumps([cls.__name__, sys.modules[cls.__module__].__file__]))\n"
    )
    res = installed.python("-c", load)
    assert res.returncode == 0, res.stderr
    name, file = json.loads(res.stdout.strip().splitlines()[-1])
    assert name == "TorchCPUOffloadingSpec"
    assert Path(file).is_relative_to(installed.site), file
