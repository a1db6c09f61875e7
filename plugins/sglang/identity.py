"""Which model an SGLang deployment runs, as its storage namespaces name it.

SGLang names the model to a storage backend only by its served name
(``HiCacheStorageConfig.model_name``), which stays the same when the weights
behind it change. kvsdk names it by what the weights are: every byte of every
weight file (:func:`kvsdk.weights.weights_fingerprint`) and a digest of the
model's ``config.json``, so two deployments share pages exactly when they run
the same weights, wherever the files lie and whatever they are called.

The weights are looked up where SGLang loaded them from: the model path of
SGLang's published server arguments (a scheduler process), else the served
model name when it is a local directory (SGLang's default served name is the
model path). A hub id counts as its local snapshot. The server arguments
that change what KV bytes mean (dtype, quantization, KV cache dtype, config
overrides, context length, load format, model implementation) are part of
the identity too.

Weights that cannot be located are refused (:class:`~kvsdk.config.ConfigError`)
rather than shared by name; kvsdk's ``model_id`` names the model instead of
the fingerprint, for weights kvsdk cannot read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvsdk.config import ConfigError, KVSDKConfig
from kvsdk.weights import (
    WEIGHT_SUFFIXES,
    file_digest,
    hub_snapshot,
    weight_files,
    weights_fingerprint,
)

PAGE_HASH = "sha256"
"""SGLang's page hash (``get_hash_str``): a SHA-256 chain over each page's token
ids, the page keys are derived from (:func:`~kvsdk.plugins.sglang.pages.page_key_bytes`)."""

_SETTINGS = ("dtype", "quantization", "kv_cache_dtype", "load_format", "model_impl",
             "modelopt_quant", "context_length", "json_model_override_args")  # fmt: skip
"""SGLang's model arguments that change what the KV bytes of the same weights mean."""

_MODEL_ID_HINT = "set model_id in kvsdk's config to a name that changes whenever the weights do"


@dataclass(frozen=True)
class ModelIdentity:
    """The model part of a namespace: ``model`` and the ``extra`` pairs beside it."""

    model: str
    """``weights:<fingerprint>``, or the configured ``model_id``."""
    extra: tuple[tuple[str, str], ...]
    source: str
    """Where the identity came from (for the log)."""


def server_model_args() -> Any | None:
    """SGLang's resolved model arguments (``get_model()``) in a process that
    published them (SGLang's scheduler); None elsewhere."""
    try:
        from sglang.srt.runtime_context import get_model

        return get_model()
    except (ImportError, ValueError, AttributeError):
        return None


def model_identity(storage_config: HiCacheStorageConfig, config: KVSDKConfig) -> ModelIdentity:
    """The identity of the model SGLang runs; a :class:`ConfigError` when the
    weights cannot be located and ``model_id`` is not set."""
    args = server_model_args()
    settings = _settings(args)
    if config.model_id:
        return ModelIdentity(config.model_id, (("model_config", "model_id"), *settings), "model_id")
    root = _weights_dir(storage_config, args)
    files = weight_files(root)
    if not files:
        raise ConfigError(
            f"model: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {root}, so kvsdk cannot "
            f"fingerprint the weights; {_MODEL_ID_HINT}"
        )
    extra = (("model_config", _config_digest(root)), *settings)
    return ModelIdentity(f"weights:{weights_fingerprint(root)}", extra, str(root))


def _weights_dir(storage_config: HiCacheStorageConfig, args: Any | None) -> Path:
    """The local directory of the weights SGLang loaded."""
    if args is not None:
        where = str(getattr(args, "model_path", "") or "")
        what = f"SGLang's model path {where!r}"
        revision, cache = getattr(args, "revision", None), getattr(args, "download_dir", None)
    else:  # no published server arguments: the served name, SGLang's model path by default
        where = str(storage_config.model_name or "")
        what = f"SGLang's served model name {where!r} (no server arguments published)"
        revision = cache = None
    if where and Path(where).is_dir():
        return Path(where)
    snapshot = hub_snapshot(where, revision, cache) if where else None
    if snapshot is None:
        raise ConfigError(
            f"model: {what} is neither a local model directory nor a cached hub snapshot, so "
            "kvsdk cannot fingerprint the weights and will not share KV by name; serve the "
            f"model from a local directory, or {_MODEL_ID_HINT}"
        )
    return snapshot


def _config_digest(root: Path) -> str:
    """A digest of the model's ``config.json`` (key order and spacing aside)."""
    try:
        text = json.dumps(json.loads((root / "config.json").read_text()), sort_keys=True)
    except (OSError, ValueError):
        text = "none"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _settings(args: Any | None) -> tuple[tuple[str, str], ...]:
    """SGLang's model arguments that change what KV bytes mean, and its page hash."""
    out = [("page_hash", PAGE_HASH)]
    if args is None:
        return (*out, ("server_args", "unpublished"))
    for name in _SETTINGS:
        value = getattr(args, name, None)
        if name == "json_model_override_args" and isinstance(value, str):
            with contextlib.suppress(ValueError):  # as JSON, key order and spacing aside
                value = json.loads(value or "{}")
        out.append((name, json.dumps(value, sort_keys=True, default=str)))
    params = getattr(args, "quantization_param_path", None)  # KV scales: by their contents
    if params and Path(params).is_file():
        out.append(("quantization_params", file_digest(Path(params))))
    elif params:
        out.append(("quantization_params", str(params)))
    return tuple(out)
