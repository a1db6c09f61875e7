"""A request id the engine reuses while kvsdk still tracks the finished request
under it (its final stores are built next step, or its stores are in flight)
names a new request: the new one is looked up and stored with its own hashes
and blocks, the old one finishes as it would have."""

from __future__ import annotations

import hashlib

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace, chunk_keys
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4


def make() -> OffloadScheduler:
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(
        load_config({"chunk_tokens": TPB, "tiers": [{"backend": "cpu", "capacity": "1MiB"}]}),
        ns,
        256,
    )
    return OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)


def chain(n: int, salt: bytes) -> list[bytes]:
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


def keys_of(s: OffloadScheduler, hashes: list[bytes]) -> list[bytes]:
    return chunk_keys(s.ns_fp, hashes, 0)


def job_keys(s: OffloadScheduler, jobs: object) -> set[tuple[tuple[bytes, ...], tuple[int, ...]]]:
    """Per store job: the chunks it stores and the engine blocks it reads."""
    return {
        (
            s.ledger.job(j.job_id).keys,
            tuple(sorted(int(b) for c in j.copies for b in c.engine_blocks)),
        )
        for j in jobs.stores  # type: ignore[attr-defined]
    }


def test_an_id_reused_before_the_finish_step_is_a_new_request() -> None:
    s = make()
    old, new = chain(3, b"old"), chain(2, b"new")
    s.add_request("r", num_prompt_tokens=8, block_hashes=old[:2])
    assert s.lookup("r", 0) == 0
    jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [[1, 2, 3]]},
                        replace_block_ids=["r"])  # fmt: skip
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    s.hashes_grew("r", old)  # decoded into a third chunk
    assert s.request_finished("r", 12)  # its third chunk is stored next step
    assert not s.has_request("r")

    # the engine reuses the id before that step: a new prompt, new blocks
    s.add_request("r", num_prompt_tokens=9, block_hashes=new)
    assert s.lookup("r", 0) == 0  # not the old prompt's 8 stored tokens
    jobs = s.build_step(
        computed_after_step={"r": 9},
        new_block_ids={"r": [[7, 8, 9]]},
        replace_block_ids=["r"],
        finished={"r": 12},  # the old request's finish
    )
    stored = job_keys(s, jobs)
    assert stored == {
        ((keys_of(s, old)[2],), (3,)),  # the old request's last chunk, from its own block
        (tuple(keys_of(s, new)), (7, 8)),  # the new request's chunks, from its blocks
    }
    assert {s.job_request(j.job_id) for j in jobs.stores} == {"r"}  # the engine's id
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    assert s.has_request("r") and s.num_tracked_requests() == 1  # the old one is gone

    s.add_request("o", num_prompt_tokens=13, block_hashes=old)
    assert s.lookup("o", 0) == 12  # every chunk of both prompts was stored
    s.add_request("n", num_prompt_tokens=9, block_hashes=new)
    assert s.lookup("n", 0) == 8


def test_an_id_reused_while_the_old_stores_are_in_flight_does_not_wait_for_them() -> None:
    s = make()
    old, new = chain(2, b"old"), chain(2, b"new")
    s.add_request("r", num_prompt_tokens=8, block_hashes=old)
    assert s.lookup("r", 0) == 0
    jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [[1, 2]]},
                        replace_block_ids=["r"])  # fmt: skip
    assert s.request_finished("r", 8)  # its store is in flight: blocks held
    s.build_step(computed_after_step={}, finished={"r": 8})

    s.add_request("r", num_prompt_tokens=9, block_hashes=new)
    assert s.lookup("r", 0) == 0  # answered at once (the old request's jobs are not its own)
    assert {s.job_request(j.job_id) for j in jobs.stores} == {"r"}
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])  # the old stores land
    assert s.has_request("r") and s.num_tracked_requests() == 1
    s.add_request("o", num_prompt_tokens=9, block_hashes=old)
    assert s.lookup("o", 0) == 8


def refuse_a_live_id() -> None:
    """A second add_request of a live id: a ValueError naming the id, and the live
    request keeps its prompt (its lookups and stores go on as before)."""
    import pytest

    s = make()
    try:
        live = chain(2, b"live")
        s.add_request("r", num_prompt_tokens=8, block_hashes=live)
        assert s.lookup("r", 0) == 0
        with pytest.raises(ValueError, match=r"request id 'r' is still live"):
            s.add_request("r", num_prompt_tokens=9, block_hashes=chain(2, b"other"))
        assert s.has_request("r")
        jobs = s.build_step(computed_after_step={"r": 8}, new_block_ids={"r": [[1, 2]]},
                            replace_block_ids=["r"])  # fmt: skip
        assert {keys for keys, _ in job_keys(s, jobs)} == {tuple(keys_of(s, live))}
    finally:  # (its store's threads stopped before the interpreter exits)
        s.store.shutdown()


def test_an_id_reused_while_its_request_is_live_is_refused() -> None:
    refuse_a_live_id()


def test_an_id_reused_while_live_is_refused_under_python_O_too() -> None:
    """``python -O`` strips asserts: the refusal is not one."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); "
        "from test_reused_request_id import refuse_a_live_id; refuse_a_live_id()"
    )
    res = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
