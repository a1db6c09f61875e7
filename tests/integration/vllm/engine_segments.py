"""Find a running engine's kvsdk segment from outside it (tests only).

Once every worker attached, kvsdk removes the segment's name from /dev/shm;
the engine's scheduler process keeps one descriptor of it open, so a process
of the same user reaches it as ``/proc/<pid>/fd/<n>`` (the link reads
``/dev/shm/kvsdk-<uid>-… (deleted)``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvsdk.slab import PREFIX, SHM_DIR


def named_segments() -> list[str]:
    """kvsdk segments of this user that still have a name in /dev/shm."""
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{os.geteuid()}-*"))


def _parent(pid: int) -> int:
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat_line.rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _parent(pid)
    return False


def open_segments(ancestor: int | None = None) -> dict[str, Path]:
    """Segment name → a ``/proc/<pid>/fd/<n>`` path of a process holding it
    open, among this process's descendants (``ancestor``: another root)."""
    root = os.getpid() if ancestor is None else ancestor
    prefix = f"{SHM_DIR}/{PREFIX}{os.geteuid()}-"
    found: dict[str, Path] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not _descends_from(int(proc.name), root):
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                found.setdefault(target[len(str(SHM_DIR)) + 1 :].removesuffix(" (deleted)"), fd)
    return found


def segment_mode(fd_path: Path) -> str:
    return oct(stat.S_IMODE(os.stat(fd_path).st_mode))
