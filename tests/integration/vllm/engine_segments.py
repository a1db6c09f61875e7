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
from typing import Any

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


def segment_holders(name: str) -> dict[int, list[str]]:
    """Every process of this machine (that this user may inspect) holding
    segment ``name``: pid -> ``["fd"]``, ``["map"]`` or both (an open
    descriptor, a mapping). Its memory is freed once this is empty."""
    target = f"{SHM_DIR}/{name}"
    held: dict[int, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        how: list[str] = []
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            fds = []
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.removesuffix(" (deleted)") == target:
                how.append("fd")
                break
        try:
            maps = (proc / "maps").read_text(errors="replace")
        except OSError:
            maps = ""
        if any(
            line.split(None, 5)[-1].removesuffix(" (deleted)") == target
            for line in maps.splitlines()
            if len(line.split(None, 5)) == 6
        ):
            how.append("map")
        if how:
            held[int(proc.name)] = how
    return held


def segment_snapshot(name: str, ancestor: int | None = None) -> dict[str, Any]:
    """A running engine's segment ``name`` seen from outside, the engine's
    processes being the descendants of ``ancestor`` (default: this process):

    - ``named``: kvsdk names in /dev/shm that are this one or open in the engine;
    - ``open``: the segments open in the engine's processes, ``modes`` theirs;
    - ``holders``: how many processes hold ``name`` (descriptor or mapping),
      ``outside``: how many of them are not the engine's.
    """
    root = os.getpid() if ancestor is None else ancestor
    opened = open_segments(root)
    holders = segment_holders(name)
    return {
        "named": sorted(set(named_segments()) & ({name} | set(opened))),
        "open": sorted(opened),
        "modes": sorted({segment_mode(p) for p in opened.values()}),
        "holders": len(holders),
        "outside": len([pid for pid in holders if not _descends_from(pid, root)]),
    }
