"""The plugin manager: built-ins first, then every entry point in group ``kvsdk``."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import pluggy

from kvsdk import hooks

if TYPE_CHECKING:
    from kvsdk.commands import CommandRegistry

log = logging.getLogger(__name__)

DEFAULT_PLUGINS: tuple[str, ...] = (
    "kvsdk.eviction",
    "kvsdk.backends.cpu",
    "kvsdk.backends.disk",
    "kvsdk.backends.faulty",
    "kvsdk.backends.mooncake",  # imports the Mooncake client only when a tier is built
    "kvsdk.transfer.cpu",
    "kvsdk.transfer.cuda",
)
"""kvsdk's own plugins; registered exactly like third-party ones."""

OPTIONAL_DEFAULT_PLUGINS: tuple[str, ...] = ("kvsdk.backends.redis",)
"""Built-ins whose dependencies are extras; skipped when the extra is absent."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "builtin" or the distribution that provides it
    hooks: tuple[str, ...]


def _build() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    for modname in OPTIONAL_DEFAULT_PLUGINS:
        try:
            module = importlib.import_module(modname)
        except ImportError as exc:
            log.debug("built-in plugin %s unavailable: %s", modname, exc)
            continue
        pm.register(module, name=modname)
    pm.load_setuptools_entrypoints(hooks.PROJECT)
    if os.environ.get("KVSDK_TRACE_HOOKS"):
        pm.trace.root.setwriter(lambda msg: log.info("hook: %s", msg.rstrip()))
        pm.enable_tracing()
    return pm


@lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    return _build()


def _merged(results: list[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    # pluggy calls the last registered first; reverse so later plugins override built-ins.
    for mapping in reversed(results):
        merged.update(mapping or {})
    return merged


def backends() -> dict[str, type[Any]]:
    return _merged(plugin_manager().hook.kvsdk_backends())


def eviction_policies() -> dict[str, Callable[..., Any]]:
    return _merged(plugin_manager().hook.kvsdk_eviction_policies())


def transfer_workers() -> dict[str, Callable[..., Any]]:
    return _merged(plugin_manager().hook.kvsdk_transfer_workers())


def register_commands(commands: CommandRegistry) -> None:
    """Let every plugin add its CLI commands (the engine adapters' ``demo``, ``bench serve``...)."""
    plugin_manager().hook.kvsdk_register_commands(commands=commands)


def list_plugins() -> list[PluginInfo]:
    pm = plugin_manager()
    dists = {id(plugin): dist.project_name for plugin, dist in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        impls = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        out.append(PluginInfo(name=name, source=dists.get(id(plugin), "builtin"), hooks=impls))
    return out
