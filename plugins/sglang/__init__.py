"""kvsdk for SGLang: ``KVSDKStorage``, a HiCache storage backend (the L3 level).

Turn it on with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"kvsdk",
        "module_path":"kvsdk.plugins.sglang","class_name":"KVSDKStorage",
        "interface_v1":1,"config":"kvsdk.yaml"}'

``config`` is a YAML path or an inline mapping of kvsdk's config schema; its
tiers below host memory (``disk``, ``redis``, third-party) become the storage
level. SGLang's own host pool is the host tier, so a leading ``cpu`` tier is
skipped. Importing this package does not import SGLang; the class is loaded on
first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVSDKStorage"]


def __getattr__(name: str) -> Any:
    # The dynamic backend factory does importlib.import_module(module_path)
    # and getattr(module, class_name): resolve the class lazily here.
    if name == "KVSDKStorage":
        from kvsdk.plugins.sglang.storage import KVSDKStorage

        return KVSDKStorage
    raise AttributeError(name)
