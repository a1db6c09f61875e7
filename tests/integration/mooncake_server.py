"""A real Mooncake Store for tests: ``mooncake_master`` on a free loopback port and
a long-lived ``mooncake_client`` holder process contributing memory (objects live
in the holder), with P2P handshake (no metadata server) over TCP.

The binaries come with ``mooncake-transfer-engine-non-cuda`` (the ``[mooncake]``
extra, installed by ``scripts/setup.sh`` with Debian's ``libibverbs1``). Without
the package the tests skip, saying so (``scripts/test.sh`` fails on a skip).
Import the fixture into a test module::

    from mooncake_server import mooncake_cluster_fixture  # noqa: F401
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
MASTER = BIN / "mooncake_master"
HOLDER = BIN / "mooncake_client"


def _missing() -> str | None:
    """Why the Mooncake client and servers cannot run here (None: they can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"the Mooncake client does not import ({exc}); install it with scripts/setup.sh "
            "(pip install 'kvsdk[mooncake]' and apt-get install libibverbs1)"
        )
    for tool in (MASTER, HOLDER):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing; install mooncake-transfer-engine-non-cuda in this venv"
    return None


MISSING = _missing()
needs_mooncake = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class MooncakeCluster:
    """One master and one holder on loopback (``master`` is ``127.0.0.1:port``)."""

    workdir: Path
    segment: str = "256MB"
    """Memory the holder contributes."""
    master_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    holder_port: int = field(default_factory=free_port)
    master_proc: subprocess.Popen[bytes] | None = None
    holder_proc: subprocess.Popen[bytes] | None = None
    master_args: tuple[str, ...] = ()
    """More ``mooncake_master`` flags (snapshots, eviction...)."""
    master_env: dict[str, str] = field(default_factory=dict)
    """More environment for the master (``MOONCAKE_SNAPSHOT_LOCAL_PATH``...)."""

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def options(self, **overrides: Any) -> Any:
        from kvsdk.backends.mooncake import MooncakeOptions

        return MooncakeOptions(**{"master": self.master, "timeout": 2.0, **overrides})

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.workdir, start_new_session=True,
                                    env={**os.environ, **(env or {})})  # fmt: skip
        finally:
            log.close()

    def start_master(self) -> None:
        self.master_proc = self._spawn("master", [
            str(MASTER), f"--rpc_port={self.master_port}", "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--logtostderr", *self.master_args,
        ], self.master_env)  # fmt: skip
        self._wait_port(self.master_port, self.master_proc, "master")

    def start_holder(self) -> None:
        self.holder_proc = self._spawn("holder", [
            str(HOLDER), "--host=127.0.0.1", f"--port={self.holder_port}",
            f"--global_segment_size={self.segment}", "--metadata_server=P2PHANDSHAKE",
            f"--master_server_address={self.master}", "--protocol=tcp", "--logtostderr",
        ])  # fmt: skip
        self.wait_holder()

    def wait_holder(self, timeout: float = 30.0) -> None:
        """Until the holder's segment takes a put (it has registered with the master)."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", self.master) == 0
        probe = bytearray(b"p" * 64)
        from kvsdk.backends.mooncake_client import address_of

        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                assert self.holder_proc is not None
                if self.holder_proc.poll() is not None:
                    raise RuntimeError(f"mooncake_client exited: {self.tail('holder')}")
                if client.put_from("kvsdk-test-probe", address_of(probe), 64) == 0:
                    client.remove("kvsdk-test-probe", True)
                    return
                time.sleep(0.2)
            raise RuntimeError(f"the holder never took a put: {self.tail('holder')}")
        finally:
            client.close()

    def _wait_port(self, port: int, proc: subprocess.Popen[bytes], name: str) -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake {name} exited: {self.tail(name)}")
            if _listening(port):
                return
            time.sleep(0.1)
        raise RuntimeError(f"mooncake {name} not listening on {port}: {self.tail(name)}")

    def tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def kill_master(self) -> None:
        self._stop(self.master_proc, signal.SIGKILL)

    def pause_master(self) -> None:
        """Freeze the master (SIGSTOP): connections stay open, nothing answers."""
        assert self.master_proc is not None
        self.master_proc.send_signal(signal.SIGSTOP)

    def resume_master(self) -> None:
        assert self.master_proc is not None
        self.master_proc.send_signal(signal.SIGCONT)

    def restart_master(self) -> None:
        """A new master on the same port (with no objects: snapshots are off); the
        holder re-registers its segment with it."""
        self.kill_master()
        self.start_master()

    def stop(self) -> None:
        if self.master_proc is not None and self.master_proc.poll() is None:
            self.master_proc.send_signal(signal.SIGCONT)  # (a paused one cannot exit)
        self._stop(self.holder_proc)
        self._stop(self.master_proc)


def start_cluster(workdir: Path, segment: str = "256MB", **kw: Any) -> MooncakeCluster:
    cluster = MooncakeCluster(workdir=workdir, segment=segment, **kw)
    try:
        cluster.start_master()
        cluster.start_holder()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module", name="mooncake_cluster")
def mooncake_cluster_fixture() -> Iterator[MooncakeCluster]:
    """A master and a 256 MB holder for the module (tests use namespaces of their own)."""
    if MISSING is not None:  # scripts/setup.sh installs it: its absence is a failure
        pytest.fail(MISSING)
    with tempfile.TemporaryDirectory(prefix="kvsdk-mooncake-") as tmp:
        cluster = start_cluster(Path(tmp))
        try:
            yield cluster
        finally:
            cluster.stop()
