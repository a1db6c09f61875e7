"""The processes of ``kvsdk bench fleet``: vLLM's OpenAI servers, the router,
the shared tiers' servers; each started in a session of its own and stopped
with its whole process group (an API server's EngineCore and model worker too).

:class:`Proc` is one such process; :class:`Procs` stops every process (or
group of processes: anything with ``stop()``) it was given, newest first,
whatever the run ended in (an error, Ctrl-C, SIGTERM: see
:func:`sigterm_as_interrupt`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

ROUTER_BIN = "vllm-router"
P = TypeVar("P", bound="Stoppable")


def free_port(also_free: int = 0) -> int:
    """A free loopback port; with ``also_free``, one whose ``port + also_free`` is
    free too (a Redis Cluster node also listens on its port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also_free:
            return port
        if port + also_free > 65535:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + also_free))
            return port
    raise RuntimeError("no free loopback port")


def wait_port(proc: Proc, port: int, timeout: float = 15.0) -> None:
    """Until ``port`` on loopback accepts a connection; raises with ``proc``'s log
    tail if it exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: port {port} did not answer:\n{proc.log_tail()}")
        time.sleep(0.05)


def venv_binary(name: str) -> str | None:
    """``name`` beside this interpreter (the project venv), else on PATH."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else shutil.which(name)


def router_binary() -> str | None:
    """``vllm-router`` beside this interpreter (the project venv), else on PATH."""
    return venv_binary(ROUTER_BIN)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``; the API server then stops its engine)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """One process (group) with its log file."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=log_dir,
                start_new_session=True,  # Ctrl-C reaches us, not it: we stop it ourselves
                preexec_fn=_die_with_parent,
            )

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
            )

    def wait_http(self, url: str, timeout: float) -> float:
        """Seconds until ``GET url`` answers 200; raises with the log's tail otherwise."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.name}: {url} not ready after {timeout:.0f} s:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL to its process group (``kill -9``: a crash, nothing flushed)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to whatever of its process group is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


class Stoppable(Protocol):
    def stop(self) -> None: ...


class Procs:
    """The processes of one run; :meth:`close` stops them all, newest first."""

    def __init__(self) -> None:
        self.procs: list[Stoppable] = []

    def add(self, proc: P) -> P:
        self.procs.append(proc)
        return proc

    def stop(self, proc: Stoppable) -> None:
        """Stop one of them now and forget it."""
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        while self.procs:
            self.procs.pop().stop()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (in the main thread), so ``finally``
    blocks stop the fleet as they do on Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def engine_argv(
    model: str,
    port: int,
    kv_transfer: dict[str, Any] | None,
    max_model_len: int,
    extra: list[str] | None = None,
) -> list[str]:
    """vLLM's OpenAI server at its defaults (default executor, block size), as the
    README starts it; prompts are token ids, outputs read as token ids."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--enable-prompt-tokens-details", "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return argv + (extra or [])


def pinned(argv: list[str], core: int | None) -> tuple[list[str], dict[str, str]]:
    """``argv`` on one core (``taskset``; OpenMP bound there with one thread),
    or unpinned with one OpenMP thread when ``core`` is None."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if core is None or shutil.which("taskset") is None:
        return argv, {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return ["taskset", "-c", str(core), *argv], {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}


def start_redis(
    log_dir: Path,
    maxmemory: str,
    policy: str,
    *,
    name: str = "redis",
    port: int = 0,
    extra: list[str] | None = None,
) -> tuple[Proc, int]:
    """A loopback ``redis-server`` without persistence, LRU over ``maxmemory``;
    ``extra`` arguments after those (e.g. cluster mode), its files in ``log_dir``."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(log_dir), "--maxmemory", maxmemory,
            "--maxmemory-policy", policy, "--set-proc-title", "no", *(extra or [])]  # fmt: skip
    proc = Proc(name, argv, log_dir)
    wait_port(proc, port)
    return proc, port


def router_argv(
    port: int, workers: list[str], policy: str, extra: list[str], log_dir: Path
) -> list[str]:
    exe = router_binary()
    if exe is None:
        raise RuntimeError("vllm-router is not installed (scripts/install_vllm_router.sh)")
    return [
        exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--policy", policy, "--worker-startup-check-interval", "1",
        "--log-dir", str(log_dir), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()), *extra,
    ]  # fmt: skip
