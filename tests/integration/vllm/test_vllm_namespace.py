"""What kvsdk makes of a vLLM engine's configuration, on vLLM's own config
classes (a config.json only: no model is loaded): each input that changes what
KV bytes mean changes the namespace (change one, share nothing); a prefix hash
that is not collision resistant is refused with a shared tier; KV groups kvsdk
cannot serve yet are refused at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)

from kvsdk.config import ConfigError, load_config
from kvsdk.plugins.vllm.layout import (
    check_prefix_hash,
    engine_layout,
    meaning_of_kv,
    model_identity,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "tiny-llama-config"
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def config(
    model: str,
    *,
    hf_overrides: dict[str, Any] | None = None,
    dtype: str = "float32",
    quantization: str | None = None,
    **cache: Any,
) -> VllmConfig:
    model_config = ModelConfig(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=1024,
        **({"hf_overrides": hf_overrides} if hf_overrides else {}),
        **({"quantization": quantization} if quantization else {}),
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=32, **cache),
        device_config=DeviceConfig("cpu"),
    )


def test_each_input_that_changes_the_meaning_of_kv_changes_the_namespace(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = dict(meaning_of_kv(config(model_dir)))
    assert base == dict(meaning_of_kv(config(model_dir)))  # deterministic
    variants = {
        "hf_config": meaning_of_kv(config(model_dir, hf_overrides={"rope_theta": 5e5})),
        "prefix_hash": meaning_of_kv(config(model_dir, prefix_caching_hash_algo="sha256_cbor")),
    }
    variants["kv_cache_dtype"] = meaning_of_kv(config(model_dir, cache_dtype="fp8"))
    with_backend = config(model_dir)
    with_backend.attention_config.backend = "FLEX_ATTENTION"  # as --attention-backend sets it
    variants["attention_backend"] = meaning_of_kv(with_backend)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    variants["kv_cache_layout"] = meaning_of_kv(config(model_dir))
    for field, meaning in variants.items():
        changed = {k for k, v in dict(meaning).items() if v != base[k]}
        assert changed == {field}, (field, changed)


def test_same_weights_at_two_paths_share_a_namespace_and_other_weights_at_one_path_never(
    model_dir: str, tmp_path: Path
) -> None:
    """Two machines holding one model at different paths share its chunks: the
    model's identity is its weights' fingerprint and the config as run, never
    the path (``config.json`` as vLLM reads it names its own path). Other
    weights written where the first ones were share nothing."""
    import shutil

    from safetensors.torch import save_file

    here, there = tmp_path / "here" / "m", tmp_path / "elsewhere" / "same-model"
    shutil.copytree(model_dir, here)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(here / "model.safetensors"))
    shutil.copytree(here, there)
    assert model_identity(str(here)) == model_identity(str(there))
    assert model_identity(str(here)).startswith("weights:")
    assert meaning_of_kv(config(str(here))) == meaning_of_kv(config(str(there)))

    new_weights = {"w": torch.arange(64, dtype=torch.float32).flip(0)}  # a fine-tune
    save_file(new_weights, str(there / "model.safetensors"))
    assert model_identity(str(here)) != model_identity(str(there))
    assert model_identity(str(there), model_id="my-model-v2") == "my-model-v2"


def test_quantization_changes_exactly_the_quantization_field(model_dir: str) -> None:
    """vLLM's online quantization methods, as ``--quantization`` sets them, on
    the CPU platform: VllmConfig runs vLLM's own checks and builds the
    quantization config (``fp8_per_tensor`` and ``int8_per_channel_weight_only``
    take bfloat16 or float16 activations only, so this test runs the model in
    bfloat16 with and without them). Each method changes the quantization
    field and nothing else, and two methods are two namespaces."""
    with pytest.raises(ValueError, match=r"float32 is not supported for quantization"):
        config(model_dir, quantization="fp8_per_tensor")  # why bfloat16 below
    base = dict(meaning_of_kv(config(model_dir, dtype="bfloat16")))
    seen = {base["quantization"]}
    for method in ("fp8_per_tensor", "int8_per_channel_weight_only"):
        quantized = config(model_dir, dtype="bfloat16", quantization=method)
        assert quantized.quant_config is not None  # vLLM accepted it and built its config
        meaning = dict(meaning_of_kv(quantized))
        changed = {k for k, v in meaning.items() if v != base[k]}
        assert changed == {"quantization"}, (method, changed)
        seen.add(meaning["quantization"])
    assert len(seen) == 3


def test_a_prefix_hash_that_is_not_collision_resistant_is_refused_with_a_shared_tier(
    tmp_path: Path,
) -> None:
    shared = load_config(
        {"tiers": [{"backend": "cpu"}, {"backend": "disk", "path": str(tmp_path)}]}
    )
    alone = load_config({"tiers": [{"backend": "cpu"}]})
    for algorithm in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ConfigError, match=r"prefix_caching_hash_algo: got .*\['disk'\]"):
            check_prefix_hash(algorithm, shared)
        check_prefix_hash(algorithm, alone)  # one process's own host tier: no one to collide with
    for algorithm in ("sha256", "sha256_cbor"):
        check_prefix_hash(algorithm, shared)


def test_a_kv_cache_spec_kvsdk_has_not_tested_is_refused_at_start_with_one_sentence(
    model_dir: str,
) -> None:
    """Subclasses of the specs kvsdk serves change which blocks hold what (R-SWA
    evicts the decode gap, sinks keep extra tokens): refused, never guessed."""
    vllm_config = config(model_dir)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="KVSDKConnector", kv_role="kv_both"
    )
    shape = {"block_size": 32, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    for spec in (
        RSWASpec(rswa_window=64, **shape),
        SinkFullAttentionSpec(sink_len=4, **shape),
        ChunkedLocalAttentionSpec(attention_chunk_size=64, **shape),
    ):
        kv_cache_config = KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        name = type(spec).__name__
        with pytest.raises(ConfigError, match=rf"^KV group 0: {name} is not supported by kvsdk"):
            engine_layout(vllm_config, kv_cache_config)
    plain = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**shape))
        ],
    )
    assert [g.kind.value for g in engine_layout(vllm_config, plain).groups] == ["full_attention"]


def hybrid_cache_config(mamba: MambaSpec) -> KVCacheConfig:
    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention),
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
        ],
    )


def test_mamba_states_kvsdk_cannot_place_are_refused_at_start_with_one_sentence(
    model_dir: str,
) -> None:
    """Outside vLLM's 'align' mode (prefix caching off) a request has one running
    state, no state per block boundary to store or resume from: never served."""
    vllm_config = config(model_dir)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="KVSDKConnector", kv_role="kv_both"
    )
    states = {"shapes": ((3, 64), (4, 16, 16)), "dtypes": (torch.float32,) * 2}
    with pytest.raises(ConfigError, match=r"KV group 1: state-space \(Mamba\) layers with "
                       r"mamba_cache_mode='none' are not supported"):  # fmt: skip
        engine_layout(vllm_config, hybrid_cache_config(MambaSpec(block_size=32, **states)))
    spec = MambaSpec(block_size=32, mamba_cache_mode="align", num_speculative_blocks=1, **states)
    with pytest.raises(ConfigError, match=r"speculative decoding"):
        engine_layout(vllm_config, hybrid_cache_config(spec))
    # 'align' mode is served: the states' own bytes (not the padded page) per block
    spec = MambaSpec(block_size=32, mamba_cache_mode="align", page_size_padded=8192, **states)
    layout = engine_layout(vllm_config, hybrid_cache_config(spec))
    assert [g.kind.value for g in layout.groups] == ["full_attention", "mamba"]
    assert layout.namespace.groups[1].shape == (1, (3 * 64 + 4 * 16 * 16) * 4)
    assert "float32(3, 64)" in layout.namespace.groups[1].dtype
