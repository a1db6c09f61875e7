"""Chunk keys from a request's engine hashes: per KV group, the key of each
whole chunk they name and of the prompt's tail, under the scheduler's epoch.

Where events are on, each whole chunk's key is annotated with its
:class:`~kvsdk.events.EventOrigin`: the engine's hash of each of its blocks
(block ``b`` of a group is named by the hash ending it, ``hashes[(b + 1) *
hashes_per_block - 1]``), the hash of the block before it, and its token ids
when the adapter's token source has the request and agrees with its hashes."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.events import EventOrigin, EventTracker, chunk_tokens
from kvsdk.keys import chunk_key
from kvsdk.scheduler.request import RequestState
from kvsdk.scheduler.tail import TAIL_CHUNK, PromptTail, prompt_tail
from kvsdk.types import ChunkKey, KVGroupSpec

KEY_CACHE_ENTRIES = 1 << 16
"""Engine hashes whose keys each group remembers (~10 MiB at most; cleared when full)."""


class ChunkKeys:
    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        tokens_per_hash: int,
        ns_fp: bytes,
        events: EventTracker,
    ) -> None:
        self.groups = tuple(groups)
        self.tokens_per_hash = tokens_per_hash
        self.ns_fp = ns_fp
        self.events = events
        self._cache: list[dict[bytes, ChunkKey]] = [{} for _ in self.groups]
        """Per group, the key of each engine hash derived lately: requests sharing
        a prefix (most of them, where anything is reused) derive its keys once."""

    def refresh(self, r: RequestState) -> None:
        """Derive the keys of ``r``'s whole chunks that its hashes name and it lacks."""
        n_hash = len(r.hashes)
        events = self.events
        for gi, g in enumerate(self.groups):
            per = g.tokens_per_chunk // self.tokens_per_hash
            keys = r.keys[gi]
            first = len(keys)
            if first >= n_hash // per:
                continue
            hashes = r.hashes[first * per + per - 1 : (n_hash // per) * per : per]
            cache = self._cache[gi]
            if len(cache) > KEY_CACHE_ENTRIES:
                cache.clear()
            for h in hashes:
                k = cache.get(h)
                if k is None:
                    k = cache[h] = chunk_key(self.ns_fp, h, g.index)
                keys.append(k)
            if events.enabled:  # events name chunks by the engine's hashes
                self._annotate(r, gi, first, len(keys))

    def _annotate(self, r: RequestState, gi: int, first: int, end: int) -> None:
        """Annotate the keys of ``r``'s chunks ``first..end-1`` of group ``gi``."""
        g = self.groups[gi]
        per = g.tokens_per_chunk // self.tokens_per_hash
        # an engine block spans whole hashes (else the chunk is named by its last one)
        tpb, tph = g.tokens_per_block, self.tokens_per_hash
        per_block = per if tpb % tph else tpb // tph
        hashes, keys, tpc = r.hashes, r.keys[gi], g.tokens_per_chunk
        source = self.events.token_source
        engine = source(r.req_id) if source is not None else None
        if engine is not None and not (
            len(engine.token_ids) >= end * tpc
            and len(engine.hashes) >= end * per
            and engine.hashes[end * per - 1] == hashes[end * per - 1]
        ):
            engine = None  # another request under a reused id, or not this far yet
        for c in range(first, end):
            base = c * per
            block_hashes = tuple(hashes[base + per_block - 1 : base + per : per_block])
            self.events.annotate(
                keys[c],
                EventOrigin(
                    g.index,
                    c,
                    block_hashes[-1],
                    block_hashes,
                    hashes[base - 1] if c else None,
                    chunk_tokens(engine.token_ids, c * tpc, (c + 1) * tpc) if engine else None,
                    engine.adapter if engine else None,
                ),
            )

    def prompt_tail(
        self, hashes: Sequence[bytes], prompt_token_ids: Sequence[int], salt: bytes
    ) -> PromptTail | None:
        """The prompt's tail entry (see :func:`~kvsdk.scheduler.tail.prompt_tail`)."""
        tail = prompt_tail(
            self.ns_fp, self.groups, hashes, self.tokens_per_hash, prompt_token_ids, salt
        )
        if tail is not None and self.events.enabled:
            for g, key in zip(self.groups, tail.keys):
                self.events.annotate(key, EventOrigin(g.index, TAIL_CHUNK, b""))
        return tail

    def new_epoch(self, ns_fp: bytes) -> None:
        """Derive keys under ``ns_fp`` from now on (the old epoch's are forgotten)."""
        self.ns_fp = ns_fp
        for cache in self._cache:
            cache.clear()
