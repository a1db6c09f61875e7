"""The lookup planner: how many tokens beyond the engine's own cache can be loaded.

Pure code over ``lookup(key) -> LookupResult``. The answer is the largest
token boundary ``T`` (``computed < T <= cap``) at which *every* KV group can
resume from stored chunks:

- a full-attention group needs every chunk from the first one the engine
  lacks up to the one holding token ``T - 1`` (prefix scan);
- a sliding-window group needs only the chunks covering the last
  ``window - 1`` tokens before ``T`` (suffix-window scan);
- a Mamba group needs the state at ``T`` exactly: ``T`` on its chunk
  boundary, that one chunk stored;
- an EAGLE group's last stored chunk is volatile, so it needs one more chunk
  than it claims;
- every group must gain at least one whole chunk (``T - computed >= chunk``).

Groups tighten each other's boundary, so the scan loops until ``T`` stops
moving (the convergence loop); the fixed point is the largest boundary valid
for all groups. ``cap`` is the request's length, the engine's
``max_num_new_tokens``, the per-request load budget, one token less when a
sliding-window or Mamba group must recompute the last prompt token, and the
Mamba alignment.

Deferral: ``HIT_PENDING`` and ``RETRY`` count as present while searching; if
any chunk the answer relies on is not a plain ``HIT``, the answer is "ask
again next step" (``None``). So is a hit on chunks another request is still
loading. A partial tail (a stored boundary inside the next block) may extend
the answer past the last whole chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple

from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, LookupResult, cdiv, round_down

LookupFn = Callable[[ChunkKey], LookupResult]
BeingLoaded = Mapping[ChunkKey, int] | AbstractSet[ChunkKey]
"""Chunks other requests are loading right now (a count per key, or a set)."""
LookupRunFn = Callable[[Sequence[ChunkKey], int, int], tuple[int, int]]
"""``lookup_run(keys, start, stop) -> (present_end, hit_end)``: ``lookup`` over
``keys[start:stop]`` up to the first MISS; ``keys[start:present_end]`` are
present, ``keys[start:hit_end]`` plain HITs (see ``TieredStore.lookup_run``)."""
BoundaryKeyFn = Callable[[int, int], ChunkKey]
"""``boundary_key(group_index, boundary_tokens)`` for partial-tail entries."""

_PRESENT = (LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)


@dataclass(slots=True)
class PlanRequest:
    """One request as the planner sees it (filled by an adapter)."""

    req_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    group_keys: Sequence[Sequence[ChunkKey]]
    """Per group (in the planner's group order): keys of the request's full chunks."""
    max_load_tokens: int | None = None
    boundary_key: BoundaryKeyFn | None = None


class Plan(NamedTuple):
    num_hit_tokens: int
    """Tokens to load beyond ``num_computed_tokens`` (0: nothing to load)."""
    partial_tail_boundary: int | None = None
    """Set when the last loaded piece is a partial-tail entry ending here."""


class _Memo:
    """Per-plan memo: each key is asked once per planning call."""

    __slots__ = ("cache", "fn")

    def __init__(self, fn: LookupFn) -> None:
        self.fn = fn
        self.cache: dict[ChunkKey, LookupResult] = {}

    def __call__(self, key: ChunkKey) -> LookupResult:
        r = self.cache.get(key)
        if r is None:
            r = self.cache[key] = self.fn(key)
        return r


class LookupPlanner:
    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        *,
        mamba_align_tokens: int | None = None,
        partial_tail_block_tokens: int = 0,
        tokens_per_hash: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("at least one KV group is needed")
        self.groups = tuple(groups)
        kind_order = {GroupKind.FULL_ATTENTION: 0, GroupKind.SLIDING_WINDOW: 1, GroupKind.MAMBA: 2}
        # Full attention first (cheap prefix scans tighten most), then the widest windows.
        self._order = sorted(
            range(len(self.groups)),
            key=lambda i: (
                kind_order[self.groups[i].kind],
                -(self.groups[i].sliding_window_tokens or 0),
            ),
        )
        self._recompute_last = any(g.kind is not GroupKind.FULL_ATTENTION for g in self.groups)
        self._prefix_only = all(
            g.kind is GroupKind.FULL_ATTENTION and not g.eagle for g in self.groups
        )
        """Every group is a plain prefix scan: one ``lookup_run`` per group answers it."""
        self._chunk_tokens = [g.tokens_per_chunk for g in self.groups]
        self.mamba_align_tokens = mamba_align_tokens
        self.partial_tail_block_tokens = partial_tail_block_tokens
        self.tokens_per_hash = tokens_per_hash or self.groups[0].tokens_per_block
        if partial_tail_block_tokens and partial_tail_block_tokens % self.tokens_per_hash:
            raise ValueError("partial tail block size must be a multiple of tokens_per_hash")

    # -- the public call ------------------------------------------------------------
    def plan(
        self,
        req: PlanRequest,
        lookup: LookupFn,
        *,
        max_num_new_tokens: int | None = None,
        being_loaded: BeingLoaded | None = None,
        lookup_run: LookupRunFn | None = None,
    ) -> Plan | None:
        """``lookup_run`` (optional, same answers as ``lookup``) lets plain
        full-attention models scan each group's prefix in one call."""
        memo: _Memo | None = None  # shared by the scans below: each key is asked once
        computed = req.num_computed_tokens
        if lookup_run is not None and self._prefix_only:
            complete = self._prefix_end(req, lookup_run, max_num_new_tokens)
        else:
            memo = _Memo(lookup)
            complete = self._complete_chunks_end(req, memo, max_num_new_tokens)
        if complete is None:
            return None
        end = complete or computed
        if complete and being_loaded is not None and self._any_being_loaded(req, end, being_loaded):
            return None
        if self.partial_tail_block_tokens and req.boundary_key is not None:
            if memo is None:
                memo = _Memo(lookup)
            tail, pending = self._partial_tail(req, memo, end, max_num_new_tokens)
            if tail is not None:
                return tail
            if pending and end == computed:
                return None  # only a not-yet-readable tail could hit: ask again
        return Plan(end - computed)

    # -- complete chunks -------------------------------------------------------------------
    def cap(self, req: PlanRequest, max_num_new_tokens: int | None) -> int:
        computed = req.num_computed_tokens
        cap = req.num_tokens
        if max_num_new_tokens is not None:
            cap = min(cap, computed + max_num_new_tokens)
        if req.max_load_tokens is not None:
            cap = min(cap, computed + req.max_load_tokens)
        if self._recompute_last:
            cap = min(cap, req.num_tokens - 1)
        if self.mamba_align_tokens:
            cap = round_down(cap, self.mamba_align_tokens)
        for keys, tpc in zip(req.group_keys, self._chunk_tokens):
            cap = min(cap, len(keys) * tpc)
        return cap

    def _complete_chunks_end(
        self, req: PlanRequest, memo: _Memo, max_num_new_tokens: int | None
    ) -> int | None:
        """The converged boundary (0 when nothing loads), or None to defer."""
        computed = req.num_computed_tokens
        end = self.cap(req, max_num_new_tokens)
        if end <= computed:
            return 0
        while True:
            moved = False
            for i in self._order:
                best = self._group_best_end(i, req, memo, end)
                if best == 0:
                    return 0
                if best < end:
                    end, moved = best, True
            if not moved:
                break
        for i in self._order:
            g = self.groups[i]
            keys = req.group_keys[i]
            if any(memo(keys[c]) is not LookupResult.HIT for c in self._needed(g, computed, end)):
                return None
        return end

    def _prefix_end(
        self, req: PlanRequest, lookup_run: LookupRunFn, max_num_new_tokens: int | None
    ) -> int | None:
        """``_complete_chunks_end`` when every group is a plain prefix scan:
        each group's run of present chunks is read once, then the convergence
        loop is arithmetic."""
        computed = req.num_computed_tokens
        end = self.cap(req, max_num_new_tokens)
        if end <= computed:
            return 0
        align = req.max_load_tokens is not None
        runs = []
        for i in self._order:
            tpc = self.groups[i].tokens_per_chunk
            present, hit = lookup_run(req.group_keys[i], computed // tpc, cdiv(end, tpc))
            runs.append((tpc, present, hit))
        moved = True
        while moved:
            moved = False
            for tpc, present, _ in runs:
                best = round_down(end, tpc) if align else end
                if present < cdiv(best, tpc):
                    best = present * tpc
                if best - computed < tpc:
                    return 0
                if best < end:
                    end, moved = best, True
        if any(hit < cdiv(end, tpc) for tpc, _, hit in runs):
            return None  # a chunk the answer needs is not readable yet
        return end

    def _needed(self, g: KVGroupSpec, computed: int, end: int) -> range:
        rng = g.needed_chunks(computed, end)
        return range(rng.start, rng.stop + 1) if g.eagle else rng

    def _group_best_end(self, i: int, req: PlanRequest, memo: _Memo, limit: int) -> int:
        """Largest boundary ``<= limit`` valid for group ``i`` alone, or 0."""
        g = self.groups[i]
        keys = req.group_keys[i]
        tpc = g.tokens_per_chunk
        computed = req.num_computed_tokens
        extra = int(g.eagle)
        must_align = g.kind is GroupKind.MAMBA or req.max_load_tokens is not None
        end = round_down(limit, tpc) if must_align else limit
        # the needed range must fit in the request's stored keys
        end = min(end, (len(keys) - extra) * tpc)
        if g.kind is GroupKind.FULL_ATTENTION:
            start = computed // tpc
            stop = cdiv(end, tpc) + extra
            present = start
            while present < stop and memo(keys[present]) in _PRESENT:
                present += 1
            if present < stop:
                end = (present - extra) * tpc
            return end if end - computed >= tpc else 0
        while end - computed >= tpc:
            rng = self._needed(g, computed, end)
            miss = next((c for c in reversed(rng) if memo(keys[c]) not in _PRESENT), None)
            if miss is None:
                return end
            # the next candidate's needed range must end left of the miss
            end = min(round_down(end - 1, tpc), (miss - extra) * tpc)
        return 0

    def _any_being_loaded(self, req: PlanRequest, end: int, being_loaded: BeingLoaded) -> bool:
        if not being_loaded:
            return False
        view = being_loaded.keys() if isinstance(being_loaded, dict | Mapping) else being_loaded
        for i, g in enumerate(self.groups):
            rng = g.needed_chunks(req.num_computed_tokens, end)
            if not view.isdisjoint(req.group_keys[i][rng.start : rng.stop]):  # one C-level pass
                return True
        return False

    # -- partial tail ------------------------------------------------------------------------
    def _partial_tail(
        self, req: PlanRequest, memo: _Memo, complete_end: int, max_num_new_tokens: int | None
    ) -> tuple[Plan | None, bool]:
        """The largest readable partial-tail boundary past ``complete_end``
        (or None), and whether a not-yet-readable one was seen."""
        assert req.boundary_key is not None
        computed = req.num_computed_tokens
        tph = self.tokens_per_hash
        hi = min(req.num_prompt_tokens - 1, complete_end + self.partial_tail_block_tokens - 1)
        if max_num_new_tokens is not None:
            hi = min(hi, computed + max_num_new_tokens)
        if req.max_load_tokens is not None:
            hi = min(hi, computed + req.max_load_tokens)
        hi = round_down(hi, tph)
        pending = False
        for boundary in range(hi, complete_end, -tph):
            boundary_pending = False
            for g in self.groups:
                r = memo(req.boundary_key(g.index, boundary))
                if r is LookupResult.MISS:
                    break
                boundary_pending |= r is not LookupResult.HIT
            else:
                if not boundary_pending:
                    return Plan(boundary - computed, partial_tail_boundary=boundary), pending
                pending = True
        return None, pending
