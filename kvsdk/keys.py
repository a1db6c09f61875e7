"""Chunk keys: a content hash chain, scoped by a namespace fingerprint.

Everything here is deterministic across processes, machines and
``PYTHONHASHSEED``: BLAKE2b over canonical bytes, never ``hash()``.

- :class:`Namespace` fingerprints what makes KV bytes interchangeable: model
  identity, dtype, per-group KV layout, chunk size, parallel rank and size,
  kvsdk's format version and an optional tenant salt. Two engines share
  chunks exactly when their fingerprints are equal.
- :func:`token_chunk_hashes` chains 32-byte hashes over token ids, one per
  chunk; each hash covers the whole prefix up to that chunk's last token.
- :func:`chunk_key` turns a chain hash (ours or an engine's own block hash)
  and a KV group index into the 16-byte key the tiers store under.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from kvsdk.types import ChunkKey

FORMAT_VERSION = 2
"""Bump when the meaning of stored bytes changes: old entries become misses."""

KEY_BYTES = 16
CHAIN_HASH_BYTES = 32


@dataclass(frozen=True)
class GroupLayout:
    """The bytes of one KV group's chunk: engine-visible shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    layout: str = "engine"


@dataclass(frozen=True)
class Namespace:
    """Everything that decides whether two engines' KV bytes are interchangeable."""

    model: str
    dtype: str
    groups: tuple[GroupLayout, ...]
    tokens_per_chunk: int
    rank: int = 0
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    tenant_salt: str = ""
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def canonical_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> bytes:
        """16 bytes; stored in every chunk header and used as the key-derivation key."""
        return hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=b"kvsdk-ns").digest()

    @property
    def hex(self) -> str:
        return self.fingerprint.hex()

    def with_tenant(self, salt: str) -> Namespace:
        return Namespace(
            model=self.model,
            dtype=self.dtype,
            groups=self.groups,
            tokens_per_chunk=self.tokens_per_chunk,
            rank=self.rank,
            world_size=self.world_size,
            format_version=self.format_version,
            tenant_salt=salt,
            extra=self.extra,
        )


ROOT_HASH = bytes(CHAIN_HASH_BYTES)


def token_chunk_hashes(
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_chunk: int,
    *,
    parent: bytes = ROOT_HASH,
    extra: bytes = b"",
) -> list[bytes]:
    """Chain hashes for every *full* chunk of ``token_ids``.

    ``parent`` continues an earlier chain (pass the last hash already
    computed); ``extra`` mixes in per-request content that changes the KV
    without changing token ids (multimodal inputs, LoRA id, cache salt).
    Tokens are hashed as little-endian int64 so the bytes, not the Python
    objects, decide the hash.
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    n_full = len(tokens) // tokens_per_chunk
    out: list[bytes] = []
    prev = parent
    view = tokens[: n_full * tokens_per_chunk].reshape(n_full, tokens_per_chunk)
    for row in view:
        h = hashlib.blake2b(digest_size=CHAIN_HASH_BYTES, person=b"kvsdk-chain")
        h.update(prev)
        h.update(extra)
        h.update(row.tobytes())
        prev = h.digest()
        out.append(prev)
    return out


@lru_cache(maxsize=64)
def _keyed(namespace_fp: bytes, group_index: int) -> Any:
    """The keyed hasher for one namespace and group, already fed the group index:
    each key copies it instead of redoing BLAKE2b's key setup."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=namespace_fp, person=b"kvsdk-key")
    h.update(group_index.to_bytes(4, "little"))
    return h


@lru_cache(maxsize=64)
def key_mask(namespace_fp: bytes, group_index: int) -> int:
    """The 128-bit mask that scopes chain hashes to one namespace and group:
    a keyed BLAKE2b of the group index under the namespace fingerprint."""
    return int.from_bytes(_keyed(namespace_fp, group_index).digest(), "little")


def chunk_key(namespace_fp: bytes, chain_hash: bytes, group_index: int) -> ChunkKey:
    """The 16-byte key of one chunk of one KV group.

    ``chain_hash`` may be kvsdk's own (:func:`token_chunk_hashes`) or an
    engine-provided block hash (vLLM's, SGLang's). A hash of 16 bytes or more
    is already a collision-resistant digest of the whole prefix, so its first
    16 bytes are XORed with the namespace's mask (:func:`key_mask`): two
    namespaces share a key only if two chain hashes differ by exactly the XOR
    of their masks, as hard as a 128-bit collision, at a third of the cost of
    hashing again (it runs for every chunk on the scheduler thread). Shorter
    hashes go through the keyed BLAKE2b.
    """
    if len(chain_hash) >= KEY_BYTES:
        mask = key_mask(namespace_fp, group_index)
        return (int.from_bytes(chain_hash[:KEY_BYTES], "little") ^ mask).to_bytes(
            KEY_BYTES, "little"
        )
    h = _keyed(namespace_fp, group_index).copy()
    h.update(chain_hash)
    return h.digest()  # type: ignore[no-any-return]


def chunk_keys(
    namespace_fp: bytes, chain_hashes: Sequence[bytes], group_index: int
) -> list[ChunkKey]:
    """``chunk_key`` of each hash (the mask is looked up once)."""
    mask = key_mask(namespace_fp, group_index)
    frm = int.from_bytes
    return [
        (frm(h[:KEY_BYTES], "little") ^ mask).to_bytes(KEY_BYTES, "little")
        if len(h) >= KEY_BYTES
        else chunk_key(namespace_fp, h, group_index)
        for h in chain_hashes
    ]
