"""Eviction policies: which resident chunk leaves when a tier is full.

A policy tracks resident keys only; it never decides *whether* a key may
leave (pinned or in-flight entries are the tier's business), so ``victims``
takes a predicate.

Tail first: tiers give ``insert_many`` and ``touch_many`` a batch in chain
order (a prompt's first chunk first), and a policy applies the batch from its
end, so that of chunks stored or used together the head is the most recent
and the tail leaves first. Every prompt with a given prefix needs that
prefix's first chunk, only some of them its eighth; a chain that lost its
tail still serves its head, one that lost its head serves nothing. Policies are plugins: the built-ins below register through
the ``kvsdk_eviction_policies`` hook exactly as a third-party one would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey


class EvictionPolicy(ABC):
    """Order resident keys for eviction. Calls are O(1) amortised."""

    name: str = ""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None:
        """A key became resident."""

    @abstractmethod
    def touch(self, key: ChunkKey) -> None:
        """A resident key was used (hit, load, re-store)."""

    def touch_many(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (in chain order) were used together: ``touch`` of each, the
        last one first, so the head ends the most recent (tail first, above)."""
        for key in reversed(keys):
            self.touch(key)

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (in chain order) became resident together: ``insert`` of
        each, the last one first (tail first, above)."""
        for key in reversed(keys):
            self.insert(key)

    @abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """A resident key left for a reason other than eviction (delete, reset)."""

    @abstractmethod
    def candidates(self) -> Iterator[ChunkKey]:
        """Resident keys, best victim first."""

    @abstractmethod
    def evicted(self, key: ChunkKey) -> None:
        """``key`` (from ``candidates``) was evicted."""

    @abstractmethod
    def clear(self) -> None: ...

    def victims(self, n: int, can_evict: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        """Up to ``n`` evictable keys, best first (not yet removed)."""
        out: list[ChunkKey] = []
        if n <= 0:
            return out
        for key in self.candidates():
            if can_evict(key):
                out.append(key)
                if len(out) == n:
                    break
        return out


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        del capacity  # LRU needs no size
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Sequence[ChunkKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            order[key] = None
            move(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def evicted(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[ChunkKey]:
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha): balances recency (T1)
    against frequency (T2), steered by ghost hits in B1/B2.

    Capacity is counted in entries (``capacity``); ghost lists are bounded by it.
    """

    name = "arc"

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = max(1, capacity)
        self.p = 0  # target size of T1
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            # recency ghost hit: grow T1's target
            self.p = min(self.capacity, self.p + max(1, len(self._b2) // max(1, len(self._b1))))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0, self.p - max(1, len(self._b1) // max(1, len(self._b2))))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evicted(self, key: ChunkKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def candidates(self) -> Iterator[ChunkKey]:
        # Prefer T1's LRU end while T1 exceeds its target, else T2's.
        if len(self._t1) > self.p or not self._t2:
            return chain(self._t1, self._t2)
        return chain(self._t2, self._t1)

    def _trim_ghosts(self) -> None:
        while len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while len(self._b2) > self.capacity:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        self.p = 0
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


@hookimpl
def kvsdk_eviction_policies() -> dict[str, Callable[..., EvictionPolicy]]:
    return {"lru": LRUPolicy, "arc": ARCPolicy}
