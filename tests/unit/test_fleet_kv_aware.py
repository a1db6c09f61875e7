"""``kvsdk bench fleet``'s ``kv_aware`` policy: each engine publishes vLLM's KV
events on a port of its own, the router subscribes to every engine at
vLLM-CPU's block size."""

from __future__ import annotations

import json

from kvsdk.plugins.vllm.workloads.fleet_configs import EngineInfo, parse_config

ENGINES = [
    EngineInfo(0, "http://127.0.0.1:8001", 5601, "/models/llama"),
    EngineInfo(1, "http://127.0.0.1:8002", 5602, "/models/llama"),
]


def test_kv_aware_engines_publish_on_their_own_port() -> None:
    policy = parse_config("kvsdk-redis-kv_aware").policy
    flag, value = policy.engine_args(ENGINES[1])
    assert flag == "--kv-events-config"
    assert json.loads(value) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5602",
    }


def test_kv_aware_router_subscribes_to_every_engine() -> None:
    config = parse_config("none-kv_aware")
    assert config.tier is None and config.policy.value == "kv_aware"
    assert config.policy.router_args(ENGINES) == [
        "--kv-event-source", "http://127.0.0.1:8001=tcp://127.0.0.1:5601",
        "--kv-event-source", "http://127.0.0.1:8002=tcp://127.0.0.1:5602",
        "--kv-event-block-size", "128",
        "--kv-event-model", "/models/llama",
    ]  # fmt: skip
