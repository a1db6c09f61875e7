"""kvsdk's events in vLLM's KV-event wire format, indexable like vLLM's own.

vLLM publishes what its scheduler's ``take_events`` returns through its ZMQ
publisher (``--kv-events-config``). :class:`VLLMEventTranslator` turns kvsdk's
engine-neutral events (:mod:`kvsdk.events`) into the ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` vLLM's own block pool emits:

- a stored chunk is named per vLLM block, by vLLM's own block hashes (in the
  external form vLLM publishes: ``maybe_convert_block_hash``), with the hash
  of the block before it (``parent_block_hash``, None at a request's start),
  its ``token_ids``, vLLM's ``block_size``, ``group_idx`` and
  ``kv_cache_spec_kind`` (and sliding window) as vLLM fills them; chunks of
  one event that follow each other in one group are one ``BlockStored``, as
  vLLM announces a run of blocks;
- a removal names the same per-block hashes;
- each tier keeps its medium (``CPU``, ``DISK``, ``REMOTE``) and locality
  (``LOCAL``; ``REMOTE`` for a tier every instance reads); such a shared tier
  also names itself in ``ownership`` (``kvsdk:<backend>``), which KV-aware
  routers read as a shared cache pool rather than the engine's own memory;
- kvsdk's prompt tails (its own sub-block entries) are not vLLM blocks and
  stay unannounced; so is a chunk whose annotation the bounded annotation
  table dropped (kvsdk no longer knows vLLM's hashes for it).

A chunk computed with a LoRA adapter carries its ``lora_name`` (routers mix
it into their token hashes); vLLM's deprecated ``lora_id`` and its
``extra_keys`` (cache salt, multimodal identifiers) are not filled.

A chunk whose token ids are unknown (a request whose tokens alone do not name
its content, e.g. images) is announced with its hashes and no token ids, as
vLLM's native offloading connector does for what it cannot describe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvsdk.events import EventKind, EventOrigin, KVEvent
from kvsdk.types import GroupKind, KVGroupSpec, Locality


def spec_kinds(groups: Sequence[KVGroupSpec], use_mla: bool) -> list[tuple[str, int | None]]:
    """Per group, vLLM's ``kv_cache_spec_kind`` value and sliding window (the
    spec types kvsdk accepts: full attention, MLA, sliding window, Mamba)."""
    out: list[tuple[str, int | None]] = []
    for g in groups:
        if g.kind is GroupKind.SLIDING_WINDOW:
            out.append(
                ("sliding_window_mla" if use_mla else "sliding_window", g.sliding_window_tokens)
            )
        elif g.kind is GroupKind.MAMBA:
            out.append(("mamba", None))
        else:
            out.append(("mla_attention" if use_mla else "full_attention", None))
    return out


def _hash(h: Any) -> Any:
    return maybe_convert_block_hash(BlockHash(h))


class VLLMEventTranslator:
    """Translates batches of kvsdk events; holds no state between batches."""

    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        kinds: Sequence[tuple[str, int | None]],
        pools: Mapping[int, str],
    ) -> None:
        """``pools``: per shared tier (by index), the name its events give as
        ``ownership``."""
        self.block_size = {g.index: g.tokens_per_block for g in groups}
        self.kinds = {g.index: kind for g, kind in zip(groups, kinds, strict=True)}
        self.pools = dict(pools)

    def translate(self, events: Iterable[KVEvent]) -> Iterator[KVCacheEvent]:
        for ev in events:
            if ev.kind is EventKind.CLEARED:
                yield AllBlocksCleared()
                continue
            medium = ev.medium.value.upper()
            shared = ev.locality is Locality.CLUSTER
            locality = "REMOTE" if shared else "LOCAL"
            owner = self.pools.get(ev.tier) if shared else None
            # prompt tails are kvsdk's own entries, not vLLM blocks: not announced
            origins = [o for o in ev.info if isinstance(o, EventOrigin) and o.block_hashes]
            if not origins:
                continue
            if ev.kind is EventKind.STORED:
                for run in self._runs(origins):
                    yield self._stored(run, medium, locality, owner)
            else:
                yield from self._removed(origins, medium, locality, owner)

    @staticmethod
    def _runs(origins: list[EventOrigin]) -> Iterator[list[EventOrigin]]:
        """Consecutive chunks of one group, each following the one before."""
        run: list[EventOrigin] = []
        for o in origins:
            if run:
                prev = run[-1]
                if not (
                    o.group == prev.group
                    and o.parent_hash == prev.block_hashes[-1]
                    and (o.token_ids is None) == (prev.token_ids is None)
                    and o.adapter == prev.adapter
                ):
                    yield run
                    run = []
            run.append(o)
        if run:
            yield run

    def _stored(
        self, run: list[EventOrigin], medium: str, locality: str, owner: str | None
    ) -> BlockStored:
        first = run[0]
        tokens: list[int] = []
        for o in run:
            if o.token_ids is not None:
                tokens.extend(o.token_ids)
        kind, window = self.kinds[first.group]
        return BlockStored(
            block_hashes=[_hash(h) for o in run for h in o.block_hashes],
            parent_block_hash=None if first.parent_hash is None else _hash(first.parent_hash),
            token_ids=tokens,
            block_size=self.block_size[first.group],
            lora_id=None,
            medium=medium,
            lora_name=first.adapter,
            group_idx=first.group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=locality,
            ownership=owner,
        )

    @staticmethod
    def _removed(
        origins: list[EventOrigin], medium: str, locality: str, owner: str | None
    ) -> Iterator[BlockRemoved]:
        by_group: dict[int, list[Any]] = {}
        for o in origins:
            by_group.setdefault(o.group, []).extend(_hash(h) for h in o.block_hashes)
        for group, hashes in by_group.items():
            yield BlockRemoved(
                block_hashes=hashes,
                medium=medium,
                group_idx=group,
                locality=locality,
                ownership=owner,
            )
