"""Prefill/decode roles and kvsdk's P/D hand-off on vLLM's real Scheduler,
stepped by hand without a model (the model runner is played by the test, the
worker side is kvsdk's real ``WorkerSide`` copying blocks into the host slab).

A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``) share a
disk tier in one directory, as two engines on one machine do: what the
producer stores reaches the directory through its write-through, and the
consumer reads it from there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvsdk.config import ConfigError
from kvsdk.plugins.vllm.connector import KVSDKConnector
from kvsdk.plugins.vllm.messages import KVSDKConnectorMetadata
from kvsdk.plugins.vllm.pd_params import HANDOFF_KEY
from kvsdk.plugins.vllm.worker_side import WorkerSide
from kvsdk.plugins.vllm.workloads.model_free_scheduler import (
    model_free_scheduler,
    write_llama_config,
)
from kvsdk.transfer import Direction, TransferJob, TransferResult, TransferWorker
from kvsdk.transfer.cpu import CPUTransferWorker

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 64
LAYERS = 2
KV_HEADS, HEAD = 2, 16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PROMPT = 3 * CHUNK + 7  # three whole chunks and a tail
ROUTER_PREFILL_PARAMS = {
    # what vllm-router 0.1.17 --vllm-pd-disaggregation sends the prefill engine
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


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


def tiers(shared: Path | None) -> list[dict[str, Any]]:
    host: dict[str, Any] = {"backend": "cpu", "capacity": "2MiB"}
    if shared is None:
        return [host]
    return [host, {"backend": "disk", "path": str(shared), "capacity": "64MiB"}]


class GatedStores(TransferWorker):
    """The CPU worker, with store jobs held back while ``held`` (a slow copy)."""

    name = "gated"

    def __init__(self) -> None:
        self.inner = CPUTransferWorker(sync_stores=True)
        self.held = False
        self.queued: list[TransferJob] = []

    def register(self, groups: Any, slab: torch.Tensor) -> None:
        self.inner.register(groups, slab)

    def submit(self, job: TransferJob) -> None:
        if job.direction is Direction.STORE and self.held:
            self.queued.append(job)
        else:
            self.inner.submit(job)

    def release(self) -> None:
        self.held = False
        for job in self.queued:
            self.inner.submit(job)
        self.queued.clear()

    def wait(self, job_ids: Any) -> None:
        self.inner.wait(job_ids)

    def poll(self) -> list[TransferResult]:
        return self.inner.poll()

    def shutdown(self) -> None:
        self.inner.shutdown()


class Engine:
    """vLLM's Scheduler with KVSDKConnector in ``role``, and a worker of kvsdk's
    that copies its blocks (the test writes the blocks' KV as a forward pass would)."""

    def __init__(self, model: str, role: str, shared: Path | None, **config: Any) -> None:
        self.scheduler = model_free_scheduler(
            model,
            engine_id=f"kvsdk-test-pd-{uuid.uuid4()}",
            kvsdk_config={"chunk_tokens": CHUNK, "tiers": tiers(shared), **config},
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            kv_role=role,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVSDKConnector)
        self.connector = connector
        self.returned: dict[str, tuple[bool, Any]] = {}
        original = connector.request_finished_all_groups

        def spy(request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
            out = original(request, block_ids)
            self.returned[request.request_id] = out
            return out

        connector.request_finished_all_groups = spy  # type: ignore[method-assign]
        self.side = WorkerSide(connector.layout, pp_rank=0, tp_rank=0)
        self.xfer = GatedStores()
        self.side._workers = {"cpu": lambda: self.xfer}
        gen = torch.Generator().manual_seed(0)
        self.kv = {
            name: torch.randn((NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD), generator=gen)
            for name in LAYER_NAMES
        }
        self.side.register_kv_caches(self.kv)
        hs = self.side.handshake()
        assert hs.error is None, hs.error
        connector.set_xfer_handshake_metadata_pp_aware({(0, 0): hs})
        self.meta: list[KVSDKConnectorMetadata] = []

    def add(self, rid: str, tokens: list[int], max_tokens: int, params: Any = None) -> Request:
        extra = {"kv_transfer_params": params} if params is not None else None
        req = Request(
            rid,
            tokens,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
            None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, the worker's calls in the model runner's
        order (the forward pass writes each scheduled block's KV: a function of
        the block's position in its request), the output back to vLLM."""
        s = self.scheduler
        so = s.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, KVSDKConnectorMetadata)
        self.meta.append(meta)
        side = self.side
        side.flush(meta)
        side.start_loads(meta)  # synchronous on the CPU platform: before the forward pass
        for rid, n in so.num_scheduled_tokens.items():
            req = s.requests[rid]
            start = req.num_computed_tokens - n  # vLLM advanced it when it scheduled
            ids = s.kv_cache_manager.get_block_ids(rid)[0]
            for b in range(start // BLOCK, (start + n - 1) // BLOCK + 1):
                for li, t in enumerate(self.kv.values()):
                    t[ids[b]].fill_(li * 10_000 + b * 100 + req.all_token_ids[b * BLOCK] % 97)
        side.submit_stores(meta)
        recving = side.poll()
        out = KVConnectorOutput(
            finished_sending=side.take_released() or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=side.take_meta(),
        )
        ids = list(so.num_scheduled_tokens)
        s.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=out,
            ),
        )
        return so

    def run_until_idle(self, limit: int = 200) -> None:
        """Steps until vLLM holds no request and kvsdk's tier writes landed."""
        for _ in range(limit):
            if not self.scheduler.has_requests() and not self.connector.has_pending_push_work():
                store = self.connector.sched.store
                if not store.has_pending_work():
                    return
                store.wait_io(0.05)
            self.step()
        raise AssertionError("the engine did not settle")

    def counter(self, name: str, **labels: Any) -> float:
        m = self.connector.sched.store.metrics
        self.connector.sched.store.flush_metrics()
        return m.counter(name, **labels)

    def shutdown(self) -> None:
        self.side.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def engines(model_dir: str) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.shutdown()


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 50 for i in range(n)]


def stored_keys(e: Engine) -> int:
    """Entries the engine's store jobs wrote (one host slot each)."""
    return len({int(s) for m in e.meta for j in m.stores for c in j.copies for s in c.slots})


# -- roles ---------------------------------------------------------------------------------------


def test_a_consumer_stores_nothing_and_frees_its_blocks_at_once(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    e = Engine(model_dir, "kv_consumer", tmp_path)
    engines.append(e)
    e.add("a", prompt(1), max_tokens=3)
    e.run_until_idle()
    assert stored_keys(e) == 0
    assert e.returned == {"a": (False, None)}
    assert e.counter("kvsdk_stored_bytes_total") == 0


def test_both_stores_whole_chunks_and_a_producer_also_the_tail_admission_would_skip(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    """``prompt_tail: false`` and a second-sight admission (a prompt seen once is not
    stored): ``kv_both`` stores nothing of a first prompt; ``kv_producer`` stores
    its three chunks and its tail."""
    cfg = {"prompt_tail": False, "admission": {"policy": "second_sight", "min_lookups": 2}}
    both = Engine(model_dir, "kv_both", tmp_path / "both", **cfg)
    engines.append(both)
    both.add("a", prompt(2), max_tokens=1)
    both.run_until_idle()
    assert stored_keys(both) == 0

    producer = Engine(model_dir, "kv_producer", tmp_path / "p", **cfg)
    engines.append(producer)
    producer.add("a", prompt(2), max_tokens=1)
    producer.run_until_idle()
    assert stored_keys(producer) == 4  # 3 whole chunks + the tail
    assert producer.returned["a"][1] is None  # not asked for a remote decode: no hand-off


def test_a_producer_loads_nothing_it_was_not_told_to(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path)
    engines.append(p)
    p.add("a", prompt(3), max_tokens=1)
    p.run_until_idle()
    assert p.scheduler.reset_prefix_cache()
    p.add("b", prompt(3), max_tokens=1)  # the same prompt: kvsdk holds it
    so = p.step()
    assert so.num_scheduled_tokens == {"b": PROMPT}  # computed, not loaded
    assert not any(m.loads for m in p.meta)


@pytest.mark.parametrize("role", ["kv_bogus", "kv_producer", "kv_consumer"])
def test_a_bad_role_or_a_role_without_a_shared_tier_is_refused(
    model_dir: str, role: str, tmp_path: Path
) -> None:
    if role == "kv_bogus":  # vLLM refuses it too; kvsdk must, where vLLM let it through
        import vllm.config.kv_transfer as kvt

        e = Engine(model_dir, "kv_both", tmp_path)
        try:
            e.scheduler.vllm_config.kv_transfer_config.kv_role = role  # type: ignore[assignment]
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            with pytest.raises(ConfigError, match=r"^kv_role 'kv_bogus' is not supported by kvsdk"):
                KVSDKConnector(
                    e.scheduler.vllm_config,
                    KVConnectorRole.SCHEDULER,
                    e.scheduler.kv_cache_config,
                )
        finally:
            e.shutdown()
        assert kvt  # (the module whose Literal lists vLLM's roles)
        return
    with pytest.raises(ConfigError, match=rf"kv_role '{role}' needs a tier both engines read"):
        Engine(model_dir, role, None)


# -- the hand-off --------------------------------------------------------------------------------


def prefill(p: Engine, rid: str, tokens: list[int]) -> dict[str, Any]:
    """The router's prefill request on ``p``; returns its response's kv_transfer_params."""
    p.add(rid, tokens, max_tokens=1, params=dict(ROUTER_PREFILL_PARAMS))
    so = p.step()
    assert so.num_scheduled_tokens == {rid: len(tokens)}
    held, params = p.returned[rid]
    assert held is True  # its stores read the blocks: freed when they landed
    assert isinstance(params, dict)
    return params


def until_scheduled(e: Engine, limit_s: float = 5.0) -> SchedulerOutput:
    """Steps until one schedules something (the chunks' promotion from the
    shared directory may take a step or two)."""
    start = time.monotonic()
    while not (so := e.step()).num_scheduled_tokens:
        assert time.monotonic() - start < limit_s, "never scheduled"
    return so


def test_a_prefill_returns_the_hand_off_and_the_decode_loads_its_chunks(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path)
    d = Engine(model_dir, "kv_consumer", tmp_path)
    engines += [p, d]
    tokens = prompt(4)
    params = prefill(p, "r1", tokens)
    h = params[HANDOFF_KEY]
    assert params["do_remote_decode"] is False and params["do_remote_prefill"] is False
    assert h["tokens"] == PROMPT and h["namespace"] == p.connector.sched.core.ns_fp.hex()
    assert len(h["ready"]) == 32
    p.run_until_idle()  # stores landed, written through to the shared directory

    d.add("r1", tokens, max_tokens=3, params=params)
    so = until_scheduled(d)
    assert so.num_scheduled_tokens == {"r1": 1}  # the prompt loaded but its last token
    assert so.scheduled_new_reqs[0].num_computed_tokens == PROMPT - 1
    (load,) = [j for m in d.meta for _, j in m.loads.values()]
    # the decode's blocks hold the bytes the prefill's forward pass wrote
    p_blocks = [int(b) for m in p.meta for j in m.stores for c in j.copies for b in c.engine_blocks]
    d_blocks = [int(b) for c in load.copies for b in c.engine_blocks]
    assert len(d_blocks) == len(p_blocks) == -(-PROMPT // BLOCK)
    for name in LAYER_NAMES:
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert torch.equal(p.kv[name][pb], d.kv[name][db])
    d.run_until_idle()
    assert d.counter("kvsdk_pd_handoffs_total", outcome="loaded") == 1
    assert stored_keys(d) == 0


def test_a_decode_waits_unscheduled_until_the_chunks_land_then_loads(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path)
    d = Engine(model_dir, "kv_consumer", tmp_path, pd={"wait_s": 30})
    engines += [p, d]
    tokens = prompt(5)
    p.xfer.held = True  # the prefill's copies are slow
    params = prefill(p, "r1", tokens)  # its stores not landed: nothing in the directory yet
    d.add("r1", tokens, max_tokens=2, params=params)
    for _ in range(3):
        t0 = time.perf_counter()
        so = d.step()
        assert not so.num_scheduled_tokens  # waiting, not recomputing
        assert time.perf_counter() - t0 < 1.0  # never blocks the scheduler for long
    assert d.scheduler.requests["r1"].status is RequestStatus.WAITING
    p.xfer.release()
    p.run_until_idle()  # the prefill's stores land in the shared tier
    # within a few steps: not after the lifetime (1 s, a few hundred steps here) of
    # the miss the tier answered before they landed
    steps = 1
    while not (so := d.step()).num_scheduled_tokens and steps < 1000:
        steps += 1
    assert steps <= 10
    assert so.num_scheduled_tokens == {"r1": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == PROMPT - 1
    d.run_until_idle()
    assert d.counter("kvsdk_pd_handoffs_total", outcome="loaded") == 1


def test_a_decode_recomputes_after_the_deadline(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path / "p")
    d = Engine(model_dir, "kv_consumer", tmp_path / "d", pd={"wait_s": 0.3})  # shares nothing
    engines += [p, d]
    tokens = prompt(6)
    params = prefill(p, "r1", tokens)
    d.add("r1", tokens, max_tokens=2, params=params)
    start = time.monotonic()
    while not (so := d.step()).num_scheduled_tokens:
        assert time.monotonic() - start < 5
    assert time.monotonic() - start >= 0.3
    assert so.num_scheduled_tokens == {"r1": PROMPT}  # recomputed
    d.run_until_idle()
    assert d.counter("kvsdk_pd_handoffs_total", outcome="timeout") == 1
    assert d.counter("kvsdk_pd_handoffs_total", outcome="loaded") == 0


@pytest.mark.parametrize("wrong", ["namespace", "ready", "tokens"])
def test_a_foreign_or_mismatched_hand_off_is_refused_and_recomputed(
    model_dir: str, engines: list[Engine], tmp_path: Path, wrong: str
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path)
    d = Engine(model_dir, "kv_consumer", tmp_path, pd={"wait_s": 30})
    engines += [p, d]
    tokens = prompt(7)
    params = prefill(p, "r1", tokens)
    p.run_until_idle()
    h = params[HANDOFF_KEY]
    if wrong == "namespace":
        h["namespace"] = "00" * 16
    elif wrong == "ready":
        h["ready"] = "ff" * 16
    else:
        h["tokens"] = PROMPT - 7  # another split of the prompt than the stored one's
    # another prompt carrying the hand-off is refused as well: its keys differ
    d.add("r1", tokens, max_tokens=2, params=params)
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": PROMPT}  # no wait, nothing loaded
    assert not any(m.loads for m in d.meta)
    outcome = "foreign" if wrong == "namespace" else "mismatch"
    assert d.counter("kvsdk_pd_handoffs_total", outcome=outcome) == 1
    d.run_until_idle()


def test_a_hand_off_for_another_prompt_is_refused(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    p = Engine(model_dir, "kv_producer", tmp_path)
    d = Engine(model_dir, "kv_consumer", tmp_path, pd={"wait_s": 30})
    engines += [p, d]
    params = prefill(p, "r1", prompt(8))
    p.run_until_idle()
    d.add("r1", prompt(9), max_tokens=1, params=params)
    so = d.step()
    assert so.num_scheduled_tokens == {"r1": PROMPT}
    assert d.counter("kvsdk_pd_handoffs_total", outcome="mismatch") == 1
    d.run_until_idle()


def test_a_decode_that_loaded_but_found_no_blocks_loads_when_asked_again(
    model_dir: str, engines: list[Engine], tmp_path: Path
) -> None:
    """vLLM looks a waiting request up again each step until it can allocate
    its blocks: a hand-off settled as loaded keeps loading, not recomputing."""
    p = Engine(model_dir, "kv_producer", tmp_path)
    d = Engine(model_dir, "kv_consumer", tmp_path, pd={"wait_s": 30})
    engines += [p, d]
    tokens = prompt(10)
    params = prefill(p, "r1", tokens)
    p.run_until_idle()
    d.add("big", prompt(11, 58 * BLOCK), max_tokens=500)  # takes 58 of the 63 blocks
    so = until_scheduled(d)
    assert so.num_scheduled_tokens == {"big": 58 * BLOCK}
    d.add("r1", tokens, max_tokens=2, params=params)
    start = time.monotonic()
    while not d.counter("kvsdk_pd_handoffs_total", outcome="loaded"):
        assert time.monotonic() - start < 5
        assert set(d.step().num_scheduled_tokens) == {"big"}
    for _ in range(3):  # looked up (loaded), but its 7 blocks are not free
        assert set(d.step().num_scheduled_tokens) == {"big"}
    d.scheduler.finish_requests("big", RequestStatus.FINISHED_ABORTED)
    so = until_scheduled(d)
    assert so.num_scheduled_tokens == {"r1": 1}  # loaded, not recomputed
    assert so.scheduled_new_reqs[0].num_computed_tokens == PROMPT - 1
    d.run_until_idle()
