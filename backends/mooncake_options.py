"""The mooncake tier's options: where the Mooncake master is, how this process
joins the cluster (metadata server, protocol, its own host name, the memory it
contributes), each call's time budget and the circuit breaker, checked when
they are made."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from kvsdk.config import BYTES

_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})")
"""``host:port`` (an IPv6 host in brackets)."""


@dataclass(frozen=True)
class MooncakeOptions:
    master: str = "127.0.0.1:50051"
    """The Mooncake master's RPC address, ``host:port`` (``mooncake_master --rpc_port``).
    With master HA (``--enable_ha``), ``etcd://host:port[;host:port...]``: the client
    follows the elected master (Mooncake's HA mode; not exercised by kvsdk's tests)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Where transfer engines find each other: ``P2PHANDSHAKE`` (no metadata service:
    peers exchange their segment descriptors directly), an HTTP metadata server
    (``http://host:port/metadata``) or ``etcd://host:port``."""
    protocol: Literal["tcp"] = "tcp"
    """Transport between this process and the memory holders: TCP (RDMA needs the
    caller's buffers registered with Mooncake, which this tier cannot do)."""
    local_hostname: str = "127.0.0.1"
    """This process's address as the holders reach it (its transfer engine listens
    here): a LAN address in a cluster, loopback when everything is on one machine."""
    global_segment_size: int = field(default=0, metadata=BYTES)
    """Memory this process contributes to the store (0: none; long-lived holders such
    as ``mooncake_client`` contribute it). Data put into a segment lives in its process
    and goes when the process exits, so an engine that contributes memory takes
    entries with it when it stops."""
    local_buffer_size: int = field(default=0, metadata=BYTES)
    """Mooncake's own staging buffer in this process. kvsdk moves bytes between the
    store and its own buffers, so it needs none (0); Mooncake's copying APIs use it."""
    timeout: float = 1.0
    """Seconds each call may spend on its round trips to the master (connecting,
    looking keys up, removing them) plus, for a transfer, its bytes at 64 MiB/s. Past
    it the call is a miss (or a refused write), counted in ``timeouts``, and the
    breaker opens. Mooncake itself waits ~4 s for a dead master."""
    backoff_initial: float = 0.5
    """Seconds the store is skipped after a failure; doubles per failure."""
    backoff_max: float = 30.0
    """The longest skip."""
    call_threads: int = 8
    """Threads that make this tier's calls to Mooncake while callers wait at most
    ``timeout``; a call past its deadline keeps its thread until Mooncake returns."""

    def __post_init__(self) -> None:
        problem = master_problem(self.master)
        if problem is not None:
            raise ValueError(f"master: {problem}")
        if not self.metadata_server or any(c.isspace() for c in self.metadata_server):
            raise ValueError(
                f"metadata_server: got {self.metadata_server!r}; expected P2PHANDSHAKE, "
                "http://host:port/metadata or etcd://host:port"
            )
        if not self.local_hostname or any(c.isspace() or c in "/@" for c in self.local_hostname):
            raise ValueError(
                f"local_hostname: got {self.local_hostname!r}; expected this machine's "
                "address (a host name or IP the holders can reach)"
            )
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected 0 or a size")
        for name in ("timeout", "backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if not 0 < value < 86400:
                raise ValueError(f"{name}: got {value}; expected a positive number of seconds")
        if self.backoff_max < self.backoff_initial:
            raise ValueError(
                f"backoff_max: got {self.backoff_max}; expected at least backoff_initial "
                f"({self.backoff_initial})"
            )
        if not 1 <= self.call_threads <= 256:
            raise ValueError(f"call_threads: got {self.call_threads}; expected 1 to 256")


def master_problem(master: str) -> str | None:
    """Why ``master`` is no master address (None: it is one)."""
    if master.startswith("etcd://"):
        rest = master[len("etcd://") :]
        if rest and all(_port_ok(p) for p in rest.split(";")):
            return None
        return f"got {master!r}; expected etcd://host:port[;host:port...]"
    if _port_ok(master):
        return None
    return f"got {master!r}; expected host:port (the master's --rpc_port) or etcd://host:port"


def _port_ok(text: str) -> bool:
    m = _HOST_PORT.fullmatch(text)
    return m is not None and 0 < int(m.group("port")) <= 65535
