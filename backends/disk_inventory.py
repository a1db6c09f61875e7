"""The disk tier seen from outside a running engine: what ``kvsdk inspect``
lists (per namespace directory: chunk files, bytes, one header) and what
``kvsdk clear --yes`` removes. Both walk the directories on a thread of their
own and give up past ``read_timeout`` (``TimeoutError`` naming the path), so a
hung file system cannot hang the command."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from kvsdk.backends.disk_files import ENTRY_RE, OPEN_FLAGS
from kvsdk.backends.disk_reader import STALLED, TIMED_OUT, DeadlineReader
from kvsdk.chunk_format import HEADER_SIZE, CorruptChunk, parse_header

_R = TypeVar("_R")


def inventory(options: Any) -> list[dict[str, Any]]:
    """Per namespace directory: its chunk files and bytes, and one header
    read (format version, dtype, shape)."""
    root = os.path.abspath(options.path)
    with _deadline(options) as ask:
        names = ask(partial(_namespace_dirs, root), root)
        return [ask(partial(_inventory_row, root, name), os.path.join(root, name))
                for name in names]  # fmt: skip


def wipe(options: Any, namespace: str | None = None) -> int:
    """Unlink every chunk file under ``path`` (or under its ``namespace``
    directory); directories and anything not named like a chunk stay."""
    root = os.path.abspath(options.path)
    with _deadline(options) as ask:
        names = [n for n in ask(partial(_namespace_dirs, root), root) if namespace in (None, n)]
        return sum(ask(partial(_wipe_dir, os.path.join(root, n)), os.path.join(root, n))
                   for n in names)  # fmt: skip


@contextlib.contextmanager
def _deadline(options: Any) -> Any:
    """``ask(fn, where)``: ``fn()`` on a thread of its own, within ``read_timeout``."""
    timeout = float(getattr(options, "read_timeout", 5.0))
    reader = DeadlineReader(1, timeout, name="kvsdk-disk-inspect")

    def ask(fn: Callable[[], _R], where: str) -> _R:
        res = reader.run(lambda handoff: None if handoff.abandoned else fn())
        if res is TIMED_OUT or res is STALLED:
            raise TimeoutError(
                f"{where} did not answer within {timeout:.1f} s (read_timeout; a hung file system?)"
            )
        return res  # type: ignore[return-value]

    try:
        yield ask
    finally:
        reader.close()


def _namespace_dirs(root: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _wipe_dir(ns_dir: str) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(ns_dir):
        for name in files:
            if ENTRY_RE.match(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))
                    n += 1
    return n


def _inventory_row(root: str, name: str) -> dict[str, Any]:
    """``inventory``'s row for namespace directory ``name``: its regular files
    (temp files of writes in progress left out) and one header read from one."""
    entries = size = 0
    sample: str | None = None
    for dirpath, _dirs, files in os.walk(os.path.join(root, name)):
        for fname in files:
            if fname.startswith("."):
                continue  # temp files of writes in progress
            path = os.path.join(dirpath, fname)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # a symlink, FIFO, ...: not a chunk
            size += st.st_size
            entries += 1
            sample = sample or path
    row: dict[str, Any] = {"namespace": name, "entries": entries, "bytes": size}
    if sample is not None:
        try:
            fd = os.open(sample, OPEN_FLAGS)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptChunk("not a regular file")
                h = parse_header(os.read(fd, HEADER_SIZE), st.st_size - HEADER_SIZE)
            finally:
                os.close(fd)
            row["format_version"] = h.version
            row["dtype"], row["shape"] = h.dtype, list(h.shape)
        except (OSError, CorruptChunk) as exc:
            row["sample_error"] = str(exc)
    return row
