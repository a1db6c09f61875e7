"""The core's part of prefill/decode disaggregation: a loading-only scheduler
(``stores=False``, a decode engine) builds no store and holds no block, and a
prefill's hand-off (tokens covered, digest of the keys) matches exactly the
decode scheduler's own keys for the same prompt under the same namespace."""

from __future__ import annotations

import hashlib

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import OffloadScheduler
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4  # tokens per block = per chunk


def make(*, stores: bool = True, tenant: str = "") -> OffloadScheduler:
    ns = Namespace(
        "m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB, tenant_salt=tenant
    )
    store = build_store(
        load_config({"chunk_tokens": TPB, "tiers": [{"backend": "cpu", "capacity": "1MiB"}]}),
        ns,
        256,
    )
    return OffloadScheduler(
        [KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store, stores=stores
    )


def chain(n: int, salt: bytes = b"") -> list[bytes]:
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


PROMPT = list(range(100, 110))  # 2 whole chunks and a 2-token tail


def add(s: OffloadScheduler, rid: str, tokens: list[int] = PROMPT) -> None:
    s.add_request(
        rid,
        num_prompt_tokens=len(tokens),
        block_hashes=chain(len(tokens) // TPB, bytes(tokens[:1])),
        prompt_token_ids=tokens,
    )


def test_a_loading_only_scheduler_stores_nothing_and_holds_nothing() -> None:
    s = make(stores=False)
    add(s, "r")
    assert s.lookup("r", 0) == 0
    jobs = s.build_step(
        computed_after_step={"r": len(PROMPT)},
        new_block_ids={"r": [[1, 2, 3]]},
        replace_block_ids=["r"],
    )
    assert not jobs.stores
    assert s.request_finished("r", len(PROMPT)) is False  # nothing to store: blocks free at once
    jobs = s.build_step(computed_after_step={}, finished={"r": len(PROMPT)})
    assert not jobs.stores and s.num_tracked_requests() == 0 and not s.has_pending_work()


def test_a_hand_off_covers_the_prompt_and_its_digest_is_the_decodes_own() -> None:
    p, d = make(), make(stores=False)
    add(p, "r")
    tokens, digest = p.handoff("r", len(PROMPT))
    assert tokens == len(PROMPT)  # the whole chunks and the tail
    add(d, "x")
    assert d.handoff_digest("x", tokens) == digest
    assert d.handoff_digest("x", 2 * TPB) != digest  # another split of the prompt
    add(d, "y", [*PROMPT[:-1], 7])  # another last token: another tail
    assert d.handoff_digest("y", tokens) != digest
    other = make(stores=False, tenant="acme")  # another namespace: other keys
    add(other, "x")
    assert other.handoff_digest("x", tokens) != digest
    assert d.handoff_digest("x", len(PROMPT) + TPB) is None  # past what its keys name


def test_a_prompt_without_its_tail_hands_off_its_whole_chunks() -> None:
    p = make()
    p.add_request("r", num_prompt_tokens=len(PROMPT), block_hashes=chain(2, bytes(PROMPT[:1])))
    tokens, _ = p.handoff("r", len(PROMPT))
    assert tokens == 2 * TPB
