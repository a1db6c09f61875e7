"""The prompt tail: the KV of a prompt's last, partial chunk, stored and loaded
as one more entry, so a repeated prompt recomputes only what the engine must.

An engine's prefix cache (and a chunk-keyed tier) stops at the last whole
block: a 700-token prompt on 128-token blocks is served up to token 640 and its
last 60 tokens are recomputed. The tail entry holds the blocks past the last
whole chunk (the last one partly filled) under a key that names exactly the
tokens it covers: the chain hash of the whole chunks before it, the tail's
token ids and the request's salt. A lookup that reaches the last whole chunk
and finds the tail serves the prompt to its end (the engine recomputes its
last token to sample the next one). Tails exist for models whose every KV
group is plain full attention, and only for prompts the adapter can name by
token ids alone (no multimodal inputs, no prompt embeddings).

The tail's slot bytes past its last token are whatever the engine block held
there; a load copies them too, and the engine writes its own tokens over them
before reading them (attention reads positions below the sequence length only).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvsdk.keys import ROOT_HASH, chunk_key, token_chunk_hashes
from kvsdk.transfer import BlockCopies
from kvsdk.types import ChunkKey, GroupKind, KVGroupSpec, LookupResult, cdiv

TAIL_CHUNK = -1
"""The chunk index a tail's event origin carries: not an engine block (an
adapter does not announce it as one)."""

TAIL_DOMAIN = b"kvsdk prompt tail v1"
"""Mixed into a tail's hash: a tail never shares a key with a whole chunk."""


@dataclass(slots=True)
class PromptTail:
    start: int
    """First token of the tail: the end of the prompt's last whole chunk."""
    end: int
    """The prompt's length."""
    keys: list[ChunkKey]
    """One entry per KV group."""
    stored: bool = False
    """A store of it was built (it is not stored twice by one request)."""


def tails_supported(groups: Sequence[KVGroupSpec]) -> bool:
    """Every group plain full attention with one chunk size: a tail is then a
    prefix extension every group can serve alike."""
    return (
        all(g.kind is GroupKind.FULL_ATTENTION and not g.eagle for g in groups)
        and len({g.tokens_per_chunk for g in groups}) == 1
    )


def prompt_tail(
    ns_fp: bytes,
    groups: Sequence[KVGroupSpec],
    hashes: Sequence[bytes],
    tokens_per_hash: int,
    prompt_token_ids: Sequence[int],
    salt: bytes = b"",
) -> PromptTail | None:
    """The tail of a prompt (None: it ends on a chunk boundary, or the engine's
    hashes do not reach its last whole chunk). ``salt`` is what else changes the
    prompt's KV (e.g. a tenant's cache salt); ``hashes`` the engine's chain hash
    per ``tokens_per_hash`` tokens."""
    chunk = groups[0].tokens_per_chunk
    end = len(prompt_token_ids)
    start = end // chunk * chunk
    if start == end:
        return None
    whole = start // tokens_per_hash
    if len(hashes) < whole:
        return None
    parent = hashes[whole - 1] if whole else ROOT_HASH
    (tail_hash,) = token_chunk_hashes(
        prompt_token_ids[start:end], end - start, parent=parent, extra=TAIL_DOMAIN + salt
    )
    keys = [chunk_key(ns_fp, tail_hash, g.index) for g in groups]
    return PromptTail(start, end, keys)


def tail_copies(
    tail: PromptTail,
    groups: Sequence[KVGroupSpec],
    block_ids: Sequence[Sequence[int]],
    slots: Sequence[int],
) -> list[BlockCopies]:
    """Per group, the copies between the engine blocks holding the tail's tokens
    and its slot (``slots[i]`` for group ``i``)."""
    out = []
    for gi, g in enumerate(groups):
        tpb = g.tokens_per_block
        eb = list(block_ids[gi][tail.start // tpb : cdiv(tail.end, tpb)])
        out.append(BlockCopies(g.index, eb, [slots[gi]] * len(eb), list(range(len(eb)))))
    return out


def tail_lookup(
    tail: PromptTail,
    lookup: Callable[[ChunkKey], LookupResult],
    being_loaded: Collection[ChunkKey],
) -> bool | None:
    """Whether every group's tail entry is readable now (None: some are on
    their way up from a slower tier, and none is missing: ask again)."""
    if any(k in being_loaded for k in tail.keys):
        return False  # another request's load pins it: serve the whole chunks only
    found = [lookup(k) for k in tail.keys]
    if all(f is LookupResult.HIT for f in found):
        return True
    return False if LookupResult.MISS in found else None


def tail_blocks_ready(
    tail: PromptTail, groups: Sequence[KVGroupSpec], block_ids: Sequence[Sequence[int]]
) -> bool:
    """Every group holds real (non-null) blocks for the whole tail."""
    for ids, g in zip(block_ids, groups):
        blocks = ids[tail.start // g.tokens_per_block : cdiv(tail.end, g.tokens_per_block)]
        if len(blocks) < cdiv(tail.end - tail.start, g.tokens_per_block) or 0 in blocks:
            return False
    return True
