"""kvsdk's events as vLLM's KV events (``kvsdk.plugins.vllm.kv_events``): the
core's real key derivation (``ChunkKeys``) annotates chunks from hashes made
by vLLM's own block hasher; the translation's output is encoded as vLLM's
publisher does (msgspec ``EventBatch``) and decoded with vLLM's
``KVEventBatch``. Checked: per-block hashes equal to vLLM's, the parent hash,
the token ids, the block size, the group and spec kind; removals naming the
same hashes after the token ids are dropped; the medium, locality and pool of
each tier; prompt tails, unknown tokens and reused request ids."""

from __future__ import annotations

import random

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from kvsdk.events import EventKind, EventOrigin, EventTracker, RequestTokens
from kvsdk.plugins.vllm.kv_events import VLLMEventTranslator, spec_kinds
from kvsdk.scheduler.chunk_keys import ChunkKeys
from kvsdk.scheduler.request import RequestState
from kvsdk.types import GroupKind, KVGroupSpec, Locality, Medium

HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)
TOKENS = [random.Random(1).randrange(32000) for _ in range(24)]


def vllm_hashes(tokens: list[int], tokens_per_hash: int) -> list[bytes]:
    """vLLM's own block hashes of ``tokens`` (its hasher, its chaining)."""
    out: list[bytes] = []
    for i in range(0, len(tokens) - tokens_per_hash + 1, tokens_per_hash):
        out.append(
            hash_block_tokens(HASH_FN, out[-1] if out else None, tokens[i : i + tokens_per_hash])
        )
    return out


class Rig:
    """Chunks of 2 vLLM blocks of 4 tokens, hashed every ``tokens_per_hash``."""

    def __init__(self, tokens_per_hash: int = 4, tiers: int = 1) -> None:
        self.group = KVGroupSpec(
            0, GroupKind.FULL_ATTENTION, tokens_per_block=4, blocks_per_chunk=2
        )
        self.events = EventTracker()
        self.events.last_tier = tiers - 1
        self.engine: dict[str, RequestTokens] = {}
        self.events.token_source = lambda key: self.engine.get(
            key if isinstance(key, str) else key[0]
        )
        self.keys = ChunkKeys([self.group], tokens_per_hash, b"ns", self.events)
        self.tokens_per_hash = tokens_per_hash
        self.translator = VLLMEventTranslator(
            [self.group], spec_kinds([self.group], use_mla=False), {1: "kvsdk:redis"}
        )

    def request(self, rid: str, tokens: list[int], *, known: bool = True) -> RequestState:
        hashes = vllm_hashes(tokens, self.tokens_per_hash)
        if known:
            self.engine[rid] = RequestTokens(hashes, tokens)
        r = RequestState(rid, len(tokens), len(tokens), list(hashes), [[]], [[]], [0])
        self.keys.refresh(r)
        return r

    def publish(self, kind: EventKind, keys: list[bytes], tier: int = 0) -> list[object]:
        medium, locality = [(Medium.CPU, Locality.PROCESS), (Medium.REMOTE, Locality.CLUSTER)][tier]
        self.events.record(kind, keys, tier=tier, medium=medium, locality=locality)
        events = list(self.translator.translate(self.events.take_events()))
        # the ZMQ payload vLLM's publisher sends, decoded with vLLM's own types
        wire = msgspec.msgpack.encode(EventBatch(ts=1.0, events=events))
        decoded = msgspec.msgpack.decode(wire, type=KVEventBatch)
        assert decoded.events == events
        return list(decoded.events)


def ext(h: bytes) -> object:
    return maybe_convert_block_hash(h)


def test_stored_chunks_are_vllm_blocks_with_parent_tokens_size_and_spec() -> None:
    rig = Rig()
    r = rig.request("a", TOKENS)
    blocks = vllm_hashes(TOKENS, 4)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][1:3])
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [ext(h) for h in blocks[2:6]]  # one per vLLM block, not per chunk
    assert ev.parent_block_hash == ext(blocks[1])
    assert ev.token_ids == TOKENS[8:24]
    assert ev.block_size == 4
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == (
        0,
        "full_attention",
        None,
    )
    assert (ev.medium, ev.locality, ev.ownership, ev.lora_name) == ("CPU", "LOCAL", None, None)


def test_a_request_start_has_no_parent() -> None:
    rig = Rig()
    r = rig.request("a", TOKENS)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][:1])
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is None and ev.token_ids == TOKENS[:8]


def test_hashes_finer_than_blocks_name_each_block_by_its_last_hash() -> None:
    rig = Rig(tokens_per_hash=2)
    r = rig.request("a", TOKENS)
    fine = vllm_hashes(TOKENS, 2)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][1:2])
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [ext(fine[5]), ext(fine[7])]  # blocks 2, 3 end at hashes 5, 7
    assert ev.parent_block_hash == ext(fine[3])
    assert ev.block_size == 4 and ev.token_ids == TOKENS[8:16]


def test_chunks_that_do_not_follow_each_other_are_announced_apart() -> None:
    rig = Rig()
    r = rig.request("a", TOKENS)
    blocks = vllm_hashes(TOKENS, 4)
    first, last = rig.publish(EventKind.STORED, [r.keys[0][0], r.keys[0][2]])
    assert isinstance(first, BlockStored) and isinstance(last, BlockStored)
    assert first.block_hashes == [ext(blocks[0]), ext(blocks[1])]
    assert last.parent_block_hash == ext(blocks[3]) and last.token_ids == TOKENS[16:24]


def test_removals_name_the_same_hashes_after_the_token_ids_are_dropped() -> None:
    rig = Rig(tiers=2)
    r = rig.request("a", TOKENS)
    keys = r.keys[0][:2]
    rig.publish(EventKind.STORED, keys, tier=0)
    (shared,) = rig.publish(EventKind.STORED, keys, tier=1)  # the deepest tier: tokens go
    assert isinstance(shared, BlockStored) and shared.token_ids == TOKENS[:16]
    assert all(rig.events._annotations[k].token_ids is None for k in keys)
    (removed,) = rig.publish(EventKind.REMOVED, keys, tier=0)
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == shared.block_hashes
    assert (removed.medium, removed.group_idx, removed.locality) == ("CPU", 0, "LOCAL")


def test_token_ids_stay_until_the_deepest_tier_stored_them() -> None:
    rig = Rig(tiers=2)
    r = rig.request("a", TOKENS)
    rig.publish(EventKind.STORED, r.keys[0][:1], tier=0)
    assert rig.events._annotations[r.keys[0][0]].token_ids is not None


def test_a_shared_tier_is_a_remote_pool() -> None:
    rig = Rig(tiers=2)
    r = rig.request("a", TOKENS)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][:1], tier=1)
    assert isinstance(ev, BlockStored)
    assert (ev.medium, ev.locality, ev.ownership) == ("REMOTE", "REMOTE", "kvsdk:redis")
    (gone,) = rig.publish(EventKind.REMOVED, r.keys[0][:1], tier=1)
    assert isinstance(gone, BlockRemoved) and gone.ownership == "kvsdk:redis"


def test_prompt_tails_are_not_announced() -> None:
    rig = Rig()
    rig.events.annotate(b"tail", EventOrigin(0, -1, b""))
    assert rig.publish(EventKind.STORED, [b"tail"]) == []
    assert rig.publish(EventKind.REMOVED, [b"tail"]) == []


def test_unknown_tokens_announce_hashes_only() -> None:
    rig = Rig()
    r = rig.request("a", TOKENS, known=False)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][:1])
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == [] and len(ev.block_hashes) == 2


def test_a_reused_request_id_gives_no_foreign_tokens() -> None:
    rig = Rig()
    other = [t + 1 for t in TOKENS]
    rig.engine["a"] = RequestTokens(vllm_hashes(other, 4), other)  # another request, same id
    hashes = vllm_hashes(TOKENS, 4)
    r = RequestState("a", 24, 24, list(hashes), [[]], [[]], [0])
    rig.keys.refresh(r)
    (ev,) = rig.publish(EventKind.STORED, r.keys[0][:1])
    assert isinstance(ev, BlockStored) and ev.token_ids == []


def test_a_cleared_tier_clears() -> None:
    rig = Rig()
    assert rig.publish(EventKind.CLEARED, []) == [AllBlocksCleared()]


@pytest.mark.parametrize(
    ("kind", "mla", "expected"),
    [
        (GroupKind.FULL_ATTENTION, False, ("full_attention", None)),
        (GroupKind.FULL_ATTENTION, True, ("mla_attention", None)),
        (GroupKind.SLIDING_WINDOW, False, ("sliding_window", 64)),
        (GroupKind.MAMBA, False, ("mamba", None)),
    ],
)
def test_spec_kinds_are_vllms(kind: GroupKind, mla: bool, expected: tuple[str, int | None]) -> None:
    window = 64 if kind is GroupKind.SLIDING_WINDOW else None
    group = KVGroupSpec(0, kind, 16, 1, sliding_window_tokens=window)
    assert spec_kinds([group], mla) == [expected]
