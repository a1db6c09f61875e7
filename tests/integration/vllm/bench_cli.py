"""For the smoke tests that run a benchmark command as a user does: what it
started, seen from /proc (no engine, router or server may outlive the
command). The ``router`` fixture they use is in this folder's conftest."""

from __future__ import annotations

import os
import time
from pathlib import Path


def live_processes() -> dict[str, tuple[str, str]]:
    """Live processes (zombies left out): pid -> (parent pid, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":
            found[entry.name] = (stat[1], cmdline)
    return found


def family(marker: str) -> dict[str, str]:
    """Processes whose command line holds ``marker`` (the test's tmp path), and
    their children (vLLM's EngineCore and worker name themselves ``VLLM::...``)."""
    procs = live_processes()
    mine = {pid: cmd for pid, (_, cmd) in procs.items() if marker in cmd}
    mine.update({pid: cmd for pid, (ppid, cmd) in procs.items() if ppid in mine})
    return mine


def wait_gone(pids: set[str], grace: float = 20.0) -> list[str]:
    """Those of ``pids`` still alive after at most ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while (left := sorted(pids & set(live_processes()))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
