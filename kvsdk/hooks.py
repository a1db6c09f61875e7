"""Every hook a kvsdk plugin can implement. This module is the plugin author's contract.

A plugin is a module (or object) with functions decorated ``@hookimpl`` and
named like the specs below. Third-party plugins are found through the
entry-point group ``kvsdk``::

    [project.entry-points.kvsdk]
    mystore = "mystore.kvsdk_plugin"

kvsdk's own backends, policies and transfer workers register through these
same hooks (see ``kvsdk.plugins_manager.DEFAULT_PLUGINS``); the core has no
special path for them. The engine adapters add their CLI commands through
``kvsdk_register_commands`` from this same entry-point group. Set ``KVSDK_TRACE_HOOKS=1`` to log every hook call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvsdk.commands import CommandRegistry
    from kvsdk.events import KVEvent

PROJECT = "kvsdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvsdk_backends() -> Mapping[str, type[Any]]:  # type: ignore[empty-body]
    """Storage backends this plugin provides: ``{name: BackendClass}``.

    The name is what users write as ``backend:`` in a ``tiers:`` entry. The
    class subclasses :class:`kvsdk.backend.Backend`, declares its options as a
    frozen dataclass in ``Options`` (validated from YAML) and is built as
    ``cls(options, context)`` with a :class:`kvsdk.backend.TierContext`.
    """


@hookspec
def kvsdk_eviction_policies() -> Mapping[str, Callable[..., Any]]:  # type: ignore[empty-body]
    """Eviction policies: ``{name: factory}``; ``factory(capacity=entries)``
    returns a :class:`kvsdk.eviction.EvictionPolicy`."""


@hookspec
def kvsdk_transfer_workers() -> Mapping[str, Callable[..., Any]]:  # type: ignore[empty-body]
    """Transfer workers: ``{name: factory}``; the factory returns a
    :class:`kvsdk.transfer.TransferWorker` moving blocks between an engine's
    KV tensors and host-tier slots (``transfer:`` in the config)."""


@hookspec
def kvsdk_publish_events(events: Sequence[KVEvent]) -> None:
    """Event sink: receives every batch of stored / removed / cleared events
    as the core drains them. Must not block; raise nothing (errors are logged
    and the sink is kept)."""


@hookspec
def kvsdk_startup(config: Any) -> None:
    """Lifecycle: a kvsdk engine context started with this (validated) config."""


@hookspec
def kvsdk_shutdown() -> None:
    """Lifecycle: the engine context is shutting down; flush and release resources."""


@hookspec
def kvsdk_register_commands(commands: CommandRegistry) -> None:
    """CLI: add ``kvsdk`` subcommands, ``kvsdk bench`` benchmarks and
    ``kvsdk config check --engine`` engines to ``commands`` (a
    :class:`kvsdk.commands.CommandRegistry`). Called once per ``kvsdk``
    invocation, ``--help`` included: import engines inside the command's
    ``run``, not at module level."""
