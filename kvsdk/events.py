"""Engine-neutral KV events: what each tier stored, removed or cleared.

The tiered store records events as they happen; adapters drain them
(``take_events``) to translate into their engine's types (vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), and every batch is
also handed to the tracker's ``sink`` (whoever builds the tracker passes it:
:class:`kvsdk.store.factory.StoreHandle` passes the plugins'
``kvsdk_publish_events`` hook).
Both queues are bounded: beyond ``max_pending`` the oldest events are dropped
and counted, never an unbounded backlog.

Router-ready stores. The scheduler annotates each chunk key with an
:class:`EventOrigin`: the engine's hash of each of the chunk's blocks, the hash
of the block before it and, where the adapter gives a :data:`TokenSource`, the
chunk's token ids, so a KV-aware router can place the chunk in its prefix tree
exactly like the engine's own blocks. Token ids are the only large part: an
annotation keeps them until the chunk's store in the deepest tier
(``last_tier``) is recorded (a store the deepest tier never takes keeps them
until the bounded annotation table drops the key), then only the hashes stay,
for the removals.
"""

from __future__ import annotations

import enum
import logging
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvsdk.types import ChunkKey, Locality, Medium, ReqKey

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
    block_hashes: tuple[Any, ...] = ()
    """The engine's hash of each of the chunk's blocks, in order (the last is
    ``block_hash``); empty for entries that are not engine blocks (prompt tails)."""
    parent_hash: Any = None
    """The engine's hash of the block before the chunk's first (None: the chunk
    starts its request)."""
    token_ids: Sequence[int] | None = None
    """The chunk's token ids (None: unknown, or dropped once published)."""
    adapter: str | None = None
    """The name of the adapter (LoRA) the chunk was computed with, if any."""


class RequestTokens(NamedTuple):
    """What the engine holds of one request: its hashes (one per
    ``tokens_per_hash`` tokens, as the scheduler's) and its token ids."""

    hashes: Sequence[Any]
    token_ids: Sequence[int]
    adapter: str | None = None


TokenSource = Callable[[ReqKey], "RequestTokens | None"]
"""The adapter's view of a request's tokens, by the scheduler's request key
(None: unknown, or its token ids alone do not name its content, e.g. images)."""


def chunk_tokens(tokens: Sequence[int], start: int, end: int) -> Sequence[int]:
    """``tokens[start:end]`` as 4-byte integers (a copy a quarter of a list's size)."""
    return array("I", tokens[start:end])


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
        self.token_source: TokenSource | None = None
        """Where the scheduler reads the token ids of the chunks it annotates
        (set by the adapter; None: events carry hashes only)."""
        self.last_tier = 0
        """The deepest tier: a chunk's token ids are dropped once its store there is recorded."""

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
            if kind is EventKind.STORED and tier >= self.last_tier:
                self._drop_tokens(keys, info)
        event = KVEvent(kind, tuple(keys), tier, medium, locality, time.time(), info)
        self._pending.append(event)
        if len(self._pending) > self.max_pending:
            self._pending.popleft()  # the adapter is not draining: keep the newest
            self.dropped += 1
        self._unpublished.append(event)
        if len(self._unpublished) > self.max_pending:
            self._unpublished.popleft()
            self.dropped_unpublished += 1

    def _drop_tokens(self, keys: Sequence[ChunkKey], info: tuple[Any, ...]) -> None:
        """The keys' last store events are recorded: their annotations keep hashes only."""
        annotations = self._annotations
        for key, origin in zip(keys, info):
            # (an annotation replaced meanwhile is another request's: kept)
            if not isinstance(origin, EventOrigin) or origin.token_ids is None:
                continue
            hashes_only = origin._replace(token_ids=None)
            if annotations.get(key) is origin:
                annotations[key] = hashes_only

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
