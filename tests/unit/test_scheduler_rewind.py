"""A request whose engine hashes are rewound (vLLM's streaming sessions: the
next input replaces the last sampled token, and the hash of the block that
held it is dropped and computed again) never loads or stores a chunk keyed by
a hash the engine no longer holds: kvsdk drops its copy of the hashes from the
first that differs, the keys and store plans past it, and the prompt tail the
rewind reaches; stores of withdrawn chunks still in flight are not trusted."""

from __future__ import annotations

import hashlib

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace, chunk_key
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.scheduler.request import RequestState, follow_hashes
from kvsdk.scheduler.tail import PromptTail
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4  # tokens per block = per chunk
GROUPS = [KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)]

TURN1 = list(range(10, 17))  # 7 prompt tokens: a whole block and a 3-token tail
SAMPLED = 99  # the token the first turn sampled last (its KV never computed)
UPDATE = list(range(50, 63))  # the session's next input (13 tokens), replacing SAMPLED


def make() -> OffloadScheduler:
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}), ns, 256)
    return OffloadScheduler(GROUPS, ns, store)


def chain(tokens: list[int]) -> list[bytes]:
    """An engine's block hashes: one per whole block, chained."""
    out, prev = [], b""
    for b in range(len(tokens) // TPB):
        prev = hashlib.sha256(prev + bytes(tokens[b * TPB : (b + 1) * TPB])).digest()
        out.append(prev)
    return out


def add(s: OffloadScheduler, rid: str, tokens: list[int]) -> None:
    s.add_request(rid, num_prompt_tokens=len(tokens), block_hashes=chain(tokens),
                  prompt_token_ids=tokens)  # fmt: skip


def computed(
    s: OffloadScheduler, rid: str, upto: int, blocks: list[int]
) -> list[tuple[bytes, ...]]:
    """A step computing ``rid`` up to ``upto`` tokens in ``blocks`` (its full
    list); every store of it lands. Returns the keys of each store job."""
    jobs = s.build_step(computed_after_step={rid: upto}, new_block_ids={rid: [blocks]},
                        replace_block_ids=[rid])  # fmt: skip
    keys = [s.ledger.job(j.job_id).keys for j in jobs.stores]
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    return keys


def first_turn(s: OffloadScheduler) -> None:
    """Session "s": its prompt computed (chunk 0 and the tail stored), a token
    sampled that completes block 1, and kvsdk shown the hashes then."""
    add(s, "s", TURN1)
    s.lookup("s", 0)
    computed(s, "s", len(TURN1), [1, 2])
    s.hashes_grew("s", chain([*TURN1, SAMPLED]))  # block 1 hashed with the sampled token


def test_a_rewound_block_is_stored_under_its_new_hash_never_the_dropped_one() -> None:
    s = make()
    first_turn(s)
    session = [*TURN1, *UPDATE]  # the sampled token dropped, the next input appended
    s.hashes_grew("s", chain(session))
    # its next input is a prompt to vLLM, generated tokens to kvsdk: stored in a batch
    (keys,) = computed(s, "s", len(session), [1, 2, 3, 4, 5])
    new = chain(session)
    assert list(keys) == [chunk_key(s.ns_fp, h, 0) for h in new[1:5]]
    stale = chain([*TURN1, SAMPLED])[1]
    assert chunk_key(s.ns_fp, stale, 0) not in keys
    # the first turn's content, sampled token and all, finds chunk 0 only: block 1's
    # KV (computed with the next input's first token there) is not filed under its hash
    add(s, "original", [*TURN1, SAMPLED, *UPDATE[1:]])
    assert s.lookup("original", 0) == TPB
    add(s, "again", session)
    assert s.lookup("again", 0) == len(session)


def test_a_rewound_request_never_loads_a_chunk_keyed_by_a_dropped_hash() -> None:
    """Another request stored the first turn's content with the sampled token
    (the same hashes): the rewound session, preempted and looked up again, must
    not load it (its position 7 is the next input's, not the sampled token)."""
    s = make()
    other = [*TURN1, SAMPLED]
    add(s, "other", other)
    assert s.lookup("other", 0) == 0
    computed(s, "other", len(other), [5, 6])
    s.request_finished("other", len(other))
    s.build_step(computed_after_step={}, finished={"other": len(other)})
    first_turn(s)
    session = [*TURN1, *UPDATE]
    s.hashes_grew("s", chain(session))
    s.build_step(computed_after_step={}, preempted=["s"])
    assert s.lookup("s", 0, num_tokens=len(session)) == TPB  # chunk 0; block 1 differs


def test_stores_in_flight_of_a_withdrawn_chunk_land_as_misses() -> None:
    """A rewind reaching a chunk whose store is in flight (the engine rewrites
    its block): the store completes as failed whatever the worker reports."""
    s = make()
    tokens = list(range(10, 18))  # two whole blocks
    add(s, "r", tokens)
    assert s.lookup("r", 0) == 0
    jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [[1, 2]]},
                        replace_block_ids=["r"])  # fmt: skip
    (job,) = jobs.stores
    s.hashes_grew("r", chain([*tokens[:7], 77]))  # block 1 rewound
    s.worker_results([WorkerResult(job.job_id)])  # the worker copied (a rewritten block)
    add(s, "repeat", [*tokens, 1])
    assert s.lookup("repeat", 0) == 0  # neither chunk of the job is trusted


def state(tokens: list[int], tail: PromptTail | None = None) -> RequestState:
    hashes = chain(tokens)
    return RequestState(
        req_id="r",
        num_prompt_tokens=len(tokens),
        num_tokens=len(tokens),
        hashes=list(hashes),
        block_ids=[[]],
        keys=[[chunk_key(b"ns", h, 0) for h in hashes]],
        next_store_chunk=[len(hashes)],
        tail=tail,
    )


def test_growth_is_no_rewind_and_keeps_every_key() -> None:
    tokens = list(range(10, 22))
    r = state(tokens[:8])
    keys = list(r.keys[0])
    assert follow_hashes(r, chain(tokens), GROUPS, TPB) is None
    assert r.hashes == chain(tokens) and r.keys[0] == keys and r.next_store_chunk == [2]
    assert follow_hashes(r, chain(tokens), GROUPS, TPB) is None  # the same list again


def test_a_shorter_or_differing_list_withdraws_the_chunks_past_the_cut() -> None:
    tokens = list(range(10, 22))  # three blocks
    r = state(tokens)
    assert follow_hashes(r, chain(tokens[:4]), GROUPS, TPB) == 2  # shorter: chunks 1, 2 go
    assert r.hashes == chain(tokens[:4]) and len(r.keys[0]) == 1 and r.next_store_chunk == [1]
    r = state(tokens)
    changed = [*tokens[:6], 0, *tokens[7:]]  # block 1 differs, so does block 2 (chained)
    assert follow_hashes(r, chain(changed), GROUPS, TPB) == 2
    assert r.hashes == chain(changed) and len(r.keys[0]) == 1 and r.next_store_chunk == [1]


def test_a_rewind_reaching_the_prompt_tail_drops_it() -> None:
    tokens = list(range(10, 22))
    kept = state(tokens, PromptTail(4, 6, [b"k" * 16]))
    follow_hashes(kept, chain([*tokens[:11], 0]), GROUPS, TPB)  # cut at token 8
    assert kept.tail is not None
    reached = state(tokens, PromptTail(4, 6, [b"k" * 16]))
    follow_hashes(reached, chain([*tokens[:5], 0, *tokens[6:]]), GROUPS, TPB)  # cut at 4
    assert reached.tail is None
