"""``load_copies``: the engine blocks a load fills and the chunk each reads."""

from __future__ import annotations

from kvsdk.scheduler.request import RequestState, load_copies
from kvsdk.scheduler.tail import PromptTail
from kvsdk.types import GroupKind, KVGroupSpec


def state(block_ids: list[int], keys: list[bytes], computed: int) -> RequestState:
    return RequestState(
        req_id="r",
        num_prompt_tokens=64,
        num_tokens=64,
        hashes=[],
        block_ids=[block_ids],
        keys=[keys],
        next_store_chunk=[0],
        num_computed_local=computed,
    )


def test_two_blocks_per_chunk_one_chunk_loaded() -> None:
    """A chunk of two blocks: both read the one chunk, at offsets 0 and 1
    (a block-per-chunk shortcut would name two chunks)."""
    g = KVGroupSpec(0, GroupKind.FULL_ATTENTION, 4, 2)
    r = state([7, 8, 9, 10, 11, 12, 13, 14], [b"c0", b"c1", b"c2", b"c3"], computed=8)
    keys, ((_, blocks, block_keys, offsets),) = load_copies(r, [g], end=16)
    assert (keys, blocks, block_keys, offsets) == ([b"c1"], [9, 10], [b"c1", b"c1"], [0, 1])


def test_one_block_per_chunk_with_the_prompt_tail_last() -> None:
    g = KVGroupSpec(0, GroupKind.FULL_ATTENTION, 4, 1)
    r = state([7, 8, 9], [b"c0", b"c1"], computed=0)
    r.tail = PromptTail(8, 11, [b"tail"])
    keys, ((_, blocks, block_keys, offsets),) = load_copies(r, [g], end=11)
    assert (keys, blocks, block_keys, offsets) == (
        [b"c0", b"c1", b"tail"], [7, 8, 9], [b"c0", b"c1", b"tail"], [0, 0, 0],
    )  # fmt: skip


def test_a_null_block_is_skipped() -> None:
    g = KVGroupSpec(0, GroupKind.FULL_ATTENTION, 4, 1)
    r = state([0, 8, 9], [b"c0", b"c1", b"c2"], computed=0)
    keys, ((_, blocks, block_keys, _),) = load_copies(r, [g], end=12)
    assert (keys, blocks, block_keys) == ([b"c1", b"c2"], [8, 9], [b"c1", b"c2"])
