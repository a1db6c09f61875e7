"""Chunk keys from a request's engine hashes: per KV group, the key of each
whole chunk they name and of the prompt's tail, under the scheduler's epoch."""

from __future__ import annotations

from collections.abc import Sequence

from kvsdk.events import EventOrigin, EventTracker
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
                for c, h in enumerate(hashes, first):
                    events.annotate(keys[c], EventOrigin(g.index, c, h))

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
