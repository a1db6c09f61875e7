"""The vocabulary shared by every piece of the core.

Keys are plain ``bytes`` (no tuple or object overhead on the hot path); the
rest are small frozen dataclasses and enums that adapters fill from their
engine's objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ChunkKey = bytes
"""A chunk's identity: 16 bytes derived from the namespace, the content hash
chain up to the chunk's last token, and the KV group index (see keys.py)."""

ReqId = str
ReqKey = ReqId | tuple[ReqId, int]
"""How the scheduler files a request: its id while it is live; ``(id, n)``
once the engine reused the id of a finished request whose stores or final
step were still pending (that one is then the n-th incarnation retired)."""
JobId = int


class LookupResult(enum.Enum):
    """What the tiered store knows about one chunk key."""

    MISS = "miss"
    """Not stored anywhere (or stored but unreadable: counted as a miss)."""
    HIT = "hit"
    """Readable from the host tier now."""
    HIT_PENDING = "hit_pending"
    """Stored, but not readable yet (e.g. being promoted from a slow tier)."""
    RETRY = "retry"
    """Location not known yet (an asynchronous lookup is in flight)."""


class Medium(str, enum.Enum):
    """Where a tier keeps its bytes; reported on every event and metric."""

    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"


class Locality(str, enum.Enum):
    """Who can read a tier: this process, this machine, or every instance."""

    PROCESS = "process"
    NODE = "node"
    CLUSTER = "cluster"


class GroupKind(str, enum.Enum):
    """How a KV group's history is needed to resume at a boundary."""

    FULL_ATTENTION = "full_attention"
    """Every chunk before the boundary is needed (prefix scan)."""
    SLIDING_WINDOW = "sliding_window"
    """Only the chunks covering the last ``sliding_window_tokens`` are needed."""
    MAMBA = "mamba"
    """Only the state at the boundary is needed: the chunk ending exactly there."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_down(a: int, b: int) -> int:
    return a - a % b


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group as the engine lays it out.

    ``tokens_per_block`` is the engine's block (page) size for the group;
    ``blocks_per_chunk`` how many engine blocks form one offload chunk.
    """

    index: int
    kind: GroupKind = GroupKind.FULL_ATTENTION
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    sliding_window_tokens: int | None = None
    eagle: bool = False

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.blocks_per_chunk <= 0:
            raise ValueError(f"group {self.index}: block and chunk sizes must be positive")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not self.sliding_window_tokens or self.sliding_window_tokens <= 0:
                raise ValueError(f"group {self.index}: sliding window groups need a window size")
        elif self.sliding_window_tokens is not None:
            raise ValueError(f"group {self.index}: only sliding window groups take a window size")

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    def window_start(self, end_tokens: int) -> int:
        """First token position whose KV is needed to continue after ``end_tokens``.

        Full attention needs everything; a sliding window of ``w`` tokens needs
        the last ``w - 1`` positions; Mamba needs only the state at the boundary.
        """
        if self.kind is GroupKind.FULL_ATTENTION:
            return 0
        if self.kind is GroupKind.MAMBA:
            return max(0, end_tokens - 1)
        assert self.sliding_window_tokens is not None
        return max(0, end_tokens - (self.sliding_window_tokens - 1))

    def needed_chunks(self, start_tokens: int, end_tokens: int) -> range:
        """Chunk indices that must be loaded to resume at ``end_tokens``
        when the engine already holds ``[0, start_tokens)``."""
        tpc = self.tokens_per_chunk
        first = max(start_tokens, self.window_start(end_tokens)) // tpc
        return range(first, cdiv(end_tokens, tpc))
