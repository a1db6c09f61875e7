"""What kvsdk needs to know about a vLLM engine: its KV groups, their bytes,
the namespace its chunks live in, and the config it was given."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsdk import plugins_manager
from kvsdk.config import ConfigError, KVSDKConfig, load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.plugins.vllm import engine_problem
from kvsdk.slab import segment_name
from kvsdk.trust import load_secret
from kvsdk.types import GroupKind, KVGroupSpec, Locality
from kvsdk.weights import hub_snapshot, weights_fingerprint

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler


@dataclass(frozen=True)
class EngineLayout:
    config: KVSDKConfig
    groups: tuple[KVGroupSpec, ...]
    group_layers: tuple[tuple[str, ...], ...]
    """Per kvsdk group, the vLLM layer names in it."""
    namespace: Namespace
    ranks: RankLayout
    chunk_bytes: int
    """Bytes of one host slot: every rank's region of one chunk."""
    tokens_per_hash: int
    slab_name: str
    """The shared-memory segment of this engine's host tier (see :mod:`kvsdk.slab`)."""


@dataclass(frozen=True)
class RankLayout:
    """Where each tensor/pipeline rank's part of a chunk lives in a host slot.

    Rank ``(pp, tp)`` owns region ``pp * tp_size + tp``. MLA models replicate
    their latent KV on every TP rank of a stage: one region per stage, stored
    by its TP rank 0 and loaded by all."""

    tp_size: int
    pp_size: int
    replicated_across_tp: bool
    region_bytes: int

    @property
    def num_regions(self) -> int:
        return self.pp_size if self.replicated_across_tp else self.tp_size * self.pp_size

    def region_index(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank if self.replicated_across_tp else pp_rank * self.tp_size + tp_rank

    def stores_from(self, tp_rank: int) -> bool:
        return not self.replicated_across_tp or tp_rank == 0


def load_engine_config(extra: dict[str, Any], *, announce: bool = False) -> KVSDKConfig:
    """``kv_connector_extra_config["config"]``: a YAML path, a YAML string or a
    mapping. ``announce``: log where it came from (the scheduler side does, once
    per engine; its workers do not repeat it)."""
    source = extra.get("config")
    unknown = set(extra) - {"config"}
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {sorted(unknown)}; expected only 'config' "
            "(a kvsdk YAML path or an inline mapping)"
        )
    if source is None:
        where = "built-in defaults (no kv_connector_extra_config.config)"
    elif isinstance(source, dict):
        where = "inline mapping in kv_connector_extra_config.config"
    else:
        where = f"file {source}"
    cfg = load_config(source)
    if announce:
        log.info(
            "kvsdk config from %s: tiers=%s chunk_tokens=%s",
            where,
            [t.backend for t in cfg.tiers],
            cfg.chunk_tokens or "the engine's block size",
        )
    return cfg


_PAGE = 4096


def model_identity(model: str, revision: str | None = None, model_id: str | None = None) -> str:
    """The model as the namespace names it: ``model_id`` when the config sets one,
    else what the weights are, not where they lie: every byte of every weight
    file (:func:`kvsdk.weights.weights_fingerprint`) of a local directory or of
    a hub id's local snapshot. Same weights at two paths (two machines) share
    chunks; other weights at one path never do. A hub id with no local snapshot
    is named ``<id>@rev=<revision or 'unpinned'>``."""
    if model_id:
        return model_id
    root = Path(model)
    if not root.is_dir():
        snapshot = hub_snapshot(model, revision)
        if snapshot is None:
            return f"{model}@rev={revision or 'unpinned'}"
        root = snapshot
    return f"weights:{weights_fingerprint(root)}"


COLLISION_RESISTANT_HASHES = frozenset({"sha256", "sha256_cbor"})
"""vLLM prefix-hash algorithms whose block hashes kvsdk may key shared tiers with."""


def check_prefix_hash(algorithm: str, cfg: KVSDKConfig) -> None:
    """Refuse an engine prefix hash that is not collision resistant (xxhash) when a
    tier is shared: chunk keys come from vLLM's block hashes, so two prompts whose
    hashes collide would load each other's KV across engines and restarts."""
    if algorithm in COLLISION_RESISTANT_HASHES:
        return
    backends = plugins_manager.backends()
    shared = [
        t.backend
        for t in cfg.tiers
        if t.backend in backends and backends[t.backend].locality is not Locality.PROCESS
    ]
    if shared:
        raise ConfigError(
            f"prefix_caching_hash_algo: got {algorithm!r} with shared tiers {shared}; expected "
            f"one of {sorted(COLLISION_RESISTANT_HASHES)} (xxhash is not collision resistant, "
            "so chunk keys built on it cannot be shared)"
        )


def _without_paths(value: Any) -> Any:
    """A config mapping without the keys that say where it was read from
    (``_name_or_path``, at any depth): the same config at two paths is one."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in _PATH_KEYS}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


_PATH_KEYS = frozenset({"_name_or_path", "_commit_hash"})


def _hf_config_digest(model_cfg: Any) -> str:
    """A digest of the model's configuration as vLLM runs it: ``config.json`` with
    ``hf_overrides`` applied (RoPE scaling and the like change what KV means),
    without where it was read from."""
    hf = getattr(model_cfg, "hf_config", None)
    try:
        as_run = json.loads(hf.to_json_string(use_diff=False)) if hf is not None else {}
        text = json.dumps(_without_paths(as_run), sort_keys=True, default=str)
    except Exception:  # (an unusual config class)
        text = repr(hf)
    overrides = getattr(model_cfg, "hf_overrides", None)
    if isinstance(overrides, dict):
        text += json.dumps(overrides, sort_keys=True, default=str)
    elif overrides is not None:
        text += getattr(overrides, "__qualname__", repr(overrides))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def meaning_of_kv(vllm_config: Any) -> tuple[tuple[str, str], ...]:
    """Everything beyond geometry and dtype that changes what KV bytes mean:
    platform and attention backend (the memory layout of a page), the KV
    cache dtype, quantization, the model config as run, the prefix-hash
    algorithm. Part of the namespace: change one, share nothing."""
    from vllm.platforms import current_platform

    model_cfg, cache_cfg = vllm_config.model_config, vllm_config.cache_config
    attn = getattr(vllm_config, "attention_config", None)
    per_kind = getattr(attn, "backend_per_kind", None) or {}
    return (
        ("platform", str(getattr(current_platform, "device_type", "unknown"))),
        ("attention_backend", str(getattr(attn, "backend", None) or "auto")),
        ("attention_backend_per_kind", json.dumps({str(k): str(v) for k, v in per_kind.items()},
                                                  sort_keys=True)),
        ("kv_cache_layout", os.environ.get("VLLM_KV_CACHE_LAYOUT", "default")),
        ("kv_cache_dtype", str(getattr(cache_cfg, "cache_dtype", "auto"))),
        ("quantization", str(getattr(model_cfg, "quantization", None))),
        ("hf_config", _hf_config_digest(model_cfg)),
        ("prefix_hash", str(getattr(cache_cfg, "prefix_caching_hash_algo", "sha256"))),
    )  # fmt: skip


def _page_bytes_and_dtype(spec: Any) -> tuple[int, str]:
    """Bytes kvsdk copies per block and layer, and what they hold. A state-space
    page is padded to the attention page; only its states (each state's shape
    and dtype, in order) are copied."""
    shapes = getattr(spec, "shapes", None)
    if shapes is None:
        return int(spec.page_size_bytes), str(spec.dtype)
    states = ",".join(f"{d}{tuple(s)}" for s, d in zip(shapes, spec.dtypes, strict=True))
    return int(spec.real_page_size_bytes), f"states[{states}]"


def group_kind(gi: int, spec: Any) -> tuple[GroupKind, int | None]:
    """The kvsdk group kind (and sliding window) of a vLLM KV cache spec. Exact
    types only: a subclass can change which blocks hold what (R-SWA evicts the
    decode gap, sinks keep extra tokens), so an untested one is refused."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind is SlidingWindowSpec:
        return GroupKind.SLIDING_WINDOW, int(spec.sliding_window)
    if kind is MambaSpec:
        return GroupKind.MAMBA, None
    if kind in (FullAttentionSpec, MLAAttentionSpec) and (
        getattr(spec, "sliding_window", None) is None
        and getattr(spec, "attention_chunk_size", None) is None
    ):
        return GroupKind.FULL_ATTENTION, None
    raise ConfigError(
        f"KV group {gi}: {kind.__name__} is not supported by kvsdk yet (full attention, "
        "MLA, sliding window and Mamba are); run this model without kvsdk"
    )


def check_mamba_group(gi: int, spec: Any, blocks_per_chunk: int) -> None:
    """Fail closed on state-space groups whose states kvsdk cannot place: only
    vLLM's ``align`` mode keeps one state per block boundary (the one a hit
    resumes from); other modes hold one running state per request."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise ConfigError(
            f"KV group {gi}: state-space (Mamba) layers with mamba_cache_mode={mode!r} are not "
            "supported by kvsdk; enable prefix caching so vLLM keeps states in 'align' mode"
        )
    if blocks_per_chunk != 1:
        raise ConfigError(
            f"chunk_tokens: a model with state-space (Mamba) layers keeps one state per "
            f"{spec.block_size}-token block; expected chunk_tokens unset or {spec.block_size}"
        )
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise ConfigError(
            f"KV group {gi}: state-space (Mamba) layers with speculative decoding "
            "(num_speculative_blocks > 0) are not supported by kvsdk yet"
        )


def check_process_layout(parallel: Any) -> None:
    """Fail closed on process layouts whose KV kvsdk cannot place yet."""
    unsupported = {
        "nnodes": (getattr(parallel, "nnodes", 1), "workers on other machines"),
        "decode_context_parallel_size": (
            getattr(parallel, "decode_context_parallel_size", 1),
            "KV split across ranks by token",
        ),
        "prefill_context_parallel_size": (
            getattr(parallel, "prefill_context_parallel_size", 1),
            "KV split across ranks by token",
        ),
    }
    for name, (value, what) in unsupported.items():
        if int(value) > 1:
            raise ConfigError(
                f"parallel_config.{name}={value} ({what}) is not supported by kvsdk yet"
            )


def _stage_layer_ratio(vllm_config: Any, pp_rank: int) -> float:
    """Largest pipeline stage's layer count over this stage's (1.0 without PP)."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp == 1:
        return 1.0
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
    counts = [end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp))]
    return max(counts) / max(1, counts[pp_rank])


def engine_layout(
    vllm_config: Any, kv_cache_config: Any, *, pp_rank: int = 0, announce: bool = False
) -> EngineLayout:
    """``kv_cache_config`` is the calling process's: the scheduler's (pipeline
    stage 0's layers) or a worker's (its own stage's, ``pp_rank``). ``announce``:
    log the config's source (the scheduler side, once per engine)."""
    kv_cfg = vllm_config.kv_transfer_config
    cfg = load_engine_config(dict(kv_cfg.kv_connector_extra_config or {}), announce=announce)
    parallel = vllm_config.parallel_config
    check_process_layout(parallel)
    stage_ratio = _stage_layer_ratio(vllm_config, pp_rank)
    groups: list[KVGroupSpec] = []
    layers: list[tuple[str, ...]] = []
    layouts: list[GroupLayout] = []
    region_bytes = 0
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        bs = spec.block_size
        if cfg.chunk_tokens is not None and cfg.chunk_tokens % bs:
            raise ConfigError(
                f"chunk_tokens: got {cfg.chunk_tokens}; expected a multiple of the engine's "
                f"block size {bs} (KV group {gi}), or unset for the block size"
            )
        bpc = 1 if cfg.chunk_tokens is None else cfg.chunk_tokens // bs
        kind, window = group_kind(gi, spec)
        if kind is GroupKind.MAMBA:
            check_mamba_group(gi, spec, bpc)
        page, dtype = _page_bytes_and_dtype(spec)
        # vLLM marks the group holding an EAGLE/MTP drafter's layers when it drops
        # their volatile last block from its own prefix hits; kvsdk does the same
        eagle = bool(getattr(group, "is_eagle_group", False))
        groups.append(KVGroupSpec(gi, kind, bs, bpc, sliding_window_tokens=window, eagle=eagle))
        layers.append(tuple(group.layer_names))
        layouts.append(GroupLayout((len(group.layer_names), page), dtype, kind.value))
        # every stage's region fits the largest stage's layers
        stage_layers = math.ceil(len(group.layer_names) * stage_ratio - 1e-9)
        region_bytes = max(region_bytes, page * stage_layers * bpc)
    model_cfg = vllm_config.model_config
    replicated = bool(getattr(model_cfg, "use_mla", False))
    if (problem := engine_problem(vllm_config)) is not None:  # vLLM's general plugins off
        raise ConfigError(problem)
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    if (pp if replicated else tp * pp) > 1:  # each rank's region starts on a page: aligned DMA
        region_bytes = -(-region_bytes // _PAGE) * _PAGE
    ranks = RankLayout(
        tp_size=tp,
        pp_size=pp,
        replicated_across_tp=replicated,
        region_bytes=region_bytes,
    )
    check_prefix_hash(str(vllm_config.cache_config.prefix_caching_hash_algo), cfg)
    namespace = Namespace(
        model=model_identity(model_cfg.model, getattr(model_cfg, "revision", None), cfg.model_id),
        dtype=str(model_cfg.dtype),
        groups=tuple(layouts),
        tokens_per_chunk=groups[0].tokens_per_chunk,  # as resolved (unset: the block size)
        rank=0,  # a chunk holds every rank's part (RankLayout)
        world_size=ranks.tp_size * ranks.pp_size,
        tenant_salt=cfg.tenant,
        extra=meaning_of_kv(vllm_config),
        secret=load_secret(cfg.secret_file),
    )
    tokens_per_hash = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
    return EngineLayout(
        cfg,
        tuple(groups),
        tuple(layers),
        namespace,
        ranks,
        region_bytes * ranks.num_regions,
        int(tokens_per_hash),
        segment_name(str(kv_cfg.engine_id)),
    )
