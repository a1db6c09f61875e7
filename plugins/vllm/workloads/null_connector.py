"""A KV connector that moves nothing: what vLLM's connector machinery costs
on its own, as a baseline for ``kvsdk bench serve`` (``--configs null``).

With any connector configured, vLLM runs hooks of its own around every step
(connector metadata built and sent to the workers, per-layer hooks in the
attention layers, a connector output gathered from every worker) and its
scheduler asks the connector about every waiting request. This connector
answers every hook with "nothing": no request has tokens in it, nothing is
loaded or saved, so an engine with it computes exactly what an engine
without a connector does. A configuration's cost over ``null`` is then its own
share; ``null``'s over ``none`` is vLLM's.

Turn it on with::

    kv_transfer_config={
        "kv_connector": "NullConnector",
        "kv_connector_module_path": "kvsdk.plugins.vllm.workloads.null_connector",
        "kv_role": "kv_both",
    }
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    # -- scheduler side: no request has tokens here, nothing to do after allocation --
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    # -- worker side: nothing to load or save --------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
