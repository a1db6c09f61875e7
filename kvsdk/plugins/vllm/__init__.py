"""kvsdk for vLLM: the ``KVSDKConnector`` KV connector.

Turn it on with::

    --kv-transfer-config '{"kv_connector":"KVSDKConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"config":"kvsdk.yaml"}}'

(the name is registered through vLLM's ``vllm.general_plugins`` entry point),
or with ``"kv_connector_module_path":"kvsdk.plugins.vllm"``.
"""

from __future__ import annotations

import contextlib
from typing import Any

CONNECTOR_NAME = "KVSDKConnector"


def register() -> None:
    """vLLM general-plugin entry point: register ``KVSDKConnector`` by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvsdk.plugins.vllm.connector", "KVSDKConnector"
        )


def __getattr__(name: str) -> Any:
    # ``kv_connector_module_path="kvsdk.plugins.vllm"`` looks the class up here;
    # importing it lazily keeps ``import kvsdk.plugins.vllm`` free of vLLM.
    if name in ("KVSDKConnector", "KVSDKConnectorMetadata", "KVSDKWorkerMetadata"):
        from kvsdk.plugins.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
