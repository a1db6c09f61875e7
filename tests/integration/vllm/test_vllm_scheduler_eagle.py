"""EAGLE's extra block through vLLM's real scheduler with KVSDKConnector,
stepped by hand without a model (as vLLM's own connector unit tests do).

vLLM marks the KV group that holds an EAGLE/MTP drafter's layers
(``is_eagle_group``): the drafter rewrites the KV of its last positions, so
the last chunk of that group is volatile. kvsdk (like vLLM's own prefix
cache, which drops that block from a hit) then claims one chunk less than it
holds, and while a request decodes it stores that group's last complete
chunk only once the next one completes, or at the request's finish.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from test_vllm_scheduler_holds_blocks import BLOCK, CHUNK, Engine, model_dir, store_jobs

from kvsdk.slab import SHM_DIR, segment_name

__all__ = ["model_dir"]  # the fixture, shared with the module above


@pytest.fixture(params=[False, True], ids=["plain", "eagle"])
def engine(model_dir: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    engine_id = f"kvsdk-test-eagle-{uuid.uuid4()}"
    e = Engine(model_dir, engine_id, eagle=request.param)
    try:
        assert [g.eagle for g in e.connector.layout.groups] == [request.param]
        yield e
    finally:
        e.scheduler.shutdown()
    assert not (SHM_DIR / segment_name(engine_id)).exists()


def run_to_finish(e: Engine, rid: str, steps: int) -> list[tuple[int, list[int]]]:
    """Steps ``rid`` to its end, every store landing at once; per step that
    stored something: the tokens computed after it and the chunks stored."""
    stored = []
    for _ in range(steps):
        so, meta = e.schedule()
        jobs = store_jobs(meta, rid)
        if jobs:
            req = e.scheduler.requests.get(rid)
            # schedule() advanced it; -1: stored at the request's finish
            upto = -1 if req is None or req.is_finished() else req.num_computed_tokens
            blocks = e.blocks_of(rid) if req else []
            chunks = sorted(
                {blocks.index(int(b)) // (CHUNK // BLOCK) for j in jobs for c in j.copies
                 for b in c.engine_blocks if int(b) in blocks}
            )  # fmt: skip
            stored.append((upto, chunks))
        e.output(
            so,
            completed={j.job_id: 1 for j in meta.stores},
            finished_sending=set(meta.release) or None,
        )
        if not e.holds(rid):
            break
    return stored


def test_the_drafter_groups_last_chunk_waits_while_decoding(engine: Engine) -> None:
    e = engine
    eagle = e.connector.layout.groups[0].eagle
    e.add("r", prompt_tokens=2 * CHUNK, max_tokens=5 * CHUNK)
    stored = run_to_finish(e, "r", steps=5 * CHUNK + 4)
    # the prompt's chunks are stored at once in both: a prefill is not speculative
    assert stored[0] == (2 * CHUNK, [0, 1])
    for upto, chunks in stored[1:]:
        if upto < 0:
            continue  # stored at the finish (the request has left the scheduler)
        complete = upto // CHUNK
        # while decoding, the drafter group's last complete chunk is not stored yet
        assert max(chunks) == (complete - 2 if eagle else complete - 1), (upto, chunks)
    if eagle:  # the last complete chunk is stored at the finish, holding the blocks
        assert stored[-1][0] == -1
        assert e.finished_returned == {"r": True}


def test_a_hit_on_the_drafter_group_claims_one_chunk_less_than_it_holds(engine: Engine) -> None:
    e = engine
    eagle = e.connector.layout.groups[0].eagle
    # Engine.add draws a prompt from the id's letters: "wh" and "hw" share it
    e.add("wh", prompt_tokens=3 * CHUNK + 4, max_tokens=1)  # stores chunks 0..2
    run_to_finish(e, "wh", steps=6)
    assert e.scheduler.reset_prefix_cache()  # only kvsdk holds them now
    e.add("hw", prompt_tokens=3 * CHUNK + 4, max_tokens=1)
    loads = []
    for _ in range(3):  # the lookup may be answered a step later
        so, meta = e.schedule()
        loads += [job for _, job in meta.loads.values()]
        e.output(so)
    loaded_blocks = sum(len(c.engine_blocks) for job in loads for c in job.copies)
    # three chunks stored: plain full attention resumes after all three,
    # a drafter group needs the chunk after the last one it claims
    assert loaded_blocks == (2 if eagle else 3) * CHUNK // BLOCK
