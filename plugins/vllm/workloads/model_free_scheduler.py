"""vLLM's real ``Scheduler`` with ``KVSDKConnector``, built without a model:
a local ``config.json`` (no weights), one full-attention KV group, float32 on
the CPU device. Tests and ``benchmarks/profile_scheduler_hooks.py`` step it by
hand, playing the model runner."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

import kvsdk.plugins.vllm


def write_llama_config(path: str, **config: Any) -> str:
    """A Llama ``config.json`` at ``path`` (no weights, no tokenizer)."""
    LlamaConfig(**config).save_pretrained(path)
    return path


def model_free_scheduler(
    model_dir: str,
    *,
    engine_id: str,
    kvsdk_config: dict[str, Any],
    block_size: int,
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    eagle: bool = False,
    native_bytes: int | None = None,
    kv_role: str = "kv_both",
) -> Scheduler:
    """The scheduler for the model at ``model_dir`` (a config only), its KV in
    ``num_blocks`` blocks of one full-attention group (``eagle``: vLLM marks the
    group as holding an EAGLE/MTP drafter's layers), kvsdk configured by
    ``kvsdk_config``; with ``native_bytes``, vLLM's native
    ``OffloadingConnector`` instead (the CPU spec kvsdk ships for it, a host
    tier of that many bytes). ``kv_role``: vLLM's (kvsdk's P/D roles)."""
    kvsdk.plugins.vllm.register()
    transfer = KVTransferConfig(
        kv_connector="KVSDKConnector",
        kv_role=kv_role,  # type: ignore[arg-type]
        engine_id=engine_id,
        kv_connector_extra_config={"config": kvsdk_config},
    )
    if native_bytes is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={
                "spec_name": "TorchCPUOffloadingSpec",
                "spec_module_path": "kvsdk.plugins.vllm.workloads.native_offload",
                "cpu_bytes_to_use": native_bytes,
            },
        )
    init_none_hash(sha256)
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec, is_eagle_group=eagle)],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )
