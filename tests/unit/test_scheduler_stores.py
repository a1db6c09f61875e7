"""When the scheduler side stores what: prompt chunks at once, generated chunks in
batches of ``DECODE_STORE_CHUNKS``, the rest at finish, each new chunk once per step."""

from __future__ import annotations

import hashlib

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import DECODE_STORE_CHUNKS, OffloadScheduler, StepJobs, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4  # tokens per block = per chunk


def make(kind: GroupKind = GroupKind.FULL_ATTENTION) -> OffloadScheduler:
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(
        load_config({"chunk_tokens": TPB, "tiers": [{"backend": "cpu", "capacity": "1MiB"}]}),
        ns,
        256,
    )
    return OffloadScheduler([KVGroupSpec(0, kind, TPB, 1)], ns, store)


def chain(n: int, salt: bytes = b"") -> list[bytes]:
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


def stored_chunks(s: OffloadScheduler, jobs: object) -> list[int]:
    """Engine blocks the step's store jobs copy (block id == chunk index + 1 here)."""
    blocks = [b - 1 for j in jobs.stores for c in j.copies for b in c.engine_blocks]  # type: ignore[attr-defined]
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])  # type: ignore[attr-defined]
    return blocks


def test_prompt_chunks_at_once_generated_ones_in_batches_and_the_rest_at_finish() -> None:
    s = make()
    prompt = 10  # 2 full chunks + 2 tokens
    hashes = chain(2)
    s.add_request("r", num_prompt_tokens=prompt, block_hashes=hashes)
    assert s.lookup("r", 0) == 0
    blocks = list(range(1, 20))
    jobs = s.build_step(computed_after_step={"r": prompt}, new_block_ids={"r": [blocks]},
                        replace_block_ids=["r"])  # fmt: skip
    assert stored_chunks(s, jobs) == [0, 1]
    # the next chunk ends past the prompt: due once DECODE_STORE_CHUNKS chunks are complete
    assert s.store_due["r"] == (2 + DECODE_STORE_CHUNKS) * TPB
    # decode: chunks 2, 3, ... complete every 4 tokens; stored DECODE_STORE_CHUNKS at a time
    tokens, seen = prompt, []
    while tokens < prompt + TPB * DECODE_STORE_CHUNKS + 2:
        tokens += 1
        while len(hashes) < tokens // TPB:
            hashes.append(chain(1, hashes[-1])[0])  # the engine hashes each new full block
        s.hashes_grew("r", hashes)
        seen.append(stored_chunks(s, s.build_step(computed_after_step={"r": tokens})))
    batches = [b for b in seen if b]
    assert batches == [list(range(2, 2 + DECODE_STORE_CHUNKS))]
    s.request_finished("r")
    final = stored_chunks(s, s.build_step(computed_after_step={}, finished={"r": tokens}))
    assert final == [2 + DECODE_STORE_CHUNKS]  # the chunk completed after the batch
    assert s.ledger.is_empty() and s.num_tracked_requests() == 0 and not s.store_due


def test_two_requests_with_the_same_new_chunk_in_one_step_copy_it_once() -> None:
    s = make()
    hashes = chain(3)
    for rid in ("a", "b"):
        s.add_request(rid, num_prompt_tokens=12, block_hashes=hashes)
        assert s.lookup(rid, 0) == 0
    jobs = s.build_step(
        computed_after_step={"a": 12, "b": 12},
        new_block_ids={"a": [[1, 2, 3]], "b": [[4, 5, 6]]},
        replace_block_ids=["a", "b"],
    )
    copied = [b for j in jobs.stores for c in j.copies for b in c.engine_blocks]
    assert sorted(copied) == [1, 2, 3]  # "a" claimed every slot; "b" writes none
    slots = [sl for j in jobs.stores for c in j.copies for sl in c.slots]
    assert len(set(slots)) == 3


def test_a_finished_request_holds_its_blocks_only_while_it_has_something_to_store() -> None:
    s = make()
    # "a": its prompt chunks' store still in flight when it finishes
    s.add_request("a", num_prompt_tokens=8, block_hashes=chain(2))
    assert s.lookup("a", 0) == 0
    jobs = s.build_step(computed_after_step={"a": 8}, new_block_ids={"a": [[1, 2]]},
                        replace_block_ids=["a"])  # fmt: skip
    assert jobs.stores
    assert s.request_finished("a", 9) is True  # the store reads its blocks
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    # "b": everything stored; its last chunk is incomplete: nothing to hold for
    s.add_request("b", num_prompt_tokens=8, block_hashes=chain(2, b"b"))
    assert s.lookup("b", 0) == 0
    stored_chunks(s, s.build_step(computed_after_step={"b": 8}, new_block_ids={"b": [[3, 4]]},
                                  replace_block_ids=["b"]))  # fmt: skip
    assert s.request_finished("b", 9) is False
    # "c": generated tokens completed a chunk that is stored at finish
    hashes = chain(2, b"c")
    s.add_request("c", num_prompt_tokens=8, block_hashes=hashes)
    assert s.lookup("c", 0) == 0
    stored_chunks(s, s.build_step(computed_after_step={"c": 8}, new_block_ids={"c": [[5, 6, 7]]},
                                  replace_block_ids=["c"]))  # fmt: skip
    hashes.append(chain(1, hashes[-1])[0])
    s.hashes_grew("c", hashes)
    assert s.request_finished("c", 12) is True
    final = stored_chunks(s, s.build_step(computed_after_step={}, finished={"c": 12}))
    assert final == [6]  # block 7 holds chunk 2


def test_a_store_flushed_after_its_blocks_were_rewritten_is_discarded() -> None:
    """Under vLLM's model runner V2 a reallocated block is zeroed before the
    flush: the preempted request's store must not publish what it copies."""
    for rewritten, stored in ((False, True), (True, False)):
        s = make()
        s.blocks_rewritten_before_flush = rewritten
        hashes = chain(2)
        s.add_request("r", num_prompt_tokens=8, block_hashes=hashes)
        assert s.lookup("r", 0) == 0
        jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [[1, 2]]},
                            replace_block_ids=["r"])  # fmt: skip
        # next step: "r" is preempted and its blocks go to "x" before the store ran
        s.add_request("x", num_prompt_tokens=8, block_hashes=chain(2, b"x"))
        assert s.lookup("x", 0) == 0
        step = s.build_step(computed_after_step={}, new_block_ids={"x": [[1, 2]]},
                            replace_block_ids=["x"], preempted=["r"])  # fmt: skip
        assert {j.job_id for j in jobs.stores} <= step.flush
        s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
        keys = s._requests["r"].keys[0]
        assert [s.store.host.slot_of(k) is not None for k in keys] == [stored, stored]


def test_a_mamba_groups_generated_chunks_are_stored_in_the_step_they_complete() -> None:
    """The engine frees a running request's Mamba state two blocks back (and a
    sliding window's blocks out of the window): a batched store could read a
    block another request has by then."""
    s = make(GroupKind.MAMBA)
    hashes = chain(2)
    s.add_request("r", num_prompt_tokens=8, block_hashes=hashes)
    assert s.lookup("r", 0) == 0
    blocks = list(range(1, 20))
    jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [blocks]},
                        replace_block_ids=["r"])  # fmt: skip
    assert stored_chunks(s, jobs) == [0, 1]
    tokens, stored_at = 8, {}
    while tokens < 8 + 3 * TPB:
        tokens += 1
        while len(hashes) < tokens // TPB:
            hashes.append(chain(1, hashes[-1])[0])
        s.hashes_grew("r", hashes)
        for c in stored_chunks(s, s.build_step(computed_after_step={"r": tokens})):
            stored_at[c] = tokens
    assert stored_at == {2: 3 * TPB, 3: 4 * TPB, 4: 5 * TPB}  # each at its boundary


def test_a_step_with_nothing_to_do_has_no_jobs_and_a_load_or_preemption_makes_one() -> None:
    s = make()
    hashes = chain(2)
    s.add_request("a", num_prompt_tokens=8, block_hashes=hashes)
    assert s.lookup("a", 0) == 0
    first = s.build_step(
        computed_after_step={"a": 8}, new_block_ids={"a": [[1, 2]]}, replace_block_ids=["a"]
    )
    (store,) = first.stores  # in flight
    # a decoding step that completes no chunk: nothing to load, store or flush
    assert s.build_step(computed_after_step={}) == StepJobs((), (), frozenset())
    # "a" preempted while its store reads its blocks: this step flushes it
    assert s.build_step(computed_after_step={}, preempted=["a"]).flush == {store.job_id}
    s.worker_results([WorkerResult(store.job_id)])
    # a load queued between steps (the engine allocated a hit's blocks) is the next step's
    s.add_request("b", num_prompt_tokens=9, block_hashes=hashes)
    assert s.lookup("b", 0) == 8
    s.allocated("b", [[5, 6, 7]], 8)
    (load,) = s.build_step(computed_after_step={}).loads
    assert [c.engine_blocks for c in load.copies] == [[5, 6]]
    assert s.build_step(computed_after_step={}) == StepJobs((), (), frozenset())


def test_fresh_prompts_stop_being_stored_and_a_returning_one_is_stored_then_served() -> None:
    """The default host tier's admission (``kvsdk.admission``) as the scheduler drives it:
    prompts that never come back are copied only until the evidence says so; one that
    comes back is stored on its second sight and served on its third."""
    s = make()
    per_prompt = 16

    def serve(rid: str, salt: bytes) -> tuple[int, list[int]]:
        hashes = chain(per_prompt, salt)
        s.add_request(rid, num_prompt_tokens=per_prompt * TPB + 1, block_hashes=hashes)
        hit = s.lookup(rid, 0)
        ids = list(range(1, per_prompt + 2))
        jobs = s.build_step(computed_after_step={rid: per_prompt * TPB + 1},
                            new_block_ids={rid: [ids]}, replace_block_ids=[rid])  # fmt: skip
        if jobs.loads:
            s.worker_results([WorkerResult(j.job_id) for j in jobs.loads])
        stored = stored_chunks(s, jobs)
        s.request_finished(rid)
        stored += stored_chunks(s, s.build_step(computed_after_step={}, finished={rid: 1}))
        return hit or 0, stored

    copied = [len(serve(f"r{i}", bytes([i]))[1]) for i in range(8)]
    assert copied[:4] == [per_prompt] * 4 and copied[4:] == [0] * 4
    assert serve("again", bytes([7]))[1] == list(range(per_prompt))  # its second sight
    hit, stored = serve("third", bytes([7]))
    assert hit == per_prompt * TPB and stored == []


def test_a_step_split_for_lack_of_room_admits_its_offer_once() -> None:
    """Two returning prompts that do not fit the tier together are stored one at a
    time; a fresh prompt in the same step stays out (offered again per request, its
    chunks would count as a second sight)."""
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    cfg = {"chunk_tokens": TPB, "tiers": [{"backend": "cpu", "capacity": 20 * 256}]}
    store = build_store(load_config(cfg), ns, 256)
    s = OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)
    assert store.second_sight is not None
    n = 0

    def step(prompts: dict[str, tuple[int, bytes]]) -> dict[str, int]:
        nonlocal n
        ids = {}
        for rid, (chunks, salt) in prompts.items():
            s.add_request(rid, num_prompt_tokens=chunks * TPB + 1, block_hashes=chain(chunks, salt))
            assert s.lookup(rid, 0) == 0
            ids[rid] = [[n + b for b in range(1, chunks + 2)]]
            n += chunks + 1
        jobs = s.build_step(computed_after_step={r: c * TPB + 1 for r, (c, _) in prompts.items()},
                            new_block_ids=ids, replace_block_ids=list(prompts))  # fmt: skip
        owner = {b: r for r, (blocks,) in ids.items() for b in blocks}
        copied = dict.fromkeys(prompts, 0)
        for b in (b for j in jobs.stores for c in j.copies for b in c.engine_blocks):
            copied[owner[b]] += 1
        s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
        for rid in prompts:
            s.request_finished(rid)
        s.build_step(computed_after_step={}, finished=dict.fromkeys(prompts, 1))
        return copied

    for i in range(16):  # 64 fresh chunks: the share is 0, second sight turns on
        step({f"w{i}": (4, bytes([i]))})
    assert store.second_sight.selective
    assert step({"a": (12, b"a"), "b": (12, b"b")}) == {"a": 0, "b": 0}  # first sight
    # a and b come back (24 chunks for 20 slots: one at a time); c is new
    copied = step({"a2": (12, b"a"), "b2": (12, b"b"), "c": (8, b"c")})
    assert copied == {"a2": 12, "b2": 0, "c": 0}
