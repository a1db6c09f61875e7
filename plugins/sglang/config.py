"""kvsdk's config for SGLang's HiCache storage level (importable without SGLang).

SGLang keeps its own host-memory pool, which is the host tier; kvsdk is the
storage level below it. A config lists the storage tiers alone
(``tiers: [{backend: disk, ...}]``) or after a ``cpu`` tier, which is then
skipped, so one file can serve a vLLM and an SGLang deployment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvsdk import plugins_manager
from kvsdk.backend import HostTier
from kvsdk.config import ConfigError, KVSDKConfig, TierConfig, load_config

CONFIG_ENV = "KVSDK_CONFIG"
"""The environment variable naming kvsdk's config when SGLang passes none."""


def config_source(extra_config: Mapping[str, Any] | None, kwargs: Mapping[str, Any] | None) -> Any:
    """kvsdk's config as SGLang passes it: ``config`` of the storage extra config,
    else of the backend's kwargs, else ``$KVSDK_CONFIG``."""
    source = dict(extra_config or {}).get("config")
    if source is None:
        source = (kwargs or {}).get("config", os.environ.get(CONFIG_ENV))
    if source is None:
        raise ConfigError(
            "config: missing; pass kvsdk's config in the storage extra config "
            '(--hicache-storage-backend-extra-config \'{..., "config": "kvsdk.yaml"}\') '
            f"or set {CONFIG_ENV}"
        )
    return source


def load_storage_config(source: Any) -> tuple[KVSDKConfig, tuple[TierConfig, ...]]:
    """``(config, storage_tiers)`` from a YAML path, YAML text or a mapping."""
    if isinstance(source, str) and "\n" not in source and Path(source).is_file():
        source = Path(source)
    config = load_config(source, require_host_tier=False)
    backends = plugins_manager.backends()
    start = 1 if issubclass(backends[config.tiers[0].backend], HostTier) else 0
    lower = config.tiers[start:]
    if not lower:
        raise ConfigError(
            "tiers: SGLang keeps its own host-memory tier (--hicache-ratio / --hicache-size), "
            "so kvsdk's config for SGLang needs at least one storage tier below it, "
            "e.g. tiers: [{backend: disk, path: /var/cache/kvsdk}] or a redis tier"
        )
    for i, tier in enumerate(lower, start=start):
        if issubclass(backends[tier.backend], HostTier):
            raise ConfigError(
                f"tiers[{i}].backend: got {tier.backend!r}; SGLang's host pool is the "
                "host-memory tier, the storage level takes disk or remote tiers only"
            )
    return config, lower
