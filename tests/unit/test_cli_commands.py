"""The ``kvsdk`` CLI: the core builds its own commands and takes every other one
from plugins through ``kvsdk_register_commands``; building it imports no engine
(the source-level rule is ``test_import_contract.py``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsdk import cli, plugins_manager
from kvsdk.commands import CommandRegistry
from kvsdk.hooks import hookimpl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", *args], capture_output=True, text=True, timeout=120
    )


class EchoCommands:
    """A third-party plugin adding ``kvsdk echo`` and ``kvsdk bench echo``."""

    @hookimpl
    def kvsdk_register_commands(self, commands: CommandRegistry) -> None:
        top = commands.command("echo", help="print the word", run=self._echo)
        top.add_argument("word")
        commands.bench("echo", help="print the word, as a bench", run=self._echo).add_argument(
            "word"
        )

    @staticmethod
    def _echo(args: argparse.Namespace) -> int:
        print(args.word)
        return 7


@pytest.fixture
def echo_plugin() -> Iterator[None]:
    pm = plugins_manager.plugin_manager()
    plugin = EchoCommands()
    pm.register(plugin, name="kvsdk-test-echo")
    try:
        yield
    finally:
        pm.unregister(plugin)


def test_a_plugin_adds_top_level_and_bench_commands_through_the_hook(
    echo_plugin: None, capsys: Any
) -> None:
    assert cli.main(["echo", "hello"]) == 7
    assert cli.main(["bench", "echo", "there"]) == 7
    assert capsys.readouterr().out.split() == ["hello", "there"]


def test_a_command_registered_twice_is_refused(echo_plugin: None) -> None:
    class Again(EchoCommands):
        pass

    pm = plugins_manager.plugin_manager()
    again = Again()
    pm.register(again, name="kvsdk-test-echo-again")
    try:
        with pytest.raises(ValueError, match="'echo' is registered twice"):
            cli.build_parser()
    finally:
        pm.unregister(again)


def test_help_lists_the_adapters_commands() -> None:
    top = _run("--help")
    assert top.returncode == 0, top.stderr
    assert "demo" in top.stdout
    bench = _run("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    for name in ("core", "serve", "faults"):
        assert name in bench.stdout
    check = _run("config", "check", "--help")
    assert "{sglang,vllm}" in check.stdout


def test_building_the_cli_imports_no_engine_and_no_workload() -> None:
    code = (
        "import sys, kvsdk.cli\n"
        "kvsdk.cli.build_parser()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')"
        " or m.startswith('kvsdk.plugins.vllm.workloads')]\n"
        "print(sorted(bad))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_config_check_engine_sglang_takes_a_storage_only_config() -> None:
    res = _run(
        "config", "check", "--engine", "sglang", str(EXAMPLES / "sglang" / "kvsdk-disk.yaml")
    )
    assert res.returncode == 0, res.stderr
    assert "OK (tiers: disk;" in res.stdout
    core = _run("config", "check", str(EXAMPLES / "sglang" / "kvsdk-disk.yaml"))
    assert core.returncode == 2  # kvsdk's own schema wants a host tier first


def test_vllm_commands_say_vllm_is_needed_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from kvsdk.plugins.vllm import commands

    monkeypatch.setattr(commands, "_have_vllm", lambda: False)
    assert cli.main(["demo", "--no-progress"]) == 2
    assert cli.main(["bench", "serve"]) == 2
    err = capsys.readouterr().err
    assert "kvsdk demo needs vLLM" in err and "kvsdk bench serve needs vLLM" in err
