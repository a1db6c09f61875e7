"""LMCache's server as the connector benchmark starts it (``lmcache_peer``): it
answers, it stops with its whole process group, it does not outlive a parent
killed by SIGKILL or stopped by SIGTERM, and a missing LMCache install stops
the benchmark at once with the install hint. LMCache comes from
``scripts/install_lmcache.sh`` (``scripts/setup.sh vllm``): missing, these
tests fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvsdk.plugins.vllm.workloads.lmcache_peer import (
    LMCacheMissing,
    LMCacheServer,
    kv_transfer_config,
    lmcache_site,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
LMCACHE_DIR = ROOT / ".venv-lmcache"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_server_answers_then_stops_with_its_group(tmp_path: Path) -> None:
    site = lmcache_site(LMCACHE_DIR)
    with LMCacheServer(site, tmp_path, chunk_size=128, l1_gib=0.1) as server:
        pid = server.proc.proc.pid
        health = httpx.get(f"http://127.0.0.1:{server.http_port}/healthcheck", timeout=5)
        assert health.status_code == 200
        assert server.port != server.http_port
        ktc = kv_transfer_config(server.port)
        assert ktc["kv_connector_extra_config"]["lmcache.mp.port"] == server.port
    assert _wait_gone(pid, 5), "the server outlived stop()"
    assert server.log_path.read_text()  # its output went to the log beside the run


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_server_does_not_outlive_its_parent(tmp_path: Path, how: str) -> None:
    """The benchmark stops the server on SIGTERM (``sigterm_as_interrupt``, as in
    ``bench_vllm_connector.py``); killed outright, its parent takes the server
    along (the death signal ``Proc`` sets)."""
    parent = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kvsdk.plugins.vllm.workloads.fleet_procs import sigterm_as_interrupt
        from kvsdk.plugins.vllm.workloads.lmcache_peer import LMCacheServer, lmcache_site

        with sigterm_as_interrupt():
            with LMCacheServer(lmcache_site({str(LMCACHE_DIR)!r}), Path({str(tmp_path)!r}),
                               chunk_size=128, l1_gib=0.1) as server:
                print(server.proc.proc.pid, flush=True)
                time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the parent did not start the server: {line!r}"
        pid = int(line)
        assert _alive(pid)
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        assert _wait_gone(pid, 30), f"the server outlived its parent's {how}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_missing_lmcache_stops_the_benchmark_with_the_install_hint(tmp_path: Path) -> None:
    with pytest.raises(LMCacheMissing, match=r"scripts/install_lmcache\.sh"):
        lmcache_site(tmp_path)
    script = ROOT / "benchmarks" / "bench_vllm_connector.py"
    cmd = [sys.executable, str(script), "--out", str(tmp_path / "b.json")]
    cmd += ["--lmcache-dir", str(tmp_path / "nowhere"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode != 0
    assert "LMCache is not installed in" in proc.stderr, proc.stderr[-2000:]
    assert "scripts/install_lmcache.sh" in proc.stderr and "--no-lmcache" in proc.stderr
    assert not (tmp_path / "b.runs").exists()  # stopped before any engine started
