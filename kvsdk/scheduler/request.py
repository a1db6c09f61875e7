"""One request as the scheduler tracks it, and the pure chunk arithmetic on it:
which chunks a step may store, and the block copies of a store or a load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvsdk.scheduler.tail import PromptTail
from kvsdk.transfer import BlockCopies
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, ReqKey, cdiv


@dataclass(slots=True)
class RequestState:
    req_id: ReqKey
    num_prompt_tokens: int
    num_tokens: int
    hashes: list[bytes]
    """One chain hash per ``tokens_per_hash`` tokens (kvsdk's copy of the engine's)."""
    block_ids: list[list[int]]
    keys: list[list[ChunkKey]]
    next_store_chunk: list[int]
    next_store_at: int = 0
    """Token count at which some group completes a chunk it has not stored yet."""
    num_computed_local: int = 0
    deferred_since: float | None = None
    tenant: str = ""
    finished: bool = False
    """Its final stores were built (``build_step`` saw it in ``finished``)."""
    engine_finished: bool = False
    """The engine reported it finished; its final stores come next step."""
    finish_tokens: int | None = None
    """Tokens whose KV the engine computed, as reported at its finish."""
    tail: PromptTail | None = None
    """The prompt's last, partial chunk as its own entry (see :mod:`kvsdk.scheduler.tail`)."""
    hit_resets: int = -1
    """The scheduler's reset count when ``lookup`` last promised a hit."""

    def chunk_key(self, gi: int, c: int) -> ChunkKey:
        """Key of chunk ``c`` of group ``gi``: a whole chunk's, or past them the tail's."""
        keys = self.keys[gi]
        if c < len(keys):
            return keys[c]
        assert self.tail is not None, f"chunk {c} of group {gi}: past the whole ones, no tail"
        return self.tail.keys[gi]


def follow_hashes(
    r: RequestState,
    block_hashes: Sequence[bytes],
    groups: Sequence[KVGroupSpec],
    tokens_per_hash: int,
) -> int | None:
    """Bring ``r.hashes`` to the engine's ``block_hashes`` (all of the request's
    so far). Most calls append what grew. A *rewind* is a list shorter than
    kvsdk's copy, or one that differs at its last hash (engine hashes are
    chained: each names its whole prefix, so a difference anywhere shows
    there): e.g. vLLM's streaming session, whose next input replaces the last
    sampled token and the hash of a block that held it. Then everything of
    ``r`` derived from a hash the engine no longer holds goes: the hashes from
    the first that differs, the keys of chunks ending past it, the prompt's tail
    if the rewind reaches its tokens; chunks from there are offered for storing
    again (under the keys of the new hashes). Returns None when nothing was
    rewound, else how many chunks (over all groups) had been offered for
    storing and are withdrawn: stores of them still in flight may read blocks
    the engine rewrites, and are the caller's to distrust."""
    mine = r.hashes
    n = len(mine)
    rewound = None
    if n and (len(block_hashes) < n or block_hashes[n - 1] != mine[-1]):
        cut = next(
            (i for i, (a, b) in enumerate(zip(mine, block_hashes)) if a != b),
            min(n, len(block_hashes)),
        )
        del mine[cut:]
        rewound = 0
        for gi, g in enumerate(groups):
            keep = cut // (g.tokens_per_chunk // tokens_per_hash)
            del r.keys[gi][keep:]
            rewound += max(0, r.next_store_chunk[gi] - keep)
            r.next_store_chunk[gi] = min(r.next_store_chunk[gi], keep)
        if r.tail is not None and cut * tokens_per_hash < r.tail.end:
            r.tail = None  # its tokens (or the chunk hash it chains to) may be gone
    if len(block_hashes) > len(mine):
        mine.extend(block_hashes[len(mine) :])
    return rewound


class StoreCopies(NamedTuple):
    keys: list[ChunkKey]
    copies: tuple[BlockCopies, ...]
    fenced: list[int]
    """Engine blocks to flush before they are rewritten (e.g. sliding window)."""
    deferred: list[int]
    """Full-attention blocks: flushed only when reallocated."""


class LoadCopies(NamedTuple):
    keys: list[ChunkKey]
    """Chunks the load reads, once each."""
    per_group: list[tuple[int, list[int], list[ChunkKey], list[int]]]
    """Per group: ``(group position, engine blocks, chunk key of each, offset in it)``."""


def chunks_to_store(
    r: RequestState, groups: Sequence[KVGroupSpec], upto: int
) -> tuple[list[Sequence[int]], list[ChunkKey]] | None:
    """Chunks of ``r`` complete at ``upto`` tokens and not offered yet: per
    group the chunk indices, and their keys (None: nothing). Marks them offered.
    An EAGLE drafter group's last complete chunk waits while the request
    decodes (the drafter rewrites its last positions' KV) until it finishes."""
    chosen: list[Sequence[int]] = []
    keys: list[ChunkKey] = []
    for gi, g in enumerate(groups):
        bpc = g.blocks_per_chunk
        ids = r.block_ids[gi]
        gkeys = r.keys[gi]
        first = r.next_store_chunk[gi]
        complete = upto // g.tokens_per_chunk
        if g.eagle and upto > r.num_prompt_tokens and not r.engine_finished:
            complete -= 1  # a drafter's last chunk is volatile while it decodes
        stop = min(complete, len(gkeys), len(ids) // bpc)
        if first >= stop:
            chosen.append(())
            continue
        if bpc == 1 and 0 not in ids[first:stop]:  # a 0 is a skipped (null) block
            cs: Sequence[int] = range(first, stop)
            keys.extend(gkeys[first:stop])
        else:
            cs = [c for c in range(first, stop) if all(ids[c * bpc : (c + 1) * bpc])]
            keys.extend(gkeys[c] for c in cs)
        chosen.append(cs)
        r.next_store_chunk[gi] = stop
    return (chosen, keys) if keys else None


def store_copies(
    r: RequestState,
    groups: Sequence[KVGroupSpec],
    chosen: list[Sequence[int]],
    slot_of: dict[ChunkKey, int],
) -> StoreCopies | None:
    """The copies of ``r``'s chosen chunks that got a slot. Each slot is
    claimed (popped from ``slot_of``) once: two requests holding the same new
    chunk never write it twice."""
    fenced: list[int] = []
    deferred: list[int] = []
    copies = []
    keys: list[ChunkKey] = []
    take = slot_of.pop
    for gi, g in enumerate(groups):
        bpc = g.blocks_per_chunk
        ids = r.block_ids[gi]
        gkeys = r.keys[gi]
        stored = [(c, slot) for c in chosen[gi] if (slot := take(gkeys[c], None)) is not None]
        if not stored:
            continue
        keys.extend(gkeys[c] for c, _ in stored)
        if bpc == 1:
            eb = [ids[c] for c, _ in stored]
            slots = [slot for _, slot in stored]
            offs = [0] * len(eb)
        else:
            eb = [b for c, _ in stored for b in ids[c * bpc : (c + 1) * bpc]]
            slots = [slot for _, slot in stored for _ in range(bpc)]
            offs = list(range(bpc)) * len(stored)
        (deferred if g.kind is GroupKind.FULL_ATTENTION else fenced).extend(eb)
        copies.append(BlockCopies(g.index, eb, slots, offs))
    return StoreCopies(keys, tuple(copies), fenced, deferred) if keys else None


def load_copies(r: RequestState, groups: Sequence[KVGroupSpec], end: int) -> LoadCopies:
    """The engine blocks each group needs filled to continue at ``end`` tokens
    from ``r.num_computed_local`` (null blocks skipped), and their chunks."""
    keys: list[ChunkKey] = []
    per_group: list[tuple[int, list[int], list[ChunkKey], list[int]]] = []
    for gi, g in enumerate(groups):
        tpb, bpc = g.tokens_per_block, g.blocks_per_chunk
        needed = g.needed_chunks(r.num_computed_local, end)
        first = max(cdiv(r.num_computed_local, tpb), needed.start * bpc)
        stop = cdiv(end, tpb)
        ids = r.block_ids[gi]
        blocks = ids[first:stop]
        gkeys = r.keys[gi][first:stop]
        one_per_chunk = bpc == 1 and len(blocks) == stop - first and len(gkeys) >= len(blocks) - 1
        if one_per_chunk and 0 not in blocks:
            # a block per chunk, none skipped: the chunks' keys (and the tail's, last)
            if len(gkeys) < len(blocks):
                gkeys.append(r.chunk_key(gi, stop - 1))
            keys += gkeys
            per_group.append((gi, blocks, gkeys, [0] * len(gkeys)))
            continue
        eb, bkeys, offs = [], [], []
        for b in range(first, stop):
            if ids[b] == 0:
                continue
            eb.append(ids[b])
            bkeys.append(r.chunk_key(gi, b // bpc))
            offs.append(b % bpc)
        keys += dict.fromkeys(bkeys)
        per_group.append((gi, eb, bkeys, offs))
    return LoadCopies(keys, per_group)


def handoff_keys(
    r: RequestState, groups: Sequence[KVGroupSpec], tokens: int
) -> list[ChunkKey] | None:
    """The keys of the entries that hold ``r``'s first ``tokens`` tokens in every
    group: its whole chunks, and the prompt's tail where ``tokens`` ends inside
    the last chunk (None: ``r``'s keys do not reach ``tokens``)."""
    keys: list[ChunkKey] = []
    for gi, g in enumerate(groups):
        whole, part = divmod(tokens, g.tokens_per_chunk)
        if len(r.keys[gi]) < whole:
            return None
        keys += r.keys[gi][:whole]
        if part:
            if r.tail is None or r.tail.start != whole * g.tokens_per_chunk or r.tail.end != tokens:
                return None
            keys.append(r.tail.keys[gi])
    return keys


def covered_tokens(r: RequestState, groups: Sequence[KVGroupSpec], upto: int) -> int:
    """Of ``r``'s first ``upto`` tokens, how many its keys name in every group:
    whole chunks, then the prompt's tail where it ends at ``upto``."""
    whole = min(
        min(len(r.keys[gi]), upto // g.tokens_per_chunk) * g.tokens_per_chunk
        for gi, g in enumerate(groups)
    )
    t = r.tail
    if t is not None and t.start == whole and t.end == upto:
        return upto
    return whole
