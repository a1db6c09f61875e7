"""Bytes of one kvsdk chunk for a local model, as the vLLM adapter computes them
at start-up, for ``kvsdk config check --engine vllm --model DIR``.

No weights are loaded and no engine starts: vLLM's own config classes read
the model directory's ``config.json`` (vLLM's dtype resolution), vLLM's
platform picks the block size it will run when none is given (128 on
vLLM-CPU, 16 on most GPU backends; see :func:`_engine_block_size`), vLLM's
``FullAttentionSpec`` gives the bytes of one block of one layer, and :func:`~kvsdk.plugins.vllm.layout.engine_layout`, the function
the connector runs, turns the KV groups into the chunk: the same code, not a
second formula. Models whose KV groups need the model itself to be built
(sliding window, MLA, Mamba or other hybrid layers) are not computed here;
the engine checks them when it starts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk.config import ConfigError
from kvsdk.plugins.vllm import CONNECTOR_NAME, register
from kvsdk.plugins.vllm.layout import EngineLayout, engine_layout


@dataclass(frozen=True)
class ModelChunk:
    """One chunk of a model, as the adapter would lay it out."""

    chunk_bytes: int
    tokens: int
    """Tokens per chunk (``chunk_tokens``, or the engine's block size)."""
    block_size: int
    layers: int
    dtype: str


def model_chunk(
    config_file: Path, model: Path, *, block_size: int | None = None, dtype: str = "auto"
) -> ModelChunk:
    """The chunk the vLLM adapter would use for ``model`` with the kvsdk config at
    ``config_file`` (TP=1, PP=1: with tensor parallelism each rank holds its
    share of one chunk of the same size). Raises :class:`ConfigError` when
    ``model`` is not a local model directory vLLM can read, or its chunk
    cannot be computed without building the model."""
    with _vllm_quiet():
        layout = _layout(config_file, model, block_size, dtype)
    group = layout.groups[0]
    return ModelChunk(
        chunk_bytes=layout.chunk_bytes,
        tokens=group.tokens_per_chunk,
        block_size=group.tokens_per_block,
        layers=sum(len(names) for names in layout.group_layers),
        dtype=layout.namespace.dtype.removeprefix("torch."),
    )


@contextlib.contextmanager
def _vllm_quiet() -> Iterator[None]:
    """vLLM's INFO/WARNING lines about its platform are noise in a config check."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _layout(config_file: Path, model: Path, block_size: int | None, dtype: str) -> EngineLayout:
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"--model: got {str(model)!r}; expected a local model directory with a config.json"
        )
    vllm_config = _vllm_config(config_file, model, block_size, dtype)
    return engine_layout(vllm_config, _kv_cache_config(vllm_config, model))


def _vllm_config(config_file: Path, model: Path, block_size: int | None, dtype: str) -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    register()  # what vLLM's plugin loader does: the connector by name, its config check
    try:
        model_config = ModelConfig(
            model=str(model),
            skip_tokenizer_init=True,
            dtype=dtype,  # type: ignore[arg-type]  # (vLLM validates it)
        )
        cache_config = CacheConfig() if block_size is None else CacheConfig(block_size=block_size)
        transfer = KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_role="kv_both",
            kv_connector_extra_config={"config": str(config_file)},
        )
        return VllmConfig(
            model_config=model_config, cache_config=cache_config, kv_transfer_config=transfer
        )
    except Exception as exc:  # vLLM's own validation (pydantic, ValueError): one line
        raise ConfigError(f"--model: vLLM cannot read {str(model)!r}: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    """The first problem of a vLLM config error (pydantic lists each on several lines)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _kv_cache_config(vllm_config: Any, model: Path) -> Any:
    """The scheduler's KV cache config for a model of plain full-attention layers:
    one group, one ``FullAttentionSpec`` (what vLLM's attention layer reports)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    kinds = {
        "MLA": model_config.use_mla,
        "state-space or other hybrid": model_config.is_hybrid or model_config.has_inner_state,
        "attention-free": model_config.is_attention_free,
        "encoder-decoder": model_config.is_encoder_decoder,
        "sliding-window": model_config.get_sliding_window() is not None
        or any(
            t != "full_attention"
            for t in getattr(model_config.hf_text_config, "layer_types", None) or ()
        ),
    }
    unsupported = [kind for kind, present in kinds.items() if present]
    if unsupported:
        raise ConfigError(
            f"--model: {str(model)!r} has {unsupported[0]} layers; config check computes the "
            "chunk of full-attention models only (the engine checks this one when it starts)"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ConfigError(f"--model: cache dtype {cache_dtype!r}: only 'auto' is computed here")
    _engine_block_size(vllm_config)
    spec = FullAttentionSpec(
        block_size=int(vllm_config.cache_config.block_size),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    layers = [
        f"model.layers.{i}.self_attn.attn" for i in range(model_config.get_num_layers(parallel))
    ]
    return KVCacheConfig(
        num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def _engine_block_size(vllm_config: Any) -> None:
    """Set ``vllm_config.cache_config.block_size`` to the block size the engine
    will run, as its executor does when it starts.

    vLLM's executor calls ``current_platform.update_block_size_for_backend``
    once the model's attention layers exist; that rule (which, on vLLM-CPU
    0.33, is where the 128-token default is chosen: ``VllmConfig`` alone
    still says 16) asks the layers which attention backend they use. No
    layer is built here, so the rule runs on a subclass of the platform whose
    only change is that answer: the backend vLLM's own selector
    (``get_attn_backend``) gives a full-attention layer of this model, which
    is what every layer of the models computed here would report. A block
    size the user gave (``--block-size``) is kept, as the engine keeps it."""
    # importing a backend makes torch say once that Triton is missing (no GPU):
    # true and harmless here, and not what the user asked the check about
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    model_config = vllm_config.model_config
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                model_config.get_head_size(),
                model_config.dtype,
                vllm_config.cache_config.cache_dtype,
                num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
            )

        def find_backends(cls: Any, config: Any) -> list[Any]:
            return [backend]

        platform: Any = type(
            "ModelLayersPlatform",
            (type(current_platform),),
            {"_find_non_ssm_backends": classmethod(find_backends)},
        )
        platform.update_block_size_for_backend(vllm_config)
    except (ValueError, RuntimeError) as exc:  # no backend, or it refuses the size given
        raise ConfigError(
            f"--model: vLLM's attention backend for {str(model_config.model)!r} on this "
            f"platform: {_one_line(exc)}"
        ) from None
