"""kvsdk loads and counts exactly the hit vLLM takes.

With auxiliary outputs on (routed experts), vLLM 0.33's scheduler caps an
external hit to whole blocks its auxiliary cache holds
(``AuxOutputSchedulerConnector.cap_external_hit``): a prompt-tail hit from
kvsdk becomes no hit at all, and vLLM computes the whole prompt. kvsdk then
must not load the tail into blocks vLLM recomputes, nor count the promise as
hit tokens. vLLM 0.32's auxiliary connector has no cap: the hit is taken (one
token fewer, the load being synchronous on CPU).

vLLM's real Scheduler and its real auxiliary-output connector, built as the
Scheduler builds it, attached once the prompt is stored (its own model runner
outputs are not played by this test); kvsdk's real scheduler side.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
from vllm.v1.core.sched.scheduler import Scheduler

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from test_vllm_scheduler_holds_blocks import (  # noqa: E402
    BLOCK,
    CHUNK,
    Engine,
    model_dir,
)

__all__ = ["model_dir"]  # the fixture, shared with test_vllm_scheduler_holds_blocks

CAPS_HITS = hasattr(AuxOutputSchedulerConnector, "cap_external_hit")  # vLLM 0.33
PROMPT = CHUNK + 5  # a whole chunk and a 5-token tail


def aux_connector(scheduler: Scheduler) -> AuxOutputSchedulerConnector:
    """As vLLM's Scheduler builds it when auxiliary outputs are enabled."""
    if CAPS_HITS:
        return AuxOutputSchedulerConnector(  # type: ignore[call-arg]
            scheduler.kv_cache_manager, scheduler.connector
        )
    return AuxOutputSchedulerConnector()


def test_a_tail_hit_vllm_caps_loads_nothing_and_counts_nothing(model_dir: str) -> None:
    e = Engine(model_dir, f"kvsdk-test-capped-{uuid.uuid4()}", prompt_tail=True)
    metrics = e.connector.sched.store.metrics
    try:
        e.add("a", prompt_tokens=PROMPT, max_tokens=1)
        for _ in range(3):  # stored (its whole chunk and its tail), released, freed
            so, meta = e.schedule()
            e.output(
                so,
                completed={j.job_id: 1 for j in meta.stores},
                finished_sending=set(meta.release) or None,
            )
        e.assert_empty()
        assert e.connector.sched.store.host.num_used == 2
        assert e.scheduler.reset_prefix_cache()  # any hit now is kvsdk's
        e.scheduler.aux_output_connector = aux_connector(e.scheduler)

        e.add("a", prompt_tokens=PROMPT, max_tokens=1)  # the same prompt again
        so, meta = e.schedule()
        (new,) = so.scheduled_new_reqs
        taken = new.num_computed_tokens  # all external: vLLM's own cache is empty
        blocks = e.blocks_of("a")
        if CAPS_HITS:
            assert taken == 0  # capped: vLLM computes the prompt itself
            assert so.num_scheduled_tokens == {"a": PROMPT}
            assert not meta.loads
        else:
            assert taken == PROMPT - 1  # the tail too, but for the token vLLM computes
            ((rid, load),) = meta.loads.values()
            assert rid == "a"
            assert [int(b) for c in load.copies for b in c.engine_blocks] == blocks[
                : -(-PROMPT // BLOCK)
            ]
        assert metrics.counter("kvsdk_hit_tokens_total") == taken
    finally:
        e.scheduler.shutdown()
