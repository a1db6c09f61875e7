"""``cpu``: the host-RAM tier, a pre-allocated slab of fixed-size slots.

The slab is one ``uint8`` tensor ``(num_slots, slot_bytes)`` allocated at
start (pinned when CUDA is present, so device copies are true DMA). A
transfer worker copies engine blocks straight into a slot; no per-chunk
allocation ever happens on the hot path.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvsdk import prefault
from kvsdk.backend import Buffer, HostTier, TierContext
from kvsdk.config import BYTES
from kvsdk.eviction import EvictionPolicy, LRUPolicy
from kvsdk.hooks import hookimpl
from kvsdk.prefault import Prefault
from kvsdk.slab import SharedSlab, SlabGeometry
from kvsdk.types import ChunkKey, Locality, Medium

_READY, _WRITING = 1, 2


@dataclass(frozen=True)
class CPUOptions:
    capacity: int = field(default=4 << 30, metadata=BYTES)
    """Bytes of host RAM for the slab (e.g. ``8GiB``)."""
    pin_memory: Literal["auto", "always", "never"] = "auto"
    """``auto`` pins when CUDA is available; ``always`` / ``never``."""
    prefault: bool = True
    """Commit the slab's memory before the stores need it (Linux
    ``MADV_POPULATE_WRITE``): its first GiB when the engine starts, the rest
    ahead of the stores, in every engine worker that attaches and in this
    process when it copies slot data too (tiers behind it). A store into a
    page never touched pays a page fault, measured several times the copy
    itself. A worker whose torch threads fill its CPUs commits the rest just
    before its stores, on their thread. ``false``: pages are committed as
    stores first reach them."""


class CPUBackend(HostTier):
    name = "cpu"
    Options = CPUOptions
    medium = Medium.CPU
    locality = Locality.PROCESS
    supports_listing = True

    def __init__(self, options: CPUOptions, context: TierContext) -> None:
        if context.chunk_bytes <= 0:
            raise ValueError("cpu tier: chunk size in bytes must be known before the slab is built")
        self.slot_bytes = context.chunk_bytes
        n = options.capacity // self.slot_bytes
        if n < 1:
            raise ValueError(
                f"cpu tier: capacity {options.capacity} B holds no chunk of {self.slot_bytes} B"
            )
        pin = options.pin_memory == "always" or (
            options.pin_memory == "auto" and torch.cuda.is_available()
        )
        self._shared: SharedSlab | None = None
        if context.slab is not None:  # shared memory: the engine's worker processes attach to it
            regions = context.slab.regions
            if self.slot_bytes % regions:
                raise ValueError(f"cpu tier: a {self.slot_bytes} B slot has no {regions} regions")
            geometry = SlabGeometry(n, self.slot_bytes // regions, regions)
            self._shared = SharedSlab.create(
                context.slab.name,
                geometry,
                prefault=options.prefault and context.slab.creator_copies,
            )
            self._slab = self._shared.tensor  # each worker pins its own mapping for DMA
        else:
            self._slab = torch.empty((n, self.slot_bytes), dtype=torch.uint8, pin_memory=pin)
        self._prefault: Prefault | None = None
        if self._shared is None and options.prefault and not pin:  # pinning commits them
            self._prefault = Prefault(
                self._slab.data_ptr(),
                self._slab.nbytes,
                self._slab,
                "cpu tier",
                start=prefault.START_BYTES,
            )
        self._np = self._slab.numpy()
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._slot: dict[ChunkKey, int] = {}
        self._state: dict[ChunkKey, int] = {}
        self._length: dict[ChunkKey, int] = {}
        """Entries shorter than a slot (``put`` of a short value); others fill it."""
        self._pins: dict[ChunkKey, int] = {}
        self._owner: dict[ChunkKey, str] = {}
        self._usage: Counter[str] = Counter()
        self._owned: dict[str, OrderedDict[ChunkKey, None]] = {}
        """Per owner ever reserved for with a limit (a tenant with a quota, the
        prompt tails), its readable entries, least recently used first: one at
        its limit finds its own victims at the front instead of scanning the
        whole eviction order for them."""
        factory = context.policy_factory
        self._policy: EvictionPolicy = factory(capacity=n) if factory else LRUPolicy()
        self.evictions = 0

    # -- HostTier -----------------------------------------------------------------
    @property
    def slab(self) -> torch.Tensor:
        return self._slab

    @property
    def num_slots(self) -> int:
        return int(self._slab.shape[0])

    @property
    def num_used(self) -> int:
        return len(self._slot)

    def slot_of(self, key: ChunkKey) -> int | None:
        if self._state.get(key) == _READY:
            return self._slot[key]
        return None

    def readable_run(self, keys: Sequence[ChunkKey], start: int, stop: int) -> int:
        state = self._state.get
        i = start
        while i < stop and state(keys[i]) == _READY:
            i += 1
        return i

    def pin_readable(self, keys: Sequence[ChunkKey]) -> list[int]:
        state, slot_of, pins = self._state, self._slot, self._pins
        slots = []
        for key in keys:
            assert state.get(key) == _READY, "pin_readable() of a chunk that is not readable"
            slots.append(slot_of[key])
            pins[key] = pins.get(key, 0) + 1
        self.touch(keys)
        return slots

    def contains(self, key: ChunkKey) -> bool:
        return key in self._slot

    def absent(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        present = self._slot
        return list(dict.fromkeys(k for k in keys if k not in present))

    def _can_evict(self, key: ChunkKey) -> bool:
        return self._state.get(key) == _READY and key not in self._pins

    def reserve(
        self, keys: Sequence[ChunkKey], *, owner: str = "", limit: int | None = None
    ) -> tuple[list[int], list[ChunkKey]] | None:
        assert self._slot.keys().isdisjoint(keys), "reserve() of a present key"
        if limit is not None and len(keys) > limit:
            return None
        over = len(keys) + self._usage[owner] - limit if limit is not None else 0
        if limit is not None and owner not in self._owned:
            self._owned[owner] = OrderedDict.fromkeys(
                k for k in self._policy.candidates() if self._owner.get(k) == owner
            )
        own: list[ChunkKey] = []
        if over > 0:  # the owner is at its limit: it makes room from its own entries
            for k in self._owned[owner]:
                if k not in self._pins:
                    own.append(k)
                    if len(own) == over:
                        break
            else:
                return None
        shortfall = len(keys) - len(self._free) - len(own)
        others: list[ChunkKey] = []
        if shortfall > 0:
            chosen = set(own)
            others = self._policy.victims(
                shortfall, lambda k: k not in chosen and self._can_evict(k)
            )
            if len(others) < shortfall:
                return None
        evicted = own + others
        for key in evicted:
            self._policy.evicted(key)
            self._drop(key)
        self.evictions += len(evicted)
        n = len(keys)
        slots = self._free[: -n - 1 : -1]  # the same slots, in the same order, as n pops
        del self._free[len(self._free) - n :]
        if slots:  # never-used slots go lowest first: the prefault keeps ahead of them
            self._stores_reached(max(slots) + 1)
        self._slot.update(zip(keys, slots))
        self._state.update(dict.fromkeys(keys, _WRITING))
        self._owner.update(dict.fromkeys(keys, owner))
        self._usage[owner] += n
        return slots, evicted

    def _stores_reached(self, end_slot: int) -> None:
        if self._shared is not None:
            self._shared.stores_reached(end_slot)
        elif self._prefault is not None:
            self._prefault.reached(end_slot * self.slot_bytes)

    def usage(self, owner: str = "") -> int:
        """Slots held (readable or being written) by ``owner``."""
        return self._usage[owner]

    def commit(self, keys: Sequence[ChunkKey], ok: bool) -> list[ChunkKey]:
        state = self._state
        # entries dropped meanwhile (reset / delete) are skipped
        writing = [k for k in keys if state.get(k) == _WRITING]
        if not ok:
            for key in writing:
                self._drop(key)
            return []
        state.update(dict.fromkeys(writing, _READY))
        self._policy.insert_many(writing)
        if self._owned:
            for key in writing:
                owned = self._owned.get(self._owner[key])
                if owned is not None:
                    owned[key] = None
        return writing

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            assert key in self._slot, "pin() of an absent key"
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        self._policy.touch_many(keys)
        if self._owned:
            owner_of, owned_by = self._owner.get, self._owned.get
            for key in keys:
                owned = owned_by(owner_of(key, ""))
                if owned is not None and key in owned:
                    owned.move_to_end(key)

    def _drop(self, key: ChunkKey) -> None:
        owner = self._owner.pop(key, "")
        self._usage[owner] -= 1
        if not self._usage[owner]:
            del self._usage[owner]
        owned = self._owned.get(owner)
        if owned is not None:
            owned.pop(key, None)
        slot = self._slot.pop(key)
        self._state.pop(key, None)
        self._length.pop(key, None)
        self._pins.pop(key, None)
        self._free.append(slot)

    # -- Backend (bytes API: promotion from slower tiers, write-through, inspect) -
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self._state.get(k) == _READY for k in keys]

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        out: list[Buffer | None] = []
        for key in keys:
            slot = self.slot_of(key)
            out.append(
                None
                if slot is None
                else memoryview(self._np[slot, : self._length.get(key, self.slot_bytes)].data)
            )
        return out

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        new = list(
            {k: v for k, v in items if k not in self._slot and len(v) <= self.slot_bytes}.items()
        )
        stored = {k for k, _ in new}
        if new:
            reserved = self.reserve([k for k, _ in new])
            if reserved is None:
                return [self._state.get(k) == _READY for k, _ in items]
            for (key, value), slot in zip(new, reserved[0]):
                data = np.frombuffer(value, dtype=np.uint8)
                self._np[slot, : len(data)] = data
                self._length[key] = len(data)
            self.commit([k for k, _ in new], ok=True)
        return [k in stored or self._state.get(k) == _READY for k, _ in items]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            if key in self._slot and key not in self._pins:
                self._policy.remove(key)
                self._drop(key)
                n += 1
        return n

    def clear(self, keep: Collection[ChunkKey] = ()) -> None:
        """Drop every entry but those in ``keep`` (slots in-flight I/O still uses:
        they stay unreadable and are dropped when that I/O ends)."""
        keep = set(keep)
        for owned in self._owned.values():
            owned.clear()  # kept entries are never readable again
        for key in list(self._slot):
            if key in keep:
                self._policy.remove(key)
                if self._state.get(key) == _READY:
                    self._state[key] = _WRITING  # never readable again
            else:
                self._drop(key)
        self._policy.clear()

    def iter_keys(self) -> Iterator[ChunkKey]:
        return (k for k, s in list(self._state.items()) if s == _READY)

    def seal(self) -> None:
        """Every process that moves this slab's bytes has it mapped: remove the
        shared segment's name, so nothing is left behind however they end."""
        if self._shared is not None:
            self._shared.unlink()

    def close(self) -> None:
        self.seal()

    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def corrupt_count(self) -> int:
        return 0  # bytes never leave this process: nothing to verify

    def stats(self) -> dict[str, float]:
        return {
            "slots": float(self.num_slots),
            "slots_used": float(self.num_used),
            "slot_bytes": float(self.slot_bytes),
            "capacity_bytes": float(self.num_slots * self.slot_bytes),
            "pinned_entries": float(len(self._pins)),
            "evictions": float(self.evictions),
        }


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"cpu": CPUBackend}
