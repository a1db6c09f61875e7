"""The prompt tail: a prompt's last, partial chunk is stored once its prefill is
done, and a repeated prompt is served to its end; another tail (other tokens,
other salt) never matches."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from kvsdk.config import ConfigError, load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4  # tokens per block = per chunk


def make(kind: GroupKind = GroupKind.FULL_ATTENTION) -> OffloadScheduler:
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}), ns, 256)
    window = 8 if kind is GroupKind.SLIDING_WINDOW else None
    return OffloadScheduler([KVGroupSpec(0, kind, TPB, 1, sliding_window_tokens=window)], ns, store)


def chain(tokens: list[int]) -> list[bytes]:
    """An engine's block hashes: one per whole block."""
    out, prev = [], b""
    for b in range(len(tokens) // TPB):
        prev = hashlib.sha256(prev + bytes(tokens[b * TPB : (b + 1) * TPB])).digest()
        out.append(prev)
    return out


def serve(s: OffloadScheduler, rid: str, prompt: list[int], salt: bytes = b"") -> int | None:
    s.add_request(rid, num_prompt_tokens=len(prompt), block_hashes=chain(prompt),
                  prompt_token_ids=prompt, tail_salt=salt)  # fmt: skip
    return s.lookup(rid, 0)


def run_prefill(s: OffloadScheduler, rid: str, prompt: list[int], blocks: list[int]) -> list[int]:
    """The whole prompt computed in one step; finished; every store landed.
    Returns the engine blocks the step's stores copied."""
    jobs = s.build_step(computed_after_step={rid: len(prompt)}, new_block_ids={rid: [blocks]},
                        replace_block_ids=[rid])  # fmt: skip
    copied = [b for j in jobs.stores for c in j.copies for b in c.engine_blocks]
    assert s.request_finished(rid, len(prompt)) is True  # its stores read the blocks
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    s.build_step(computed_after_step={}, finished={rid: len(prompt)})
    return copied


PROMPT = list(range(10, 21))  # 11 tokens: 2 whole blocks and a 3-token tail


def test_a_repeated_prompt_is_served_to_its_end_from_its_tail() -> None:
    s = make()
    assert serve(s, "a", PROMPT) == 0
    # blocks 1, 2 hold the whole chunks, block 3 the tail (and later, generated tokens)
    assert sorted(run_prefill(s, "a", PROMPT, [1, 2, 3])) == [1, 2, 3]
    assert serve(s, "b", PROMPT) == 11  # the engine recomputes the last token itself
    s.allocated("b", [[7, 8, 9]], 11)
    (load,) = s.build_step(computed_after_step={}).loads
    assert [b for c in load.copies for b in c.engine_blocks] == [7, 8, 9]
    assert load.copies[0].offsets == [0, 0, 0]


def test_another_tail_or_salt_is_served_only_to_the_last_whole_chunk() -> None:
    s = make()
    serve(s, "a", PROMPT)
    run_prefill(s, "a", PROMPT, [1, 2, 3])
    assert serve(s, "other-tail", [*PROMPT[:-1], 99]) == 8
    assert serve(s, "other-salt", PROMPT, salt=b"tenant-b") == 8
    assert serve(s, "shorter", PROMPT[:-1]) == 8  # a tail names exactly its tokens
    assert serve(s, "longer", [*PROMPT, 5]) == 8


def test_a_prompt_on_a_chunk_boundary_has_no_tail_and_no_extra_store() -> None:
    s = make()
    prompt = PROMPT[:8]
    serve(s, "a", prompt)
    assert sorted(run_prefill(s, "a", prompt, [1, 2])) == [1, 2]
    assert serve(s, "b", prompt) == 8


def test_a_sliding_window_model_has_no_tails() -> None:
    s = make(GroupKind.SLIDING_WINDOW)
    serve(s, "a", PROMPT)
    copied = run_prefill(s, "a", PROMPT, [1, 2, 3])
    assert 3 not in copied  # only whole chunks
    assert (serve(s, "b", PROMPT) or 0) <= 8


def test_after_a_reset_the_tail_is_gone_and_stored_again() -> None:
    s = make()
    serve(s, "a", PROMPT)
    run_prefill(s, "a", PROMPT, [1, 2, 3])
    s.reset()
    assert serve(s, "b", PROMPT) == 0
    assert 3 in run_prefill(s, "b", PROMPT, [1, 2, 3])
    assert serve(s, "c", PROMPT) == 11


def test_a_prompt_finished_in_one_step_is_one_store_job_with_its_tail() -> None:
    """The tail rides in the job of the request's whole chunks: one ledger
    entry, one completion; the tail's slot sits after the chunks' in one copy list."""
    s = make()
    serve(s, "a", PROMPT)
    jobs = s.build_step(computed_after_step={"a": 11}, new_block_ids={"a": [[1, 2, 3]]},
                        replace_block_ids=["a"])  # fmt: skip
    (job,) = jobs.stores
    (copies,) = job.copies
    assert copies.engine_blocks == [1, 2, 3] and len(set(copies.slots)) == 3
    assert s.ledger.num_jobs == 1
    s.worker_results([WorkerResult(job.job_id)])
    assert serve(s, "b", PROMPT) == 11


def test_a_tail_due_after_its_chunks_is_a_job_of_its_own() -> None:
    """Chunked prefill: the whole chunks are stored in the step that computes
    them, the tail in the step that ends the prompt."""
    s = make()
    serve(s, "a", PROMPT)
    first = s.build_step(computed_after_step={"a": 8}, new_block_ids={"a": [[1, 2]]},
                         replace_block_ids=["a"])  # fmt: skip
    assert [c.engine_blocks for j in first.stores for c in j.copies] == [[1, 2]]
    second = s.build_step(computed_after_step={"a": 11}, new_block_ids={"a": [[3]]})
    assert [c.engine_blocks for j in second.stores for c in j.copies] == [[3]]
    s.worker_results([WorkerResult(j.job_id) for j in (*first.stores, *second.stores)])
    assert serve(s, "b", PROMPT) == 11


def test_two_requests_with_one_prompt_in_one_step_store_it_once() -> None:
    s = make()
    serve(s, "a", PROMPT)
    serve(s, "b", PROMPT)
    jobs = s.build_step(computed_after_step={"a": 11, "b": 11},
                        new_block_ids={"a": [[1, 2, 3]], "b": [[4, 5, 6]]},
                        replace_block_ids=["a", "b"])  # fmt: skip
    copied = [b for j in jobs.stores for c in j.copies for b in c.engine_blocks]
    assert sorted(copied) == [1, 2, 3]  # the chunks and the tail once, from the first
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    assert serve(s, "c", PROMPT) == 11


def test_a_tier_without_room_for_chunks_and_tail_at_once_stores_what_fits() -> None:
    """The step's reservation fails (two slots, three entries): the request's
    chunks are tried alone, then its tail; what fits is stored, never a loop."""
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(load_config({"tiers": [{"backend": "cpu", "capacity": 512}]}), ns, 256)
    s = OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)
    assert store.host.num_slots == 2
    serve(s, "a", PROMPT)
    jobs = s.build_step(computed_after_step={"a": 11}, new_block_ids={"a": [[1, 2, 3]]},
                        replace_block_ids=["a"])  # fmt: skip
    copied = sorted(b for j in jobs.stores for c in j.copies for b in c.engine_blocks)
    assert copied == [1, 2]  # the whole chunks; no room left for the tail
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    assert serve(s, "b", PROMPT) == 8


def test_tails_hold_at_most_their_share_of_the_host_tier_and_never_crowd_out_chunks() -> None:
    """A 16-slot host tier, ``prompt_tail_share: 0.125``: two slots for tails.
    Six prompts (each two whole chunks and a tail) all keep their chunks; only
    the last two keep their tails, the older tails made room for the newer."""
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    cfg = load_config(
        {"tiers": [{"backend": "cpu", "capacity": 16 * 256}], "prompt_tail_share": 0.125}
    )
    store = build_store(cfg, ns, 256)
    s = OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)
    assert (store.host.num_slots, store.tail_slots) == (16, 2)
    prompts = [[p * 20 + t for t in range(11)] for p in range(6)]
    for p, prompt in enumerate(prompts):
        assert serve(s, f"w{p}", prompt) == 0
        run_prefill(s, f"w{p}", prompt, [3 * p + 1, 3 * p + 2, 3 * p + 3])
    assert store.host.num_used == 6 * 2 + 2
    served = [serve(s, f"r{p}", prompt) for p, prompt in enumerate(prompts)]
    assert served == [8, 8, 8, 8, 11, 11]  # every whole chunk; the two newest tails


def test_prompt_tail_share_outside_zero_to_one_is_refused() -> None:
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ConfigError, match=r"prompt_tail_share: got .*expected a share"):
            load_config({"prompt_tail_share": bad})


def test_more_tails_in_one_step_than_their_share_store_the_last_ones() -> None:
    """Three prompts computed in one step, room for two tails: two are stored
    (not none, as a reservation of all three past the share would give)."""
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    cfg = load_config(
        {"tiers": [{"backend": "cpu", "capacity": 16 * 256}], "prompt_tail_share": 0.125}
    )
    store = build_store(cfg, ns, 256)
    s = OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)
    prompts = [[p * 20 + t for t in range(11)] for p in range(3)]
    for p, prompt in enumerate(prompts):
        assert serve(s, f"w{p}", prompt) == 0
    jobs = s.build_step(
        computed_after_step={f"w{p}": 11 for p in range(3)},
        new_block_ids={f"w{p}": [[3 * p + 1, 3 * p + 2, 3 * p + 3]] for p in range(3)},
        replace_block_ids=[f"w{p}" for p in range(3)],
    )
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    assert store.host.num_used == 3 * 2 + 2
    assert [serve(s, f"r{p}", prompt) for p, prompt in enumerate(prompts)] == [8, 11, 11]


def test_a_tail_another_instance_stored_on_a_shared_disk_is_served(tmp_path: Path) -> None:
    """A slower tier may hold tails this instance never stored: a fresh
    instance serves a repeated prompt to its end from another's tail."""
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "capacity": 16 * 256},
                {"backend": "disk", "path": str(tmp_path), "capacity": "1MiB"},
            ]
        }
    )
    a, b = (
        OffloadScheduler(
            [KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, build_store(cfg, ns, 256)
        )
        for _ in range(2)
    )
    serve(a, "w", PROMPT)
    run_prefill(a, "w", PROMPT, [1, 2, 3])
    a.store.shutdown()  # its writes to the disk are done
    b.add_request("r", num_prompt_tokens=len(PROMPT), block_hashes=chain(PROMPT),
                  prompt_token_ids=PROMPT)  # fmt: skip
    deadline = time.monotonic() + 20
    while (hit := b.lookup("r", 0)) is None and time.monotonic() < deadline:
        b.build_step(computed_after_step={})  # the disk answers between steps
        time.sleep(0.002)
    assert hit == 11
    b.store.shutdown()
