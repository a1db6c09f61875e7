"""Where plugins add ``kvsdk`` subcommands: the object the ``kvsdk_register_commands``
hook receives.

The core CLI (:mod:`kvsdk.cli`) builds its own commands (``config``,
``inspect``, ``plugins``, ``bench core``), then calls the hook once with a
:class:`CommandRegistry`. A plugin adds

- a top-level command (``kvsdk demo``) with :meth:`CommandRegistry.command`,
- a benchmark (``kvsdk bench serve``) with :meth:`CommandRegistry.bench`,
- an engine for ``kvsdk config check --engine NAME`` with
  :meth:`CommandRegistry.config_engine`: how that engine reads a config file,
  and (optionally) how it checks the config against a model's geometry for
  ``--model DIR`` (:class:`ModelArgs`), e.g. a host tier that holds no chunk.

``command`` and ``bench`` return the ``argparse`` parser for the plugin to add
its arguments to; ``run`` gets the parsed arguments and returns the exit code.
Keep the module that implements the hook free of heavy imports (an engine,
torch): ``kvsdk --help`` loads it; import what ``run`` needs inside ``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsdk.config import KVSDKConfig


@dataclass(frozen=True)
class ModelArgs:
    """``kvsdk config check --model DIR [--block-size N] [--dtype D]``."""

    model: Path
    """A local model directory (``config.json``)."""
    block_size: int | None
    """The engine's block size; None: what the engine picks when none is set."""
    dtype: str
    """The model dtype as the engine's flag takes it (``auto``: the engine resolves it)."""


RunCommand = Callable[[argparse.Namespace], int]
LoadConfig = Callable[[Path], "KVSDKConfig"]
CheckModel = Callable[[Path, "KVSDKConfig", ModelArgs], str]
"""``check(file, config, model)``: raise :class:`kvsdk.config.ConfigError` when the
engine would refuse ``config`` for that model, else return one line to print
(e.g. the bytes of one chunk)."""


@dataclass(frozen=True)
class ConfigEngine:
    """How ``kvsdk config check --engine NAME`` reads a config for one engine."""

    name: str
    help: str
    load: LoadConfig
    check_model: CheckModel | None = None


class CommandRegistry:
    """The top-level and ``bench`` subcommand tables, and the config-check engines."""

    def __init__(
        self,
        commands: argparse._SubParsersAction[argparse.ArgumentParser],
        benches: argparse._SubParsersAction[argparse.ArgumentParser],
    ) -> None:
        self._commands = commands
        self._benches = benches
        self.config_engines: dict[str, ConfigEngine] = {}

    def command(self, name: str, *, help: str, run: RunCommand) -> argparse.ArgumentParser:
        """Add ``kvsdk NAME``; returns its parser."""
        return self._add(self._commands, name, help, run)

    def bench(self, name: str, *, help: str, run: RunCommand) -> argparse.ArgumentParser:
        """Add ``kvsdk bench NAME``; returns its parser."""
        return self._add(self._benches, name, help, run)

    def config_engine(
        self, name: str, *, help: str, load: LoadConfig, check_model: CheckModel | None = None
    ) -> None:
        """Let ``kvsdk config check --engine NAME FILE`` validate with ``load(FILE)``,
        which raises :class:`kvsdk.config.ConfigError` on a bad config; with
        ``--model DIR`` also with ``check_model`` (see :data:`CheckModel`)."""
        if name in self.config_engines:
            raise ValueError(f"config engine {name!r} is registered twice")
        self.config_engines[name] = ConfigEngine(name, help, load, check_model)

    @staticmethod
    def _add(
        table: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        help: str,
        run: RunCommand,
    ) -> argparse.ArgumentParser:
        if name in table.choices:
            raise ValueError(f"kvsdk command {name!r} is registered twice")
        parser = table.add_parser(name, help=help, description=help)
        parser.set_defaults(func=run)
        return parser
