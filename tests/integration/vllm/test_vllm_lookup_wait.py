"""vLLM's real scheduler with KVSDKConnector over a slower tier: a request that
cannot hit is scheduled in the same step as it would be without kvsdk (the
step's bounded wait for the tier's answer, or the tier's local index), and a
request whose chunks the shared tier holds is still deferred, promoted and
loaded. Stepped by hand without a model (see test_vllm_scheduler_holds_blocks)."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from kvsdk.plugins.vllm.connector import KVSDKConnector
from kvsdk.plugins.vllm.messages import KVSDKConnectorMetadata
from kvsdk.plugins.vllm.workloads.model_free_scheduler import (
    model_free_scheduler,
    write_llama_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the redis-server helpers
from redis_server import REDIS_SERVER, RedisServer, missing_tool

BLOCK = 16
CHUNK = 32
LAYERS = 2
KV_HEADS, HEAD = 2, 16
PROMPT_TOKENS = 4 * CHUNK + 5  # 4 whole chunks and a tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
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


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 50 for i in range(PROMPT_TOKENS)]


class Engine:
    def __init__(self, model: str, tiers: list[dict[str, Any]], **config: Any) -> None:
        self.scheduler: Scheduler = model_free_scheduler(
            model,
            engine_id=f"kvsdk-test-lookup-wait-{uuid.uuid4()}",
            kvsdk_config={"chunk_tokens": CHUNK, "tiers": tiers, **config},
            block_size=BLOCK,
            num_blocks=64,
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVSDKConnector)
        self.connector = connector

    def add(self, rid: str, tokens: list[int]) -> None:
        self.scheduler.add_request(
            Request(
                rid,
                tokens,
                SamplingParams(max_tokens=4, ignore_eos=True),
                None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
        )

    def step(self) -> SchedulerOutput:
        """One scheduler step, the model runner's output played back (one token
        per scheduled request, no worker reports)."""
        so = self.scheduler.schedule()
        ids = list(so.num_scheduled_tokens)
        self.scheduler.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
            ),
        )
        return so

    def write_to_shared_tier(self, rid: str) -> int:
        """``rid``'s chunks written straight into the slower tiers, as another
        engine's write-through would have; returns how many."""
        core = self.connector.sched.core
        (keys,) = core._requests[rid].keys
        store = core.store
        payload = memoryview(bytes(store._slot_bytes))
        stored = store.chain.write(keys, [payload] * len(keys))
        return len(stored.get(1, []))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.scheduler.shutdown()


def slow_disk(path: Path, latency_ms: float) -> dict[str, Any]:
    """The disk tier behind the ``faulty`` wrapper adding ``latency_ms`` to every call."""
    return {
        "backend": "faulty",
        "latency_ms": latency_ms,
        "wraps": {"backend": "disk", "path": str(path), "capacity": "64MiB"},
    }


HOST = {"backend": "cpu", "capacity": "4MiB"}


def test_a_request_no_tier_holds_is_scheduled_in_its_first_step(
    model_dir: str, tmp_path: Path, engines: list[Engine]
) -> None:
    """kvsdk's defaults over a disk tier: the disk says "absent" within the
    step's wait, so the request runs in the step vLLM alone would run it in.
    Without the wait (``lookup_wait_ms: 0``) it sits out a step: the test
    catches a lookup that defers a request it cannot serve."""
    e = Engine(model_dir, [HOST, {"backend": "disk", "path": str(tmp_path / "d")}])
    engines.append(e)
    time.sleep(0.5)  # a server's first request comes after its start: the tier is warm
    e.add("new", prompt(1))
    assert "new" in e.step().num_scheduled_tokens
    never_waits = Engine(model_dir, [HOST, {"backend": "disk", "path": str(tmp_path / "n")}],
                         lookup_wait_ms=0)  # fmt: skip
    engines.append(never_waits)
    never_waits.add("new", prompt(1))
    assert "new" not in never_waits.step().num_scheduled_tokens


def test_a_slow_tier_defers_only_requests_it_may_serve(
    model_dir: str, tmp_path: Path, engines: list[Engine]
) -> None:
    """A disk tier slowed to 300 ms a call: a lookup cannot be answered within
    the step's wait, so the request is deferred (the bounded wait is all it
    costs the step), and once the tier answered it runs; a request whose
    chunks are there is promoted and loaded: scheduled with them computed."""
    e = Engine(model_dir, [HOST, slow_disk(tmp_path, 300)])
    engines.append(e)
    e.add("new", prompt(2))
    so = e.step()
    assert "new" not in so.num_scheduled_tokens
    for _ in range(200):
        if "new" in e.step().num_scheduled_tokens:
            break
    else:
        raise AssertionError("the request was never scheduled")
    writer = Engine(model_dir, [HOST, {"backend": "disk", "path": str(tmp_path)}])
    engines.append(writer)
    writer.add("w", prompt(3))
    writer.step()  # the connector learns the request (and its chunks' keys)
    assert writer.write_to_shared_tier("w") == 4
    e.add("hit", prompt(3))
    deferred = 0
    for _ in range(400):
        so = e.step()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        loads = [job for rid, job in meta.loads.values() if rid == "hit"]
        if loads:
            break
        assert "hit" not in so.num_scheduled_tokens  # never computed instead of loaded
        deferred += 1
    else:
        raise AssertionError("the request with a hit was never loaded")
    assert deferred >= 1  # it waited for the promotion from the slow tier
    (load,) = loads
    assert sum(len(c.engine_blocks) for c in load.copies) == 4 * CHUNK // BLOCK


def test_a_prompt_vllms_own_cache_holds_is_never_deferred(
    model_dir: str, tmp_path: Path, engines: list[Engine]
) -> None:
    """The whole prompt in vLLM's prefix cache but its last, partial block: kvsdk
    may hold that tail only in a slow tier (300 ms a call), and waiting a
    step for less than a block of compute is never worth it: the repeat runs
    in its first step."""
    e = Engine(model_dir, [HOST, slow_disk(tmp_path, 300)])
    engines.append(e)
    e.add("first", prompt(4))
    for _ in range(400):
        e.step()
        if e.scheduler.requests["first"].is_finished():
            break  # (its blocks held for kvsdk's stores: no worker reports them here)
    else:
        raise AssertionError("the first request never finished")
    e.add("repeat", prompt(4))
    so = e.step()
    assert "repeat" in so.num_scheduled_tokens
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == PROMPT_TOKENS // BLOCK * BLOCK  # vLLM's own hit


def steps_until_loaded(e: Engine, rid: str) -> int:
    """Steps ``rid`` sat out before it was scheduled with a load (never computed
    instead of loaded)."""
    for deferred in range(400):
        so = e.step()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        loads = [job for r, job in meta.loads.values() if r == rid]
        if loads:
            (load,) = loads
            assert sum(len(c.engine_blocks) for c in load.copies) == 4 * CHUNK // BLOCK
            return deferred
        assert rid not in so.num_scheduled_tokens
    raise AssertionError(f"{rid} was never loaded")


@pytest.mark.parametrize("promotion_wait_ms", [250, 0])
def test_a_hit_promoted_within_a_step_loads_in_its_first_step(
    model_dir: str, tmp_path: Path, engines: list[Engine], promotion_wait_ms: int
) -> None:
    """An engine whose steps take 100 ms (a one-core CPU engine's prefill steps
    take seconds): a request whose chunks another engine left in the shared
    tier waits within its first step for their promotion (a few ms) and loads
    there, instead of sitting out a whole step. With ``promotion_wait_ms: 0``
    it sits out at least one: what the test would catch."""
    e = Engine(
        model_dir,
        [HOST, {"backend": "disk", "path": str(tmp_path)}],
        promotion_wait_ms=promotion_wait_ms,
        lookup_wait_ms=200,  # the disk answers at once when the machine is not busy
    )
    engines.append(e)
    for _ in range(15):  # the engine's recent steps: 100 ms each
        e.step()
        time.sleep(0.1)
    writer = Engine(model_dir, [HOST, {"backend": "disk", "path": str(tmp_path)}])
    engines.append(writer)
    writer.add("w", prompt(5))
    writer.step()
    assert writer.write_to_shared_tier("w") == 4
    e.add("hit", prompt(5))
    start = time.perf_counter()
    deferred = steps_until_loaded(e, "hit")
    if promotion_wait_ms:
        assert deferred == 0
        assert time.perf_counter() - start < 0.1 * 1.5  # never longer than a step
    else:
        assert deferred >= 1


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.kill()


def slow_redis(url: str, latency_ms: float) -> dict[str, Any]:
    """The Redis tier (its defaults: a local index on) slowed by ``latency_ms`` a call."""
    return {
        "backend": "faulty",
        "latency_ms": latency_ms,
        "wraps": {"backend": "redis", "url": url},
    }


def test_a_slow_redis_tier_with_its_index_defers_only_requests_it_can_serve(
    model_dir: str, redis_url: str, engines: list[Engine]
) -> None:
    """Redis slowed to 300 ms a call: a prompt it never held runs in its first
    step all the same (the tier's local index says no at once, the server is
    not asked), while a prompt another engine wrote there is deferred,
    promoted and loaded."""
    writer = Engine(model_dir, [HOST, {"backend": "redis", "url": redis_url}])
    engines.append(writer)
    writer.add("w", prompt(5))
    writer.step()
    assert writer.write_to_shared_tier("w") == 4
    e = Engine(model_dir, [HOST, slow_redis(redis_url, 300)])
    engines.append(e)
    tier = e.connector.sched.core.store.lower[0]
    deadline = time.monotonic() + 30
    while tier.stats().get("index_seeded", 1) != 1:  # its start-up scan of the server
        assert time.monotonic() < deadline, "the Redis tier's index never seeded"
        time.sleep(0.05)
    for n in range(3):
        e.add(f"new{n}", prompt(10 + n))
        assert f"new{n}" in e.step().num_scheduled_tokens
    unindexed = slow_redis(redis_url, 300)
    unindexed["wraps"]["local_index"] = False
    without = Engine(model_dir, [HOST, unindexed])  # what the index saves
    engines.append(without)
    without.add("new", prompt(20))
    assert "new" not in without.step().num_scheduled_tokens
    e.add("hit", prompt(5))
    deferred = 0
    for _ in range(400):
        so = e.step()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        if any(rid == "hit" for rid, _ in meta.loads.values()):
            break
        assert "hit" not in so.num_scheduled_tokens
        deferred += 1
    else:
        raise AssertionError("the request with a hit was never loaded")
    assert deferred >= 1
