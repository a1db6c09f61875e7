"""A Mooncake Store on loopback for ``kvsdk bench fleet``: ``mooncake_master``
(the object index) and one long-lived ``mooncake_client`` holder that
contributes the memory objects live in, peers found by P2P handshake (no
metadata server), over TCP. Both binaries come with the ``[mooncake]``
extra (``mooncake-transfer-engine-non-cuda``), found beside this interpreter.

The store is ready once the master counts the holder's segment in
``master_total_capacity_bytes`` (its metrics port); a master keeps its index
in memory, so a store started afresh is empty. :meth:`MooncakeStore.stop`
stops the holder, then the master.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvsdk.plugins.vllm.workloads.fleet_procs import Proc, free_port, venv_binary, wait_port

MASTER_BIN = "mooncake_master"
HOLDER_BIN = "mooncake_client"
_GAUGE = r"^{name}(?:\{{[^}}]*\}})?\s+(\S+)"


def mooncake_binaries() -> tuple[str, str]:
    """``mooncake_master`` and ``mooncake_client``; says how to install them if absent."""
    found = venv_binary(MASTER_BIN), venv_binary(HOLDER_BIN)
    if found[0] is None or found[1] is None:
        raise RuntimeError(
            "the mooncake tier needs mooncake_master and mooncake_client "
            "(pip install 'kvsdk[mooncake]'; scripts/setup.sh installs them)"
        )
    return found[0], found[1]


def master_gauge(metrics_text: str, name: str) -> float | None:
    """The value of gauge ``name`` in the master's ``/metrics`` text (None: absent)."""
    m = re.search(_GAUGE.format(name=re.escape(name)), metrics_text, re.MULTILINE)
    return float(m.group(1)) if m else None


@dataclass
class MooncakeStore:
    """A running master and holder; ``address`` is what a ``mooncake`` tier's
    ``master`` names."""

    master: Proc
    holder: Proc
    rpc_port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def gauge(self, name: str) -> float | None:
        """One of the master's gauges now (None: absent or not answering)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        return master_gauge(text, name)

    def stop(self) -> None:
        self.holder.stop()
        self.master.stop()


def start_mooncake(
    log_dir: Path, segment_bytes: int, name: str = "mooncake", timeout: float = 60.0
) -> MooncakeStore:
    """A master and a holder contributing ``segment_bytes`` (the holder's memory is
    touched only as objects are written), logs in ``log_dir``."""
    master_exe, holder_exe = mooncake_binaries()
    rpc, metrics, holder_port = free_port(), free_port(), free_port()
    master = Proc(f"{name}-master", [
        master_exe, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
        f"--metrics_port={metrics}", "--logtostderr",
    ], log_dir)  # fmt: skip
    try:
        wait_port(master, rpc, timeout)
        holder = Proc(f"{name}-holder", [
            holder_exe, "--host=127.0.0.1", f"--port={holder_port}",
            f"--global_segment_size={segment_bytes}", "--metadata_server=P2PHANDSHAKE",
            f"--master_server_address=127.0.0.1:{rpc}", "--protocol=tcp", "--logtostderr",
        ], log_dir)  # fmt: skip
    except BaseException:
        master.stop()
        raise
    store = MooncakeStore(master, holder, rpc, metrics)
    try:
        deadline = time.monotonic() + timeout
        while (store.gauge("master_total_capacity_bytes") or 0) < segment_bytes:
            holder.check_alive()
            master.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Mooncake holder's segment did not register within {timeout:.0f} s:\n"
                    f"{holder.log_tail()}"
                )
            time.sleep(0.2)
    except BaseException:
        store.stop()
        raise
    return store
