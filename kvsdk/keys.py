"""Chunk keys: a content hash chain, scoped by a namespace fingerprint.

Everything here is deterministic across processes, machines and
``PYTHONHASHSEED``: BLAKE2b over canonical bytes, never ``hash()``.

- :class:`Namespace` fingerprints what makes KV bytes interchangeable: model
  identity, dtype, per-group KV layout, chunk size, parallel rank and size,
  kvsdk's format version and an optional tenant salt. Two engines share
  chunks exactly when their fingerprints are equal (and their deployment
  secrets, when one is set).
- Three values come out of a namespace. ``public_fp`` names it where others
  can see: the tiers' directory and key prefix, every frame header.
  ``fingerprint`` is the key-derivation key of its chunk keys. ``frame_key``
  (only with a deployment secret) is the MAC key of its frames. Without a
  secret, ``public_fp == fingerprint`` and anyone can compute both; with one
  (:mod:`kvsdk.trust`), each is derived from the secret, so nobody without it
  can name the namespace, compute a key or forge a frame. Never log
  ``fingerprint`` or ``frame_key``.
- :func:`token_chunk_hashes` chains 32-byte hashes over token ids, one per
  chunk; each hash covers the whole prefix up to that chunk's last token.
- :func:`chunk_key` turns a chain hash (ours or an engine's own block hash)
  and a KV group index into the 16-byte key the tiers store under: a keyed
  BLAKE2b (a PRF) of the whole hash under ``fingerprint``, so keys reveal
  nothing about the prompt without the key-derivation key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsdk.types import ChunkKey

if TYPE_CHECKING:
    from kvsdk.trust import DeploymentSecret

FORMAT_VERSION = 5
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
    secret: DeploymentSecret | None = field(default=None, repr=False, compare=False)
    """The deployment secret (:mod:`kvsdk.trust`); not part of the canonical bytes."""

    def canonical_bytes(self) -> bytes:
        fields = asdict(self)
        del fields["secret"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def _unkeyed_fp(self) -> bytes:
        return hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=b"kvsdk-ns").digest()

    @cached_property
    def public_fp(self) -> bytes:
        """16 bytes naming the namespace in the tiers (directory, key prefix, frame
        headers): public; unpredictable without the secret when one is set."""
        if self.secret is None:
            return self._unkeyed_fp
        return self.secret.derive(b"kvsdk-ns-name", self.canonical_bytes())[:16]

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes: the key-derivation key of this namespace's chunk keys
        (equal to ``public_fp`` without a secret; secret with one: never log it)."""
        if self.secret is None:
            return self._unkeyed_fp
        return self.secret.derive(b"kvsdk-ns-keys", self.canonical_bytes())[:16]

    @cached_property
    def frame_key(self) -> bytes | None:
        """The MAC key of this namespace's frames (None without a secret)."""
        if self.secret is None:
            return None
        return self.secret.derive(b"kvsdk-frame-mac", self.public_fp)

    @property
    def hex(self) -> str:
        """``public_fp`` in hex: the namespace's name in directories, prefixes and reports."""
        return self.public_fp.hex()

    def with_tenant(self, salt: str) -> Namespace:
        return replace(self, tenant_salt=salt)

    def with_secret(self, secret: DeploymentSecret | None) -> Namespace:
        return replace(self, secret=secret)


def epoch_fingerprint(namespace_fp: bytes, epoch: bytes) -> bytes:
    """The key-derivation key of one instance's ``epoch`` in a namespace: the
    namespace's own for ``b""``, else a keyed BLAKE2b of the epoch. An
    instance whose prefix cache is reset (vLLM also resets after a weight
    update) moves to a fresh random epoch: its new keys name none of the
    chunks stored before, by it or by anyone, while the other instances
    sharing the tiers keep theirs (see ``docs/security.md``)."""
    if not epoch:
        return namespace_fp
    h = hashlib.blake2b(digest_size=len(namespace_fp), key=namespace_fp, person=b"kvsdk-epoch")
    h.update(epoch)
    return h.digest()


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
    n = len(token_ids) // tokens_per_chunk * tokens_per_chunk
    data: memoryview | None = None
    if isinstance(token_ids, list | tuple):
        # The same bytes without numpy: on the scheduler thread between engine
        # steps (a prompt tail per request) a numpy call cost ~100 us, measured
        # in vLLM's EngineCore; ``struct`` packs 100 ints in ~0.8 us (the array
        # module ~1.5 us).
        try:  # (a try costs nothing on this path; a `with suppress` ~0.5 us)
            data = memoryview(struct.pack(f"<{n}q", *token_ids[:n]))
        except struct.error:  # not all ints (numpy converts them): numpy's bytes below
            data = None
    if data is None:
        data = memoryview(np.asarray(token_ids, dtype="<i8")[:n].tobytes())
    out: list[bytes] = []
    prev = parent
    step = tokens_per_chunk * 8
    for off in range(0, n * 8, step):
        h = hashlib.blake2b(digest_size=CHAIN_HASH_BYTES, person=b"kvsdk-chain")
        h.update(prev)
        h.update(extra)
        h.update(data[off : off + step])
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


def chunk_key(namespace_fp: bytes, chain_hash: bytes, group_index: int) -> ChunkKey:
    """The 16-byte key of one chunk of one KV group.

    ``namespace_fp`` is the namespace's key-derivation key
    (:attr:`Namespace.fingerprint`). ``chain_hash`` may be kvsdk's own
    (:func:`token_chunk_hashes`) or an engine-provided block hash (vLLM's,
    SGLang's), of any length. The key is a keyed BLAKE2b of the group index
    and the whole hash: a pseudo-random function, so a stored key does not
    reveal the mask of an XOR (one known prompt and a directory listing would
    give every key away) and two namespaces never share a key. ~0.4 us per key.
    A colliding engine hash still collides here: engines whose prefix hash
    is not collision resistant are refused before a shared tier is used.
    """
    h = _keyed(namespace_fp, group_index).copy()
    h.update(chain_hash)
    return h.digest()  # type: ignore[no-any-return]


def chunk_keys(
    namespace_fp: bytes, chain_hashes: Sequence[bytes], group_index: int
) -> list[ChunkKey]:
    """``chunk_key`` of each hash (the keyed hasher is set up once)."""
    base = _keyed(namespace_fp, group_index)
    out: list[ChunkKey] = []
    for chain_hash in chain_hashes:
        h = base.copy()
        h.update(chain_hash)
        out.append(h.digest())
    return out
