"""Engine-neutral KV events: what each tier stored, removed or cleared.

The tiered store records events as they happen; adapters drain them
(``take_events``) to translate into their engine's types (vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), and every batch is
also handed to the tracker's ``sink`` (whoever builds the tracker passes it:
:class:`kvsdk.store.factory.StoreHandle` passes the plugins'
``kvsdk_publish_events`` hook).
Both queues are bounded: beyond ``max_pending`` the oldest events are dropped
and counted, never an unbounded backlog.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvsdk.types import ChunkKey, Locality, Medium

log = logging.getLogger(__name__)


class EventKind(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class EventOrigin(NamedTuple):
    """Where a chunk came from in the engine: what the scheduler annotates each
    chunk key with, so events can name chunks by the engine's own hashes."""

    group: int
    """The KV cache group's index."""
    chunk: int
    """The chunk's position in its request (0 = the first chunk)."""
    block_hash: Any
    """The engine's hash of the chunk's last block."""


EventSink = Callable[[Sequence["KVEvent"]], object]
"""Receives each published batch of events; must not block."""


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    keys: tuple[ChunkKey, ...]
    tier: int
    medium: Medium
    locality: Locality
    timestamp: float
    info: tuple[Any, ...] = ()
    """Per key, what the adapter annotated (an :class:`EventOrigin`, SGLang's
    page hash), or None."""


class EventTracker:
    """Bounded queues of events; not thread-safe (its owner serializes calls)."""

    def __init__(
        self, *, enabled: bool = True, max_pending: int = 100_000, sink: EventSink | None = None
    ) -> None:
        self.enabled = enabled
        self.max_pending = max_pending
        self.sink = sink
        """Where ``publish`` sends each batch (None: nowhere)."""
        self._pending: deque[KVEvent] = deque()
        self._unpublished: deque[KVEvent] = deque()
        self._annotations: OrderedDict[ChunkKey, Any] = OrderedDict()
        self.dropped = 0
        """Events the adapter never drained (oldest dropped first)."""
        self.dropped_unpublished = 0
        """Events dropped before the sinks saw them."""

    def annotate(self, key: ChunkKey, info: Any) -> None:
        """Attach engine-side detail to a key's future events (bounded)."""
        if not self.enabled:
            return
        if len(self._annotations) >= self.max_pending:
            self._annotations.popitem(last=False)  # O(1), unlike popping a dict's first key
        self._annotations[key] = info

    def record(
        self,
        kind: EventKind,
        keys: Sequence[ChunkKey],
        *,
        tier: int,
        medium: Medium,
        locality: Locality,
    ) -> None:
        if not self.enabled or (not keys and kind is not EventKind.CLEARED):
            return
        info: tuple[Any, ...] = ()
        if self._annotations:
            info = tuple(self._annotations.get(k) for k in keys)
        event = KVEvent(kind, tuple(keys), tier, medium, locality, time.time(), info)
        self._pending.append(event)
        if len(self._pending) > self.max_pending:
            self._pending.popleft()  # the adapter is not draining: keep the newest
            self.dropped += 1
        self._unpublished.append(event)
        if len(self._unpublished) > self.max_pending:
            self._unpublished.popleft()
            self.dropped_unpublished += 1

    def take_events(self) -> list[KVEvent]:
        """Drain the adapter's queue."""
        if not self._pending:
            return []
        out = list(self._pending)
        self._pending.clear()
        return out

    def publish(self) -> None:
        """Send new events to the sink (one call per batch)."""
        if not self._unpublished:
            return
        batch = list(self._unpublished)
        self._unpublished.clear()
        if self.sink is None:
            return
        try:
            self.sink(batch)
        except Exception:  # a sink must never break serving
            log.exception("an event sink failed; events of this batch may be lost for it")

    def reset(self) -> None:
        """Drop undrained events and annotations (the tiers were cleared)."""
        self._pending.clear()
        self._unpublished.clear()
        self._annotations.clear()
