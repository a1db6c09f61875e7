"""The disk tier's file primitives: whole reads and vectored reads/writes that
finish or raise, and the ownership and mode checks of the directories it keeps
chunks in (a directory another user can write to could have its entries swapped)."""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator, Sequence
from typing import Any

from kvsdk.chunk_format import HEADER_SIZE, HeaderAfterPayload

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp."
"""How a temporary file of a write in progress is named (never a chunk's name)."""
ENTRY_RE = re.compile(r"^[0-9a-f]{32}\.kvc$")
"""A chunk file's name: its key in hex."""
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""How a chunk file is opened: a planted symlink fails, a FIFO opens without blocking."""
IOV_MAX = 1024
"""Most buffers one ``readv``/``pwritev`` call takes (Linux ``UIO_MAXIOV``)."""


def read_whole(fd: int, size: int) -> bytes:
    """The whole file of ``size`` bytes (from ``fstat``, never from its contents).
    ``os.read`` into a fresh ``bytes`` lets the kernel fault the pages in: a
    zero-filled ``bytearray`` measured ~10x slower for 2 MiB chunks."""
    data = os.read(fd, size)
    if len(data) < size:  # > 2 GiB, or shrank under us (the frame check reports it)
        parts = [data]
        got = len(data)
        while got < size:
            more = os.read(fd, size - got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def byte_view(buf: Any) -> memoryview:
    """A flat byte view of a contiguous buffer (no copy)."""
    mv = memoryview(buf)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def top_dir_problem(path: str, st: os.stat_result) -> str | None:
    """Why the tier's ``path`` (described by ``st``) is not safe to use, or None:
    it must be a directory of this user's that nobody else can write to (else
    another user could swap the namespace directory)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"path: {path!r} is not a directory"
    if st.st_uid != os.geteuid():
        return (
            f"path: {path!r} belongs to uid {st.st_uid}; expected a directory of this user "
            f"(uid {os.geteuid()}), e.g. a new one kvsdk creates with mode 0700"
        )
    if st.st_mode & 0o022:
        return (
            f"path: {path!r} has mode {stat.S_IMODE(st.st_mode):04o}, writable by group or "
            "others; expected a directory only this user can write to (chmod go-w)"
        )
    return None


def check_top_dir(path: str) -> os.stat_result:
    """The tier's ``path`` checked (:func:`top_dir_problem`; ``ValueError``)."""
    st = os.stat(path)
    problem = top_dir_problem(path, st)
    if problem is not None:
        raise ValueError(problem)
    return st


def private_dir_problem(path: str, st: os.stat_result) -> str | None:
    """Why a namespace or shard directory (opened without following a symlink,
    described by ``st``) is not safe to use, or None: it must be this user's,
    mode 0700."""
    if st.st_uid != os.geteuid():
        return (
            f"path: {path!r} belongs to uid {st.st_uid}; expected this user's (uid "
            f"{os.geteuid()}): remove it or use another path"
        )
    if st.st_mode & 0o077:
        return (
            f"path: {path!r} has mode {stat.S_IMODE(st.st_mode):04o}; expected no access "
            "for group and others (chmod 700)"
        )
    return None


def flat_parts(parts: Sequence[Any]) -> list[memoryview]:
    """Flat byte views of the parts of a payload (no copy)."""
    return [byte_view(p) for p in parts]


def copy_at(piece: memoryview, offset: int, outs: Sequence[memoryview]) -> None:
    """Copy ``piece`` to byte ``offset`` of the concatenation of ``outs``."""
    for out in outs:
        n = out.nbytes
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, len(piece))
        byte_view(out)[offset : offset + take] = piece[:take]
        piece = piece[take:]
        offset = 0
        if not piece:
            return


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset`` (retrying short reads); the bytes
    read, fewer only at the end of the file."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def write_frame(
    fd: int, frame: HeaderAfterPayload, parts: Sequence[memoryview], piece: int
) -> None:
    """Write a frame to the new file ``fd``: the payload ``parts`` after the
    header's place, about ``piece`` bytes per ``pwritev``, each piece given to
    ``frame`` right after it was written (still in the CPU's cache: the
    checksum or MAC does not read the payload from memory a second time),
    then the header at offset 0."""
    offset = HEADER_SIZE
    for group in _pieces(parts, piece):
        pwrite_all(fd, group, offset)
        for view in group:
            frame.update(view)
            offset += view.nbytes
    pwrite_all(fd, [memoryview(frame.finish())], 0)


def _pieces(parts: Sequence[memoryview], limit: int) -> Iterator[list[memoryview]]:
    """``parts`` regrouped: lists of views of at most ``limit`` bytes and
    ``IOV_MAX`` views (a large part is split, small ones go together)."""
    group: list[memoryview] = []
    size = 0
    for part in parts:
        view = byte_view(part)
        while view.nbytes:
            take = min(view.nbytes, limit - size)
            group.append(view[:take])
            size += take
            view = view[take:]
            if size == limit or len(group) == IOV_MAX:
                yield group
                group, size = [], 0
    if group:
        yield group


def pwrite_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """Write ``parts`` in order from byte ``offset`` (at most ``IOV_MAX`` per
    ``pwritev``), retrying short writes."""
    todo = [p for p in parts if p.nbytes]
    i = 0
    while i < len(todo):
        n = os.pwritev(fd, todo[i : i + IOV_MAX], offset)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        while i < len(todo) and n >= todo[i].nbytes:
            n -= todo[i].nbytes
            i += 1
        if n:  # part of one buffer done: the rest of its bytes
            todo[i] = byte_view(todo[i])[n:]
