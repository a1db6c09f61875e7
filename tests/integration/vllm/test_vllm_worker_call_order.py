"""kvsdk's worker side reports right in either order vLLM calls it.

vLLM 0.32's model runner calls ``wait_for_save`` (kvsdk submits the step's
stores) before ``get_finished`` (kvsdk reports loads done and released
requests). 0.33's model runner V2 with a drafter calls ``get_finished`` first
and ``wait_for_save`` after the drafter ran. A request whose last stores are
in the step that releases it must then not be reported as sent before those
stores were even submitted (vLLM would free, zero or reuse the blocks they
read). vLLM's real Scheduler and kvsdk's real worker side (a CPU transfer
worker, the engine's shared-memory slab) run here, the test playing the model
runner in each order; the slab must end up holding the blocks' KV.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from test_vllm_scheduler_holds_blocks import (  # noqa: E402
    BLOCK,
    CHUNK,
    LAYER_NAMES,
    NUM_BLOCKS,
    Engine,
    Worker,
    model_dir,
    store_jobs,
)

__all__ = ["model_dir"]  # the fixture, shared with test_vllm_scheduler_holds_blocks

from kvsdk.plugins.vllm.messages import KVSDKConnectorMetadata  # noqa: E402

ORDERS = ["save_then_finished", "finished_then_save"]
"""vLLM 0.32 (and 0.33 without a drafter); 0.33's model runner V2 with a drafter."""


class OrderedWorker(Worker):
    """The worker's connector calls in one of the two orders."""

    def __init__(self, e: Engine, order: str) -> None:
        super().__init__(e)
        self.order = order
        self.xfer.open()

    def step(self, so: SchedulerOutput, scheduler: object) -> KVConnectorOutput:
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        self.step_no += 1
        self.side.flush(meta)  # handle_preemptions
        for rid in so.num_scheduled_tokens:  # the forward pass writes the step's KV
            for b in scheduler.kv_cache_manager.get_block_ids(rid)[0]:  # type: ignore[attr-defined]
                for t in self.kv.values():
                    t[b].fill_(self.step_no * 1000 + b)
        self.side.start_loads(meta)
        if self.order == "save_then_finished":
            self.side.submit_stores(meta)  # wait_for_save
        recving = self.side.poll()  # get_finished
        sending = self.side.take_released()
        worker_meta = self.side.take_meta()  # build_connector_worker_meta
        if self.order == "finished_then_save":
            self.side.submit_stores(meta)  # wait_for_save, after the drafter
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving or None,
            kv_connector_worker_meta=worker_meta,
        )


@pytest.mark.parametrize("order", ORDERS)
def test_a_request_is_released_only_after_its_last_stores_ran(model_dir: str, order: str) -> None:
    e = Engine(model_dir, f"kvsdk-test-order-{uuid.uuid4()}")
    w = OrderedWorker(e, order)
    try:
        max_tokens = 40  # its second chunk (tokens 32..63) is stored at its finish
        e.add("d", prompt_tokens=CHUNK, max_tokens=max_tokens)
        for _ in range(max_tokens):
            so, _ = e.schedule()
            out = w.step(so, e.scheduler)
            e.output(so, worker_meta=out.kv_connector_worker_meta)
        assert e.finished_returned == {"d": True}
        blocks = e.blocks_of("d")
        kv_at_finish = {b: w.kv[LAYER_NAMES[0]][b].clone() for b in blocks}
        so, meta = e.schedule()
        assert meta.release == {"d"}
        (last,) = store_jobs(meta, "d")
        out = w.step(so, e.scheduler)
        if order == "finished_then_save":
            # asked before its last store was submitted: not released yet
            assert not out.finished_sending
            e.output(so, worker_meta=out.kv_connector_worker_meta)
            assert e.holds("d") and e.free_blocks == NUM_BLOCKS - 1 - len(blocks)
        else:  # the store was submitted first, and the CPU worker copies as it is submitted
            assert out.finished_sending == {"d"}
            e.output(
                so, worker_meta=out.kv_connector_worker_meta, finished_sending=out.finished_sending
            )
        for _ in range(3):  # reported done, then released: vLLM frees the blocks
            so, _ = e.schedule()
            out = w.step(so, e.scheduler)
            e.output(
                so, worker_meta=out.kv_connector_worker_meta, finished_sending=out.finished_sending
            )
            if not e.holds("d"):
                break
        e.assert_empty()
        slab = w.side._slab
        assert slab is not None
        region = slab.region(0)
        block_bytes = e.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        (c,) = last.copies
        assert [int(b) for b in c.engine_blocks] == blocks[CHUNK // BLOCK : 2 * CHUNK // BLOCK]
        for b, slot, off in zip(c.engine_blocks, c.slots, c.offsets, strict=True):
            layer0 = region[int(slot), int(off) * block_bytes : (int(off) + 1) * block_bytes]
            assert torch.equal(layer0, kv_at_finish[int(b)].reshape(-1).view(torch.uint8))
    finally:
        w.shutdown()
        e.scheduler.shutdown()
