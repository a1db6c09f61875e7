"""The SGLang adapter's ``kvsdk`` command: ``kvsdk config check --engine sglang FILE``.

Registered through the ``kvsdk`` entry-point group; imports no SGLang.
"""

from __future__ import annotations

from pathlib import Path

from kvsdk.commands import CommandRegistry
from kvsdk.config import KVSDKConfig
from kvsdk.hooks import hookimpl
from kvsdk.plugins.sglang.config import load_storage_config


def _load_sglang_config(path: Path) -> KVSDKConfig:
    config: KVSDKConfig = load_storage_config(path)[0]
    return config


@hookimpl
def kvsdk_register_commands(commands: CommandRegistry) -> None:
    commands.config_engine(
        "sglang",
        help="the tiers are HiCache's storage level (SGLang keeps the host tier)",
        load=_load_sglang_config,
    )
