"""The disk tier seen from outside a running engine: what ``kvsdk inspect``
lists (per namespace directory: chunk files, bytes, one header) and what
``kvsdk clear --yes`` removes. Both walk the directories on a thread of their
own and give up past ``read_timeout`` (``TimeoutError`` naming the path), so a
hung file system cannot hang the command. Below ``path``, each namespace
directory and each directory in it is opened without following a symlink,
and every file is reached by its name in its directory's descriptor: a
symlink where a directory belongs is neither walked nor counted, and nothing
outside the tier is unlinked."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

from kvsdk.backends.disk_dirs import TOP_FLAGS, open_dir
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
        return sum(ask(partial(_wipe_dir, root, n), os.path.join(root, n))
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


def _dirs_of(root: str, name: str) -> Iterator[int]:
    """Descriptors of namespace directory ``name`` in ``root`` and of each
    directory in it, each open only until the next is asked for; a symlink
    (or anything but a directory) in either place is skipped, never followed."""
    top = os.open(root, TOP_FLAGS)
    try:
        try:
            ns = open_dir(name, top)
        except OSError:
            return
        try:
            yield ns
            subs = [e.name for e in os.scandir(ns) if e.is_dir(follow_symlinks=False)]
            for sub in subs:
                try:
                    fd = open_dir(sub, ns)
                except OSError:
                    continue
                try:
                    yield fd
                finally:
                    os.close(fd)
        finally:
            os.close(ns)
    finally:
        os.close(top)


def _wipe_dir(root: str, name: str) -> int:
    """Unlink the chunk files of namespace directory ``name`` and of the
    directories in it."""
    n = 0
    for dfd in _dirs_of(root, name):
        for e in os.scandir(dfd):
            if ENTRY_RE.match(e.name) and not e.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.name, dir_fd=dfd)
                    n += 1
    return n


def _inventory_row(root: str, name: str) -> dict[str, Any]:
    """``inventory``'s row for namespace directory ``name``: its regular files
    (temp files of writes in progress left out) and one header read from one."""
    entries = size = 0
    row: dict[str, Any] = {"namespace": name, "entries": 0, "bytes": 0}
    sampled = False
    for dfd in _dirs_of(root, name):
        for e in os.scandir(dfd):
            if e.name.startswith("."):
                continue  # temp files of writes in progress
            try:
                st = os.lstat(e.name, dir_fd=dfd)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # a symlink, FIFO, ...: not a chunk
            size += st.st_size
            entries += 1
            if not sampled:
                sampled = True
                row.update(_sample(dfd, e.name))
    row.update(entries=entries, bytes=size)
    return row


def _sample(dfd: int, name: str) -> dict[str, Any]:
    """Format version, dtype and shape from the header of file ``name`` in
    directory ``dfd`` (or why it could not be read)."""
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptChunk("not a regular file")
            h = parse_header(os.read(fd, HEADER_SIZE), st.st_size - HEADER_SIZE)
        finally:
            os.close(fd)
    except (OSError, CorruptChunk) as exc:
        return {"sample_error": str(exc)}
    return {"format_version": h.version, "dtype": h.dtype, "shape": list(h.shape)}
