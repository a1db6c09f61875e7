"""kvsdk: KV-cache offloading for LLM inference engines.

The engine-agnostic core. Adapters live in ``kvsdk.plugins.vllm`` and
``kvsdk.plugins.sglang``; storage backends in ``kvsdk.backends``.
"""

from kvsdk.config import ConfigError, KVSDKConfig, load_config
from kvsdk.keys import Namespace, chunk_key, token_chunk_hashes
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, LookupResult, Medium

__version__ = "0.1.0"

__all__ = [
    "ChunkKey",
    "ConfigError",
    "GroupKind",
    "KVGroupSpec",
    "KVSDKConfig",
    "LookupResult",
    "Medium",
    "Namespace",
    "__version__",
    "chunk_key",
    "load_config",
    "token_chunk_hashes",
]
