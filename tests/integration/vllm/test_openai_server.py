"""kvsdk through vLLM's OpenAI-compatible server, started as the README shows.

``kvsdk config check --engine vllm --model`` first (its chunk size must be
the one the adapter then logs). Three servers, one after the other, each in
its own process group, on a tiny local Llama with random weights and a
word-level tokenizer with a chat template (prompts are token ids; no server
log holds a traceback while it serves):

1. **without kvsdk** (the reference): a 600-token prompt cold, then again
   (vLLM's own prefix-cache hit: 512 tokens, four 128-token blocks);
2. **with kvsdk** (host RAM, then a disk tier): the same prompt cold (outputs
   equal the reference's cold run), then vLLM's prefix cache is reset
   through the dev endpoint and the prompt sent again: 599 tokens come
   from kvsdk (its whole blocks and the prompt's tail: vLLM recomputes the
   last token only), ``usage.prompt_tokens_details.cached_tokens`` says so,
   greedy tokens equal the reference's prefix hit and logprobs within 1e-5
   (a one-token recompute is not bitwise an 88-token one on vLLM-CPU; the
   bitwise comparison is test_vllm_connector.py's), and ``/metrics`` shows
   ``vllm:kvsdk_*`` counters that moved;
3. **restarted** over the same disk directory: the prompt again, its 599
   tokens served from the disk tier (a host tier is per engine and gone with it).

No process of a server's group outlives it. A bad kvsdk config (a capacity
without a unit, a config path typo) stops the server before any engine
process starts, with one ERROR line and exit status 2.
"""

from __future__ import annotations

import importlib.metadata
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

sys.path.insert(0, str(Path(__file__).parent))

from openai_server import Server

pytestmark = pytest.mark.integration

PROMPT = [random.Random(0).randrange(3, 32000) for _ in range(600)]
OWN_HIT_TOKENS = 512  # vLLM's own: four 128-token blocks of vLLM-CPU's Llama
HIT_TOKENS = 599  # kvsdk's: the whole blocks and the prompt's tail (the 600th is computed)

CONFIG = """\
tiers:
  - backend: cpu
    capacity: 256MiB
  - backend: disk
    path: {disk}
    capacity: 1GiB
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    # with a tokenizer and a chat template, as a real model directory: the
    # server's chat-template warm-up runs clean (no traceback in its log)
    return make_tiny_llama(
        tmp_path_factory.mktemp("server-model") / "tiny-llama", seed=0, tokenizer=True
    )


def _run(server: Server, body: Any) -> Any:
    """Run ``body(server)`` and stop the server, however it ends; no process left.
    While it served, its log holds no traceback (on SIGTERM vLLM 0.32's own
    shutdown, ``mode=abort``, logs one from its output handler, with or without
    kvsdk: not checked)."""
    try:
        server.wait_ready()
        result = body(server)
        assert "Traceback" not in server.log(), f"{server.name}:\n{server.log()[-3000:]}"
        return result
    finally:
        server.stop()
        assert server.group_alive() == [], f"{server.name}: processes left after stop"


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_openai_server_serves_prefix_from_kvsdk(model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    disk = tmp_path / "kvsdk-disk"
    config = tmp_path / "kvsdk.yaml"
    config.write_text(CONFIG.format(disk=disk))
    # the README's check, with the model: one chunk's bytes, before any server
    check = subprocess.run(
        [str(Path(sys.executable).with_name("kvsdk")), "config", "check", "--engine", "vllm",
         "--model", str(model), "--dtype", "float32", str(config)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert check.returncode == 0 and check.stderr == "", check.stderr
    checked = re.search(r"one chunk of \S+ is (\d+) bytes \((\d+) tokens x ", check.stdout)
    assert checked is not None, check.stdout

    def reference(s: Server) -> dict[str, Any]:
        cold = s.complete(PROMPT)
        hit = s.complete(PROMPT)
        assert hit["cached_tokens"] == OWN_HIT_TOKENS, hit
        assert not any(k.startswith("vllm:kvsdk_") for k in s.metrics())
        return {"cold": cold, "hit": hit}

    ref = _run(Server("reference", model, tmp_path, None), reference)

    def with_kvsdk(s: Server) -> dict[str, Any]:
        cold = s.complete(PROMPT)
        assert cold["cached_tokens"] == 0
        _same(cold, ref["cold"])
        s.reset_prefix_cache()
        warm = s.complete(PROMPT)
        assert warm["cached_tokens"] == HIT_TOKENS, warm
        _same(warm, ref["hit"])
        assert s.counter("kvsdk_hit_tokens_total") >= HIT_TOKENS
        assert s.counter("kvsdk_loaded_bytes_total") > 0
        assert s.counter("kvsdk_stored_bytes_total") > 0
        # the write-through to disk lands before the server goes
        deadline = time.monotonic() + 60
        while not any(p.is_file() for p in disk.rglob("*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(p.is_file() for p in disk.rglob("*")), "nothing written to the disk tier"
        return {"warm": warm, "log": s.log()}

    first = _run(Server("kvsdk", model, tmp_path, str(config)), with_kvsdk)
    assert f"kvsdk config from file {config}" in first["log"]  # at vLLM's default level
    assert first["log"].count("kvsdk config from") == 1  # once per engine, not per process
    assert first["log"].count(f"kvsdk: tier 1 (disk) opened: path={disk}") == 1
    log = first["log"]
    assert "Traceback" not in log, log[-3000:]
    # the chunk the adapter laid out is the one `kvsdk config check --model` computed
    logged = re.search(r"kvsdk: KV groups \S+, chunk (\d+) tokens / (\d+) B", log)
    assert logged is not None, log[-3000:]
    assert (logged.group(2), logged.group(1)) == checked.groups()

    def restarted(s: Server) -> dict[str, Any]:
        again = s.complete(PROMPT)
        assert again["cached_tokens"] == HIT_TOKENS, again
        _same(again, ref["hit"])
        # the same KV bytes as the first server's hit: bitwise its outputs
        assert again["tokens"] == first["warm"]["tokens"]
        assert again["logprobs"] == first["warm"]["logprobs"]
        # promoted from the disk tier (tier 1) into host RAM, then loaded
        assert s.counter("kvsdk_loaded_bytes_total", 'detail="tier=1"') > 0, s.metrics()
        return again

    _run(Server("kvsdk-restarted", model, tmp_path, str(config)), restarted)
    print(f"three servers, {time.monotonic() - started:.0f} s")


@pytest.mark.parametrize(
    ("config", "sentence"),
    [
        ("tiers:\n  - backend: cpu\n    capacity: 8\n", "tiers[0].capacity: got 8 bytes"),
        (None, "config: file"),  # a path typo: kvsdk.yml for kvsdk.yaml
    ],
    ids=["capacity-without-unit", "config-path-typo"],
)
def test_bad_config_stops_the_server_in_one_line(
    model: Path, tmp_path: Path, config: str | None, sentence: str
) -> None:
    path = tmp_path / "kvsdk.yaml"
    path.write_text(config or "tiers:\n  - backend: cpu\n    capacity: 1GiB\n")
    given = path if config else tmp_path / "kvsdk.yml"
    server = Server("bad-config", model, tmp_path, str(given))
    try:
        rc = server.proc.wait(120)
    finally:
        server.stop()
    log = server.log()
    errors = [line for line in log.splitlines() if "ERROR" in line]
    assert rc == 2, log[-3000:]
    assert len(errors) == 1 and sentence in errors[0], log[-3000:]
    assert "Traceback" not in log and "leaked" not in log
    assert "EngineCore" not in log  # refused before any engine process started
    assert server.group_alive() == []


def test_vllm_serve_entry_point() -> None:
    """``vllm serve`` where its entry point works. vLLM-CPU's does not (its CLI
    reads the version of a distribution named ``vllm``; the CPU build is
    ``vllm-cpu``): this pins that reason, which is why the README shows
    ``python -m vllm.entrypoints.openai.api_server``."""
    vllm_cli = Path(sys.executable).with_name("vllm")
    out = subprocess.run(
        [str(vllm_cli), "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        assert out.returncode != 0
        assert "PackageNotFoundError" in out.stderr and "vllm" in out.stderr
        return
    assert out.returncode == 0 and "--kv-transfer-config" in out.stdout
