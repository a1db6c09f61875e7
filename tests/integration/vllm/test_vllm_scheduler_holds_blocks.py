"""vLLM's real scheduler with KVSDKConnector, stepped by hand without a model:
a request that finishes while kvsdk still has to read its KV blocks keeps
them (``request_finished`` returns True) until every worker reports it in
``finished_sending``; one with nothing left to store frees them at once. A
preempted request's blocks are freed at once by vLLM: kvsdk flushes the
stores still reading them in that step instead.

The model runner is played by the test: it feeds ``ModelRunnerOutput``s as
a worker would (job completions in ``KVSDKWorkerMetadata``, released
requests in ``finished_sending``), and in the last test a real kvsdk worker
side (``WorkerSide``) produces them, copying the blocks into the engine's
shared-memory slab. The scheduler side creates that slab in /dev/shm; every
test shuts the scheduler down and checks the segment is gone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvsdk.plugins.vllm.connector import KVSDKConnector
from kvsdk.plugins.vllm.messages import KVSDKConnectorMetadata, KVSDKWorkerMetadata
from kvsdk.plugins.vllm.worker_side import WorkerSide
from kvsdk.plugins.vllm.workloads.model_free_scheduler import (
    model_free_scheduler,
    write_llama_config,
)
from kvsdk.slab import SHM_DIR, segment_name
from kvsdk.transfer import Direction, TransferJob, TransferResult, TransferWorker
from kvsdk.transfer.cpu import CPUTransferWorker

BLOCK = 16
CHUNK = 32  # two blocks per chunk
NUM_BLOCKS = 64
LAYERS = 2
KV_HEADS, HEAD = 2, 16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKEN = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local config.json only (no weights, no tokenizer): vLLM never loads a model here."""
    path = tmp_path_factory.mktemp("model") / "tiny-llama-config"
    write_llama_config(
        str(path),
        hidden_size=KV_HEADS * HEAD * 2,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    return str(path)


class Engine:
    """vLLM's Scheduler and the scheduler side of KVSDKConnector it built."""

    def __init__(
        self,
        model: str,
        engine_id: str,
        num_blocks: int = NUM_BLOCKS,
        *,
        eagle: bool = False,
        prompt_tail: bool = False,
    ) -> None:
        """``eagle``: vLLM marks the group as holding an EAGLE/MTP drafter's layers.
        ``prompt_tail`` off (kvsdk's default is on) for the tests that count
        the stores of whole chunks; ``test_a_prompts_tail_*`` turn it on."""
        self.num_blocks = num_blocks
        self.scheduler = model_free_scheduler(
            model,
            engine_id=engine_id,
            kvsdk_config={
                "chunk_tokens": CHUNK,
                "prompt_tail": prompt_tail,
                "tiers": [{"backend": "cpu", "capacity": "2MiB"}],
            },
            block_size=BLOCK,
            num_blocks=num_blocks,
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            eagle=eagle,
        )
        self.kv_cache_config = self.scheduler.kv_cache_config
        connector = self.scheduler.connector
        assert isinstance(connector, KVSDKConnector)
        self.connector = connector
        self.finished_returned: dict[str, bool] = {}
        original = connector.request_finished_all_groups

        def spy(request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
            held, params = original(request, block_ids)
            self.finished_returned[request.request_id] = held
            return held, params

        connector.request_finished_all_groups = spy

    # -- driving ----------------------------------------------------------------------------
    def add(self, rid: str, prompt_tokens: int, max_tokens: int) -> Request:
        req = Request(
            rid,
            [(sum(map(ord, rid)) * 31 + i) % 900 + 50 for i in range(prompt_tokens)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def schedule(self) -> tuple[SchedulerOutput, KVSDKConnectorMetadata]:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        return so, meta

    def output(
        self,
        so: SchedulerOutput,
        *,
        completed: dict[int, int] | None = None,
        finished_sending: set[str] | None = None,
        worker_meta: KVSDKWorkerMetadata | None = None,
    ) -> None:
        """The model runner's output for ``so``: one sampled token per scheduled
        request, and what a worker's connector reports."""
        ids = list(so.num_scheduled_tokens)
        if completed:
            worker_meta = KVSDKWorkerMetadata(completed=dict(completed))
        kv_out = None
        if worker_meta is not None or finished_sending:
            kv_out = KVConnectorOutput(
                finished_sending=finished_sending, kv_connector_worker_meta=worker_meta
            )
        self.scheduler.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[TOKEN] for _ in ids],
                kv_connector_output=kv_out,
            ),
        )

    # -- looking -----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks_of(self, rid: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return list(ids)

    def holds(self, rid: str) -> bool:
        """vLLM still owns the request (and its blocks)."""
        return rid in self.scheduler.requests

    def assert_empty(self, *, connector_idle: bool = True) -> None:
        """No request, every block free; ``connector_idle``: kvsdk has no work
        left either (a request that just finished is settled by the next step)."""
        s = self.scheduler
        assert not s.requests and not s.running and not s.waiting
        assert self.free_blocks == self.num_blocks - 1  # all but the null block
        assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks[1:])
        assert self.connector.has_pending_push_work() is not connector_idle


@pytest.fixture
def engine(model_dir: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """Parametrized indirectly with a number of blocks: a smaller block pool."""
    engine_id = f"kvsdk-test-holds-{uuid.uuid4()}"
    segment = SHM_DIR / segment_name(engine_id)
    e = Engine(model_dir, engine_id, getattr(request, "param", NUM_BLOCKS))
    try:
        assert segment.exists()  # the host tier's slab, shared with the workers
        assert e.connector.layout.slab_name == segment.name
        yield e
    finally:
        e.scheduler.shutdown()
    assert not segment.exists(), f"{segment} left behind after the scheduler shut down"


def store_jobs(meta: KVSDKConnectorMetadata, rid: str) -> list[TransferJob]:
    return [j for j, r in zip(meta.stores, meta.store_requests, strict=True) if r == rid]


# -- (a), (b), (d): held while a store is in flight, then released and freed ---------------------


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_request_with_a_store_in_flight_keeps_its_blocks_until_released(
    engine: Engine, max_tokens: int
) -> None:
    e = engine
    req = e.add("a", prompt_tokens=64, max_tokens=max_tokens)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "a")  # both full chunks of the prompt, one job
    assert job.direction is Direction.STORE
    blocks = e.blocks_of("a")
    assert len(blocks) == 64 // BLOCK
    assert sorted(int(b) for c in job.copies for b in c.engine_blocks) == sorted(blocks)
    held_free = NUM_BLOCKS - 1 - len(blocks)
    assert e.free_blocks == held_free
    e.output(so)  # the worker has not finished the store
    for _ in range(max_tokens - 1):  # decode to the end; the store is still in flight
        so, meta = e.schedule()
        assert so.num_scheduled_tokens == {"a": 1} and not meta.release
        e.output(so)
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert e.finished_returned == {"a": True}
    assert e.holds("a") and e.free_blocks == NUM_BLOCKS - 1 - len(e.blocks_of("a"))
    held_free = e.free_blocks
    assert e.scheduler.has_requests()  # the engine keeps stepping for it

    # (d) the next step tells the workers to release it, once
    so, meta = e.schedule()
    assert so.finished_req_ids == {"a"}
    assert meta.release == frozenset({"a"})
    assert not meta.stores and not meta.loads
    e.output(so)  # store still running: the worker reports nothing
    assert e.holds("a") and e.free_blocks == held_free

    so, meta = e.schedule()
    assert not meta.release  # not repeated
    e.output(so, completed={job.job_id: 1})  # the store landed, the release not reported yet
    assert e.holds("a") and e.free_blocks == held_free  # vLLM frees only on finished_sending

    # (b) the worker reports the request sent: vLLM frees the blocks
    so, meta = e.schedule()
    assert not meta.release
    e.output(so, finished_sending={"a"})
    assert not e.holds("a")
    e.assert_empty()


def test_the_store_and_the_release_reported_in_one_step_free_the_blocks(engine: Engine) -> None:
    """As a worker reports it when its store finishes after the release arrived."""
    e = engine
    e.add("a", prompt_tokens=96, max_tokens=1)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "a")
    e.output(so)
    assert e.finished_returned == {"a": True}
    so, meta = e.schedule()
    assert meta.release == {"a"}
    e.output(so)
    assert e.holds("a") and e.free_blocks == NUM_BLOCKS - 1 - 96 // BLOCK
    so, _ = e.schedule()
    e.output(so, completed={job.job_id: 1}, finished_sending={"a"})
    e.assert_empty()


def test_an_aborted_request_with_a_store_in_flight_is_held_too(engine: Engine) -> None:
    e = engine
    e.add("a", prompt_tokens=64, max_tokens=50)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "a")
    e.output(so)
    e.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert e.finished_returned == {"a": True}
    assert e.holds("a")
    held_free = e.free_blocks
    so, meta = e.schedule()
    assert meta.release == {"a"} and not so.num_scheduled_tokens
    e.output(so)
    assert e.free_blocks == held_free
    so, _ = e.schedule()
    e.output(so, completed={job.job_id: 1}, finished_sending={"a"})
    e.assert_empty()


def test_a_request_that_needs_the_held_blocks_waits_for_the_release(engine: Engine) -> None:
    e = engine
    e.add("a", prompt_tokens=64, max_tokens=1)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "a")
    a_blocks = set(e.blocks_of("a"))
    e.output(so)
    assert e.finished_returned == {"a": True}
    # "b" needs every block but the null one: while "a" holds 4, it cannot start
    b_tokens = (NUM_BLOCKS - 1) * BLOCK
    e.add("b", prompt_tokens=b_tokens, max_tokens=1)
    so, meta = e.schedule()
    assert meta.release == {"a"} and not so.num_scheduled_tokens
    e.output(so, completed={job.job_id: 1})
    so, _ = e.schedule()
    assert not so.num_scheduled_tokens  # the store landed, but vLLM waits for the release
    e.output(so, finished_sending={"a"})
    assert not e.holds("a")
    so, meta = e.schedule()  # now "b" gets the blocks, "a"'s among them
    assert so.num_scheduled_tokens == {"b": b_tokens}
    assert a_blocks <= set(e.blocks_of("b"))
    e.output(so, completed={j.job_id: 1 for j in store_jobs(meta, "b")})
    assert e.finished_returned["b"] is True  # see the next test
    so, meta = e.schedule()
    assert meta.release == {"b"}
    e.output(so, finished_sending={"b"})
    e.assert_empty()


def test_a_store_completed_in_the_finishing_step_still_holds_until_the_release(
    engine: Engine,
) -> None:
    """vLLM's update_from_output finishes requests (request_finished) before it
    hands the step's connector output (the store's completion) to the
    connector: the request is held one more step, then released."""
    e = engine
    e.add("a", prompt_tokens=64, max_tokens=1)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "a")
    e.output(so, completed={job.job_id: 1})
    assert e.finished_returned == {"a": True}
    assert e.holds("a")
    so, meta = e.schedule()
    assert meta.release == {"a"}
    e.output(so, finished_sending={"a"})  # the worker has no store of "a" left: at once
    e.assert_empty()


def test_decoded_chunks_stored_at_finish_hold_the_blocks_until_stored(engine: Engine) -> None:
    """Generated tokens are stored in batches of chunks; a request that ends
    before its batch is full has its last chunks stored in the step after it
    finished (the release step): its blocks stay until that store lands."""
    e = engine
    max_tokens = 40  # 32 prompt + 40 tokens: KV of 71, chunk 1 (tokens 32..63) due at finish
    e.add("d", prompt_tokens=CHUNK, max_tokens=max_tokens)
    so, meta = e.schedule()
    (first,) = store_jobs(meta, "d")
    e.output(so, completed={first.job_id: 1})
    for _ in range(max_tokens - 1):
        so, meta = e.schedule()
        assert not store_jobs(meta, "d")  # decode chunks wait for a batch
        e.output(so)
    assert e.finished_returned == {"d": True}  # no job in flight, but one is due
    held_free = e.free_blocks
    assert e.holds("d") and held_free == e.num_blocks - 1 - len(e.blocks_of("d"))
    so, meta = e.schedule()
    assert meta.release == {"d"}
    (last,) = store_jobs(meta, "d")  # in the same step as the release
    (c,) = last.copies
    assert list(c.engine_blocks) == e.blocks_of("d")[2:4]  # chunk 1's blocks
    e.output(so)
    assert e.holds("d") and e.free_blocks == held_free
    so, _ = e.schedule()
    e.output(so, completed={last.job_id: 1}, finished_sending={"d"})
    e.assert_empty()


# -- (c): nothing left to store: False, freed at once ---------------------------------------------


def test_a_request_whose_stores_landed_frees_its_blocks_at_once(engine: Engine) -> None:
    e = engine
    e.add("c", prompt_tokens=64, max_tokens=2)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "c")
    e.output(so, completed={job.job_id: 1})  # stored in the same step
    so, meta = e.schedule()
    assert so.num_scheduled_tokens == {"c": 1} and not store_jobs(meta, "c")
    e.output(so)  # finishes: 65 tokens computed, the third chunk is not full
    assert e.finished_returned == {"c": False}
    assert not e.holds("c")
    e.assert_empty(connector_idle=False)
    so, meta = e.schedule()
    assert so.finished_req_ids == {"c"} and not meta.release  # nothing to release
    e.output(so)
    e.assert_empty()


def test_a_request_shorter_than_a_chunk_stores_nothing_and_frees_at_once(engine: Engine) -> None:
    e = engine
    e.add("s", prompt_tokens=CHUNK - 5, max_tokens=3)
    for _ in range(3):
        so, meta = e.schedule()
        assert not meta.stores
        e.output(so)
    assert e.finished_returned == {"s": False}
    e.assert_empty(connector_idle=False)
    so, meta = e.schedule()
    assert not meta.release
    e.output(so)
    e.assert_empty()


def test_a_prompts_tail_is_stored_held_for_and_loaded_before_the_forward_pass(
    model_dir: str,
) -> None:
    """kvsdk's default, the prompt tail: a prompt shorter than a chunk stores
    its partial chunk (its one block), and vLLM keeps the request's blocks until
    that store landed; the same prompt again, after vLLM's own cache is reset,
    is served from kvsdk to its last token, copied before the forward pass."""
    engine_id = f"kvsdk-test-holds-{uuid.uuid4()}"
    e = Engine(model_dir, engine_id, prompt_tail=True)
    w = Worker(e)
    try:
        e.add("s", prompt_tokens=CHUNK - 5, max_tokens=2)
        so, meta = e.schedule()
        (store,) = store_jobs(meta, "s")  # the tail: tokens 0..26, in blocks 0 and 1
        blocks = e.blocks_of("s")
        assert [int(b) for c in store.copies for b in c.engine_blocks] == blocks
        out = w.step(so, e.scheduler)  # the copy is slow: still queued
        assert w.xfer.queued == [store]
        e.output(so, worker_meta=out.kv_connector_worker_meta)
        so, meta = e.schedule()
        assert so.num_scheduled_tokens == {"s": 1} and not meta.stores
        out = w.step(so, e.scheduler)
        e.output(so, worker_meta=out.kv_connector_worker_meta)
        assert e.finished_returned == {"s": True}  # held: its tail's store reads the blocks
        assert e.holds("s") and e.free_blocks == NUM_BLOCKS - 1 - len(blocks)
        w.xfer.open()
        w.run_steps(e, 3)  # stored, released, freed
        e.assert_empty()
        stored = {b: w.kv[LAYER_NAMES[0]][b].clone() for b in blocks}
        assert e.scheduler.reset_prefix_cache()  # vLLM's own cache: the hit is kvsdk's
        for t in w.kv.values():  # whatever block vLLM hands out next, only a load refills it
            t.fill_(-1.0)

        e.add("s", prompt_tokens=CHUNK - 5, max_tokens=1)  # the same tokens, a new request
        so, meta = e.schedule()
        assert so.num_scheduled_tokens == {"s": 1}  # all but the last token from kvsdk
        assert so.has_sync_kv_loads and meta.sync_loads
        ((job_rid, job),) = meta.loads.values()
        assert job_rid == "s"
        loaded = [int(b) for c in job.copies for b in c.engine_blocks]
        assert loaded == e.blocks_of("s")
        w.side.flush(meta)
        w.side.start_loads(meta)  # before the forward pass: the copy is done on return
        for b_new, b_old in zip(loaded, stored, strict=True):
            assert torch.equal(w.kv[LAYER_NAMES[0]][b_new], stored[b_old])
        w.side.submit_stores(meta)
        e.output(so, worker_meta=w.side.take_meta())
        w.run_steps(e, 3)
        e.assert_empty()
    finally:
        w.shutdown()
        e.scheduler.shutdown()


# -- preemption: blocks freed at once, kvsdk's stores flushed first ------------------------------


@pytest.mark.parametrize("engine", [16], indirect=True, ids=["16_blocks"])
def test_a_preempted_requests_store_is_flushed_in_the_step_its_blocks_are_reused(
    engine: Engine,
) -> None:
    """vLLM frees a preempted request's blocks at once (no connector hook can
    hold them) and may hand them to another request in the same step; kvsdk
    puts the store still reading them in that step's ``flush``, which the
    workers wait for in ``handle_preemptions``, before the forward pass."""
    e = engine
    e.add("a", prompt_tokens=5 * BLOCK, max_tokens=20)  # 5 full blocks: a decode needs a 6th
    e.add("b", prompt_tokens=5 * CHUNK, max_tokens=20)  # the other 10, all read by its store
    so, meta = e.schedule()
    assert e.free_blocks == 0
    (b_job,) = store_jobs(meta, "b")
    b_blocks = set(e.blocks_of("b"))
    e.output(so, completed={j.job_id: 1 for j in store_jobs(meta, "a")})  # b's store: in flight
    so, meta = e.schedule()
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    reused = set(e.blocks_of("a")) & b_blocks
    assert len(reused) == 1  # a block b's store still reads is a's now, this very step
    assert b_job.job_id in meta.flush
    assert {int(x) for c in b_job.copies for x in c.engine_blocks} == b_blocks
    e.output(so, completed={b_job.job_id: 1})
    e.scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert e.finished_returned == {"a": False, "b": False}  # nothing of theirs in flight
    e.assert_empty(connector_idle=False)


# -- end to end with kvsdk's own worker side -------------------------------------------------------


class GatedStores(TransferWorker):
    """The CPU worker, with store jobs held back until ``open()`` (a slow copy)."""

    name = "gated"

    def __init__(self) -> None:
        self.inner = CPUTransferWorker(sync_stores=True)
        self.gate_open = False
        self.queued: list[TransferJob] = []

    def register(self, groups: Any, slab: torch.Tensor) -> None:
        self.inner.register(groups, slab)

    def submit(self, job: TransferJob) -> None:
        if job.direction is Direction.STORE and not self.gate_open:
            self.queued.append(job)
        else:
            self.inner.submit(job)

    def open(self) -> None:
        self.gate_open = True
        for job in self.queued:
            self.inner.submit(job)
        self.queued.clear()

    def wait(self, job_ids: Any) -> None:
        self.inner.wait(job_ids)

    def poll(self) -> list[TransferResult]:
        return self.inner.poll()

    def shutdown(self) -> None:
        self.inner.shutdown()


class Worker:
    """One vLLM worker process's connector calls, in the model runner's order."""

    def __init__(self, e: Engine) -> None:
        self.side = WorkerSide(e.connector.layout, pp_rank=0, tp_rank=0)
        self.xfer = GatedStores()
        self.side._workers = {"cpu": lambda: self.xfer}
        gen = torch.Generator().manual_seed(0)
        self.kv = {
            name: torch.randn((NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD), generator=gen)
            for name in LAYER_NAMES
        }
        self.side.register_kv_caches(self.kv)
        handshake = self.side.handshake()
        assert handshake.error is None, handshake.error
        e.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.step_no = 0

    def step(self, so: SchedulerOutput, scheduler: Scheduler) -> KVConnectorOutput:
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        self.step_no += 1
        self.side.flush(meta)  # handle_preemptions
        # the forward pass writes this step's KV into the scheduled requests' blocks
        for rid in so.num_scheduled_tokens:
            for b in scheduler.kv_cache_manager.get_block_ids(rid)[0]:
                for t in self.kv.values():
                    t[b].fill_(self.step_no * 1000 + b)
        self.side.start_loads(meta)  # after the forward launch (async loads)
        self.side.submit_stores(meta)  # wait_for_save
        recving = self.side.poll()  # get_finished
        sending = self.side.take_released()
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving or None,
            kv_connector_worker_meta=self.side.take_meta(),
        )

    def run_steps(self, e: Engine, n: int) -> None:
        """``n`` engine steps with this worker, each reporting what it reported."""
        for _ in range(n):
            so, _ = e.schedule()
            out = self.step(so, e.scheduler)
            e.output(
                so,
                worker_meta=out.kv_connector_worker_meta,
                finished_sending=out.finished_sending,
            )

    def shutdown(self) -> None:
        self.side.shutdown()


def test_end_to_end_a_store_due_at_finish_is_waited_for_by_the_worker(engine: Engine) -> None:
    e = engine
    w = Worker(e)
    try:
        w.xfer.open()
        e.add("d", prompt_tokens=CHUNK, max_tokens=40)
        for _ in range(40):
            so, _ = e.schedule()
            out = w.step(so, e.scheduler)
            e.output(so, worker_meta=out.kv_connector_worker_meta)
        assert e.finished_returned == {"d": True}
        blocks = e.blocks_of("d")
        w.xfer.gate_open = False  # the final store is slow
        so, meta = e.schedule()
        assert meta.release == {"d"}
        (last,) = store_jobs(meta, "d")
        out = w.step(so, e.scheduler)
        assert w.xfer.queued == [last]
        assert not out.finished_sending  # counted before get_finished: not released early
        e.output(so, worker_meta=out.kv_connector_worker_meta)
        assert e.holds("d") and e.free_blocks == NUM_BLOCKS - 1 - len(blocks)
        w.xfer.open()
        so, _ = e.schedule()
        out = w.step(so, e.scheduler)
        assert out.finished_sending == {"d"}
        e.output(
            so, worker_meta=out.kv_connector_worker_meta, finished_sending=out.finished_sending
        )
        e.assert_empty()
    finally:
        w.shutdown()


def test_end_to_end_the_blocks_stay_until_the_worker_copied_them(engine: Engine) -> None:
    e = engine
    w = Worker(e)
    try:
        e.add("a", prompt_tokens=64, max_tokens=1)
        so, meta = e.schedule()
        (job,) = store_jobs(meta, "a")
        blocks = e.blocks_of("a")
        out = w.step(so, e.scheduler)
        expected = {b: w.kv[LAYER_NAMES[0]][b].clone() for b in blocks}  # the KV to store
        assert w.xfer.queued == [job]  # the copy is slow
        assert not out.finished_sending
        e.output(so, worker_meta=out.kv_connector_worker_meta)
        assert e.finished_returned == {"a": True}

        so, meta = e.schedule()
        assert meta.release == {"a"}
        out = w.step(so, e.scheduler)
        assert not out.finished_sending  # its store has not run: the worker keeps it
        e.output(
            so, worker_meta=out.kv_connector_worker_meta, finished_sending=out.finished_sending
        )
        assert e.holds("a")
        assert e.free_blocks == NUM_BLOCKS - 1 - len(blocks)

        w.xfer.open()  # the copy runs now, from blocks nobody reused
        so, meta = e.schedule()
        out = w.step(so, e.scheduler)
        assert out.finished_sending == {"a"}
        worker_meta = out.kv_connector_worker_meta
        assert isinstance(worker_meta, KVSDKWorkerMetadata)
        assert worker_meta.completed == {job.job_id: 1}
        e.output(so, worker_meta=worker_meta, finished_sending=out.finished_sending)
        e.assert_empty()

        # the slab holds the blocks' KV as the forward pass left it
        slab = w.side._slab
        assert slab is not None
        region = slab.region(0)
        block_bytes = e.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        (c,) = job.copies
        for b, slot, off in zip(c.engine_blocks, c.slots, c.offsets, strict=True):
            layer0 = region[int(slot), int(off) * block_bytes : (int(off) + 1) * block_bytes]
            assert torch.equal(layer0, expected[int(b)].reshape(-1).view(torch.uint8))
        assert np.asarray(c.engine_blocks).size == len(blocks)
    finally:
        w.shutdown()


# -- a request id reused inside the finish window ------------------------------------------------


def test_an_id_reused_before_its_finish_is_reported_is_a_new_request(engine: Engine) -> None:
    """vLLM freed "c" at once and reports it in the next step's
    ``finished_req_ids``; a new request with the id "c" arrives before that
    step. It is a new request: its own prompt's hashes are looked up (a miss),
    never the finished one's (which kvsdk holds: a load of the wrong KV)."""
    e = engine
    e.add("c", prompt_tokens=64, max_tokens=2)
    so, meta = e.schedule()
    (job,) = store_jobs(meta, "c")
    e.output(so, completed={job.job_id: 1})
    so, meta = e.schedule()
    e.output(so)  # finishes; nothing left to store: its blocks are freed at once
    assert e.finished_returned == {"c": False} and not e.holds("c")

    other = [(i * 7 + 3) % 900 + 50 for i in range(64)]  # another prompt, the same id
    new = Request(
        "c",
        other,
        SamplingParams(max_tokens=1, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    e.scheduler.add_request(new)
    so, meta = e.schedule()
    assert so.finished_req_ids == {"c"}  # the old one's finish, in the new one's first step
    assert not meta.loads  # the old prompt's chunks are not offered to the new request
    assert so.num_scheduled_tokens == {"c": 64}
    (job,) = store_jobs(meta, "c")  # the new prompt's own chunks, from its own blocks
    assert sorted(int(b) for c in job.copies for b in c.engine_blocks) == sorted(e.blocks_of("c"))
    e.output(so, completed={job.job_id: 1})
    so, meta = e.schedule()
    e.output(so)
    assert e.connector.sched.store.host.num_used == 4  # both prompts' two chunks each


def test_an_unsupported_vllm_is_refused_when_the_connector_is_built(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also where vLLM's general plugins are off and the connector comes by
    module path (vLLM then never runs the check kvsdk's plugin hooks into its
    transfer config): the scheduler side names the version and refuses."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvsdk.config import ConfigError

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ConfigError, match=r"kvsdk supports vLLM .*this is vLLM 0\.31\.2"):
        KVSDKConnector(
            engine.scheduler.vllm_config, KVConnectorRole.SCHEDULER, engine.kv_cache_config
        )


# -- a hit loads in the step that schedules its request (vLLM-CPU) --------------------------------


def test_a_hit_is_loaded_before_the_forward_pass_of_the_step_that_schedules_it(
    engine: Engine,
) -> None:
    """On vLLM-CPU kvsdk's loads are synchronous: vLLM schedules the request in
    the step that loads it (no step in ``WAITING_FOR_REMOTE_KVS``), the worker
    copies the KV in before the forward pass and never reports the request in
    ``finished_recving``. A request that finishes in that step, with a chunk
    it computed there still to store, keeps its blocks until that store ran
    (the load is reported done only after vLLM's ``request_finished``)."""
    e = engine
    assert e.connector.sched.sync_loads
    w = Worker(e)
    try:
        w.xfer.open()
        e.add("ab", prompt_tokens=3 * CHUNK + 5, max_tokens=1)
        w.run_steps(e, 3)  # computed, stored, released
        e.assert_empty()
        stored = {b: w.kv[LAYER_NAMES[0]][b].clone() for b in range(1, 1 + 3 * CHUNK // BLOCK)}
        assert e.scheduler.reset_prefix_cache()  # vLLM's own cache: the hit is kvsdk's

        # the same prompt and a chunk more (tokens come from the id's character sum and
        # the position): kvsdk holds the first three chunks
        e.add("ba", prompt_tokens=4 * CHUNK + 5, max_tokens=1)
        so, meta = e.schedule()
        assert so.num_scheduled_tokens == {"ba": CHUNK + 5}  # scheduled now, after the hit
        assert so.has_sync_kv_loads and meta.sync_loads
        ((job_rid, job),) = meta.loads.values()
        assert job_rid == "ba"
        loaded = [int(b) for c in job.copies for b in c.engine_blocks]
        blocks = e.blocks_of("ba")
        assert loaded == blocks[: 3 * CHUNK // BLOCK]
        w.side.flush(meta)
        w.side.start_loads(meta)  # before the forward pass: the copy is done on return
        for b_new, b_old in zip(loaded, stored, strict=True):
            assert torch.equal(w.kv[LAYER_NAMES[0]][b_new], stored[b_old])
        w.side.submit_stores(meta)
        assert w.side.poll() == set()  # never in finished_recving: vLLM is not waiting for it
        e.output(so, worker_meta=w.side.take_meta())
        assert e.finished_returned["ba"] is True  # its fourth chunk is stored next step
        assert e.holds("ba")

        so, meta = e.schedule()
        assert meta.release == {"ba"}
        (store,) = store_jobs(meta, "ba")
        assert [int(b) for c in store.copies for b in c.engine_blocks] == blocks[6:8]
        out = w.step(so, e.scheduler)
        assert out.finished_sending == {"ba"}
        e.output(so, worker_meta=out.kv_connector_worker_meta, finished_sending={"ba"})
        e.assert_empty()
    finally:
        w.shutdown()
