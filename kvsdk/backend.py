"""The storage backend interface: one narrow, batched contract for every tier.

Primitives, in the order the tiered store uses them:

- ``exists(keys)``   which keys are stored (one call per step, batched)
- ``get(keys)``      their bytes, ``None`` for a miss (never raises for a miss)
- ``put(items)``     store ``(key, bytes)`` pairs; returns which were stored
- ``delete(keys)``   drop entries (e.g. after an integrity failure)
- ``clear()``        drop everything this backend holds for its namespace
- ``stats()``        numbers for metrics and ``kvsdk inspect``
- ``close()``        release files, sockets, memory

Backends are synchronous; the tiered store calls slow tiers from its I/O
threads, never from the scheduler thread. A backend signals failure by
raising :class:`BackendError` (or any ``OSError``); the store turns that
into misses and counts it.

Values passed to ``put`` and returned by ``get`` are raw chunk payloads.
A backend that keeps bytes outside this process frames them on ``put``
(``kvsdk.chunk_format``: magic, version, namespace, key, shape, checksum)
and verifies the frame on ``get``: a corrupt, foreign or truncated entry is
returned as ``None`` (a miss), counted (``corrupt_count``) and deleted.

Declared capabilities, in the manner of zarr's ``Store``: every method below
has a default built on the primitives, and a backend that does better
overrides it and says so in a class flag, so callers never probe with
``getattr`` or compare methods:

- ``get_into(keys, outs)``       read payloads into caller buffers; native
                                  (no whole-payload bytes object) when ``supports_get_into``
- ``put_parts`` / ``get_into_parts``  payloads as lists of buffers; native
                                  (``writev`` / ``readv``) when ``supports_scatter_gather``
- ``capacity_bytes()``           bytes the tier may hold, or None (unbounded / unknown)
- ``corrupt_count()``            integrity failures seen so far (grows, never shrinks)
- ``error_count()``              I/O failures the tier absorbed itself (served as a
                                  miss or a refused write instead of raising) so far;
                                  the chain adds them to ``kvsdk_backend_errors_total``
- ``available()``                False while the tier skips calls after a failure
                                  (a circuit breaker): its misses then say nothing
                                  about the medium, so the chain does not log it back up
- ``may_contain(keys)``          from memory, no I/O (the scheduler thread calls it):
                                  False where the key is surely not stored, so a
                                  lookup misses at once instead of asking the tier;
                                  meaningful when ``supports_local_index`` (the
                                  default says True for every key: ask)

``stats()`` is for display (metrics labels, ``kvsdk inspect``); nothing reads
control values out of it.

The host-RAM tier additionally implements :class:`HostTier`: addressable
fixed-size slots a transfer worker copies into directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvsdk.types import ChunkKey, Locality, Medium

Buffer = bytes | bytearray | memoryview


class BackendError(RuntimeError):
    """A tier could not serve a request; the caller treats it as a miss."""


@dataclass(frozen=True)
class SlabRequest:
    """The host tier's slab lives in the shared-memory segment ``name``, each
    slot split into ``regions`` equal rank regions (see :mod:`kvsdk.slab`)."""

    name: str
    regions: int = 1
    creator_copies: bool = True
    """Whether the creating process copies slot data itself (its slower tiers'
    writes and promotions). If not (a host tier alone under vLLM: only the
    workers copy), only the attaching workers commit the slab's pages: a walk
    in the creator would map pages it never touches."""


@dataclass(frozen=True)
class TierContext:
    """What a backend learns about its place when it is built."""

    namespace_fp: bytes
    """16-byte public namespace fingerprint (:attr:`kvsdk.keys.Namespace.public_fp`):
    prefix keys with it, check it on read."""
    namespace_hex: str
    chunk_bytes: int
    """Largest payload one chunk can have (for slot sizing)."""
    tier_index: int = 0
    policy_factory: Any = None
    """``factory(capacity=entries) -> EvictionPolicy`` for tiers that evict locally."""
    slab: SlabRequest | None = None
    """For the host tier: a shared-memory slab the engine's processes attach to
    (None: a private one)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else an embedding passes to third-party backends."""
    frame_key: bytes | None = field(default=None, repr=False)
    """The namespace's frame MAC key when a deployment secret is set
    (:mod:`kvsdk.trust`): pass it as ``mac_key`` to every frame encode and
    decode. Never log it."""


@dataclass(frozen=True)
class NoOptions:
    """For backends that take no options beyond ``backend:``."""


class Backend(ABC):
    """A storage tier. One file per implementation; registered via the
    ``kvsdk_backends`` hook."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    medium: ClassVar[Medium] = Medium.CPU
    locality: ClassVar[Locality] = Locality.PROCESS
    supports_listing: ClassVar[bool] = False
    """``iter_keys`` lists the stored keys."""
    supports_get_into: ClassVar[bool] = False
    """``get_into`` fills the caller's buffers without building the payload as a
    bytes object (a tier may still read into a private buffer first: the disk
    tier does, so a read past its deadline never writes into caller memory)."""
    supports_scatter_gather: ClassVar[bool] = False
    """``put_parts`` / ``get_into_parts`` move a payload's parts as they are (no join)."""
    supports_local_index: ClassVar[bool] = False
    """``may_contain`` answers from a local index of what the tier holds (kept
    current by this and other processes' stores and removals)."""

    @abstractmethod
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]: ...

    @abstractmethod
    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    @abstractmethod
    def clear(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Numbers for display (metrics, ``kvsdk inspect``)."""
        return {}

    def capacity_bytes(self) -> int | None:
        """Bytes this tier may hold, or None when unbounded or unknown. The
        default reads a ``capacity_bytes`` entry of ``stats()`` (older backends)."""
        cap = self.stats().get("capacity_bytes")
        return int(cap) if cap else None

    def corrupt_count(self) -> int:
        """Integrity failures (corrupt or foreign entries read) since start. The
        default reads a ``corrupt`` entry of ``stats()`` (older backends)."""
        return int(self.stats().get("corrupt", 0))

    def error_count(self) -> int:
        """I/O failures this tier absorbed (an unreachable server, a directory
        that cannot be created, a read or write the OS refused: served as misses
        or refused writes rather than raised) since start; grows, never
        shrinks. An exception out of a call is counted by the caller and need
        not be counted here. Asked after every call, so keep it cheap; the
        default (0) suits a backend that raises its failures."""
        return 0

    def available(self) -> bool:
        """False while this tier answers without asking its medium (a server
        skipped for a backoff after a failure); the default (True) suits a
        backend that tries every call."""
        return True

    def may_contain(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key, False where this tier surely does not hold it, from memory
        alone: called on the scheduler thread between engine steps, so it must
        not block, do I/O or take a lock another thread holds across I/O. A
        stale index may only err towards True for keys it lost track of (the
        later ``exists`` or ``get`` finds the truth) and towards False for keys
        it has not heard of yet (a miss, never wrong bytes). The default (True
        for every key) suits a tier without a local index."""
        return [True] * len(keys)

    def close(self) -> None:
        return None

    def iter_keys(self) -> Iterator[ChunkKey]:
        """All stored keys (only when ``supports_listing``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its keys")

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Like ``get``, each payload read into the writable flat byte view
        ``outs[i]``, which it must fill exactly (another size is a miss). Per
        key whether it was read; where False the destination's contents are
        undefined. This default copies out of ``get``; backends that read in
        place override it and set ``supports_get_into``."""
        done = []
        for value, out in zip(self.get(keys), outs):
            ok = value is not None and memoryview(value).nbytes == out.nbytes
            if ok:
                assert value is not None
                out[:] = memoryview(value).cast("B")
            done.append(ok)
        return done

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        """Like ``put``, each payload given as flat byte views whose concatenation
        it is (e.g. a page lying in several regions of host memory). Backends
        with scatter/gather I/O override this (and set ``supports_scatter_gather``)
        and write the parts as they are; this default joins them (one copy)
        and calls ``put``."""
        return self.put([(key, b"".join(parts)) for key, parts in items])

    def get_into_parts(
        self, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """Like ``get``, each payload read into the writable flat byte views
        ``outs[i]`` in order (their sizes must add up to the payload's exactly;
        another size is a miss). Per key whether it was read; where False the
        destinations' contents are undefined. Backends with scatter/gather I/O
        override this (and set ``supports_scatter_gather``); this default
        copies out of ``get``."""
        done = []
        for value, parts in zip(self.get(keys), outs):
            src = None if value is None else memoryview(value).cast("B")
            ok = src is not None and src.nbytes == sum(p.nbytes for p in parts)
            if ok:
                assert src is not None
                off = 0
                for part in parts:
                    part[:] = src[off : off + part.nbytes]
                    off += part.nbytes
            done.append(ok)
        return done

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        """What a tier configured with ``options`` holds, per namespace, without
        knowing the namespace (``kvsdk inspect``): ``[{"namespace": hex,
        "entries": n, "bytes": b, ...}]``. Empty for process-local tiers."""
        return []

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        """Delete what a tier configured with ``options`` holds: every
        namespace, or only ``namespace`` (its hex name, as ``inventory``
        reports it); returns the entries deleted. For ``kvsdk clear`` only:
        an engine's reset never wipes a shared tier. Nothing for
        process-local tiers."""
        return 0


class HostTier(Backend):
    """A host-memory tier with addressable slots (one chunk per slot).

    Entry lifecycle: ``reserve`` (slot allocated, not readable) → a transfer
    worker fills the slot → ``commit(ok=True)`` (readable) or
    ``commit(ok=False)`` (slot freed). ``pin``/``unpin`` protect a readable
    entry from eviction while a load copies out of it.
    """

    @property
    @abstractmethod
    def slab(self) -> torch.Tensor:
        """``uint8`` tensor of shape ``(num_slots, slot_bytes)``."""

    @abstractmethod
    def slot_of(self, key: ChunkKey) -> int | None:
        """Slot of a readable entry, or None."""

    def readable_run(self, keys: Sequence[ChunkKey], start: int, stop: int) -> int:
        """First index in ``[start, stop)`` whose key is not readable (``stop``
        if all are): the planner's prefix scan in one call."""
        i = start
        while i < stop and self.slot_of(keys[i]) is not None:
            i += 1
        return i

    def pin_readable(self, keys: Sequence[ChunkKey]) -> list[int]:
        """A load's start: the slot of each readable key, pinned and touched
        (``slot_of``, ``pin`` and ``touch`` in one call)."""
        slots = []
        for key in keys:
            slot = self.slot_of(key)
            assert slot is not None, "pin_readable() of a chunk that is not readable"
            slots.append(slot)
        self.pin(keys)
        self.touch(keys)
        return slots

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Readable or being written (a store for it is in flight)."""

    def absent(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """``keys`` that are neither readable nor being written, once each, in order."""
        return list(dict.fromkeys(k for k in keys if not self.contains(k)))

    @abstractmethod
    def reserve(
        self, keys: Sequence[ChunkKey], *, owner: str = "", limit: int | None = None
    ) -> tuple[list[int], list[ChunkKey]] | None:
        """Slots for new entries, evicting as needed: ``(slots, evicted_keys)``,
        or None (nothing reserved) when there is no room.

        ``owner`` (a tenant) is charged for the entries; with ``limit`` it may
        hold at most that many slots: beyond it, its own entries are evicted
        first, and the reservation fails if they cannot be."""

    @abstractmethod
    def commit(self, keys: Sequence[ChunkKey], ok: bool) -> list[ChunkKey]:
        """End the writes of ``keys``; returns those that became readable
        (none when ``ok`` is false; entries dropped meanwhile are skipped)."""

    @abstractmethod
    def pin(self, keys: Sequence[ChunkKey]) -> None: ...

    @abstractmethod
    def unpin(self, keys: Sequence[ChunkKey]) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey]) -> None: ...

    @abstractmethod
    def clear(self, keep: Collection[ChunkKey] = ()) -> None:
        """Drop every entry but ``keep`` (kept unreadable, for I/O still using their slots)."""

    @property
    @abstractmethod
    def num_slots(self) -> int: ...

    def seal(self) -> None:
        """Every process that will move this tier's bytes has attached to them
        (a tier shared across an engine's processes drops its name now)."""
        return None

    @property
    @abstractmethod
    def num_used(self) -> int: ...
