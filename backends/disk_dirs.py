"""The disk tier's directories, held open. Every chunk file is reached by its
name relative to a file descriptor of its directory (``openat``-style calls),
and every directory below the tier's ``path`` is opened ``O_NOFOLLOW |
O_DIRECTORY`` relative to its parent's descriptor: a symlink (or anything but
a directory) put where the namespace or a shard directory belongs, even while
the tier runs, is never followed, so no read, write or unlink goes outside
the tier. ``path`` itself is the deployment's choice and may be a symlink.

What is found where a directory belongs:

- a symlink, a file, a FIFO, ...: reported (``on_unsafe``: the tier counts it
  like a planted chunk file, ``rejected`` and ``corrupt``) and removed (the
  entry itself: unlinking a symlink never touches its target); a read or look
  is then a miss, and a write makes the directory again;
- a directory of another user, or open to group or others: reported, and not
  used (:class:`UnsafeDir`, ``EACCES``);
- nothing: a miss, or made (``0700``) by a write.

Descriptors are kept between calls: the namespace directory's and, in LRU
order, those of at most :func:`dir_fd_limit` shard directories (the rest are
opened when needed and closed when dropped from the cache). A kept
descriptor always names a directory this tier opened safely, so using it is
safe whatever happened since; that it is still the directory its name leads
to is checked when a call finds nothing there (or is about to write), at
most once per :class:`DirWalk`: one ``fstat`` of the parent, whose ``ctime``
moves whenever an entry in it is added, removed or renamed (and cannot be
set back). While it has not moved since the children were last known good
(and is older than :data:`RACY_NS`, the file system's timestamp granularity
with room to spare) they are; when it moved, the kept children are dropped
and reopened when next used; within :data:`RACY_NS` of a change, each child
is checked by itself (``lstat`` of its name, compared by device and inode).
A directory that went away or was replaced is so reopened. A descriptor in
use by a walk is never closed under it (a count of users per directory), so
a number is never reused while a worker still resolves names against it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

from kvsdk.backends.disk_files import check_top_dir, private_dir_problem, top_dir_problem

_T = TypeVar("_T")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a directory below the tier's ``path`` is opened: never through a symlink."""
TOP_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""How the tier's ``path`` is opened (a symlink there is the deployment's choice)."""
DIR_FDS = 256
"""Shard directory descriptors a tier keeps open at most (one per shard by default)."""
RACY_NS = 2_000_000_000
"""A directory's ``ctime`` this recent (ns) may hide a change made within the
same timestamp tick: its children are then checked one by one."""


def dir_fd_limit() -> int:
    """Shard directory descriptors to keep: :data:`DIR_FDS`, and at most an
    eighth of this process's open-file limit (at least 8)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DIR_FDS
    return max(8, min(DIR_FDS, soft // 8))


def open_dir(name: str, parent: int) -> int:
    """A descriptor of directory ``name`` in directory ``parent``; ``OSError``
    (``ELOOP``, ``ENOTDIR``) for a symlink or anything else."""
    return os.open(name, DIR_FLAGS, dir_fd=parent)


class UnsafeDir(OSError):
    """A directory of the tier that is not safe to use (another user's, open to
    group or others, swapped for a symlink while being opened)."""

    def __init__(self, detail: str) -> None:
        super().__init__(errno.EACCES, detail)


class _Dir:
    """One open directory: its descriptor, identity, users and kept children."""

    __slots__ = ("children", "dropped", "fd", "ident", "stable_ctime", "users")

    def __init__(self, fd: int, st: os.stat_result) -> None:
        self.fd = fd
        self.ident = (st.st_dev, st.st_ino)
        self.users = 0
        self.dropped = False
        self.children: OrderedDict[str, _Dir] = OrderedDict()
        self.stable_ctime: int | None = None
        """The ``ctime`` at which the kept children were last known good."""


def _ident(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


class DirWalk:
    """One worker's use of the directories for one step of work: the
    directories it reaches stay open until it ends (``with``), each is checked
    again at most once in it. Not shared between threads."""

    def __init__(self, dirs: DirFds) -> None:
        self._dirs = dirs
        self.held: list[_Dir] = []
        self.seen: dict[str | None, _Dir | None] = {}
        self.checked: set[str | None] = set()
        self.unsafe: dict[str | None, UnsafeDir] = {}
        self.stable: dict[_Dir, bool] = {}

    def __enter__(self) -> DirWalk:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._dirs._release(self.held)
        self.held = []

    def checked_fd(self, shard: str | None) -> int | None:
        """The descriptor of ``shard``'s directory (None: the namespace
        directory), checked; None when there is none."""
        d = self._dirs._get(self, shard, check=True, make=False)
        return None if d is None else d.fd

    def make(self, shard: str | None) -> int:
        """The descriptor of ``shard``'s directory, checked, made if missing
        (``OSError`` when it cannot be: :class:`UnsafeDir`, ``ENOENT``, ...)."""
        d = self._dirs._get(self, shard, check=True, make=True)
        if d is None:
            raise FileNotFoundError(errno.ENOENT, "directory removed", self._dirs.path(shard))
        return d.fd

    def at(self, shard: str | None, op: Callable[[int], _T]) -> _T:
        """``op(descriptor of shard's directory)``; when it finds nothing
        (``FileNotFoundError``) in a kept descriptor, the directory is checked
        again and, if it went away or was replaced, ``op`` runs in the one there
        now. ``FileNotFoundError`` when there is no directory; :class:`UnsafeDir`
        for one that must not be used."""
        d = self._dirs._get(self, shard, check=False, make=False)
        if d is not None:
            try:
                return op(d.fd)
            except FileNotFoundError:
                again = self._dirs._get(self, shard, check=True, make=False)
                if again is None or again is d:
                    raise
                return op(again.fd)
        again = self._dirs._get(self, shard, check=True, make=False)
        if again is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", self._dirs.path(shard))
        return op(again.fd)


class DirFds:
    """The open directories of one namespace of a disk tier (``top``: the
    tier's ``path``; ``namespace``: the name of its directory there). Used on
    the tier's worker threads only; its lock is never held over a system call."""

    def __init__(
        self, top: str, namespace: str, on_unsafe: Callable[[str, str], None], limit: int
    ) -> None:
        self._top_path = top
        self._ns_name = namespace
        self._ns_path = os.path.join(top, namespace)
        self._on_unsafe = on_unsafe
        self._limit = max(1, limit)
        self._lock = threading.Lock()
        self._top: _Dir | None = None
        self._ns: _Dir | None = None
        self._closed = False

    def path(self, shard: str | None) -> str:
        """The path of ``shard``'s directory (for messages only)."""
        return self._ns_path if shard is None else os.path.join(self._ns_path, shard)

    def walk(self) -> DirWalk:
        return DirWalk(self)

    # -- the check at start: ValueError for a directory that is not safe to use ------------
    def setup(self, shards: Sequence[str]) -> None:
        """Make or check ``path`` (this user's, not writable by others), the
        namespace directory and each of ``shards`` in it (each a directory, not
        a symlink, this user's, ``0700``): ``ValueError`` naming the first that
        is not safe, ``OSError`` when one cannot be made. Keeps the first two open."""
        os.makedirs(self._top_path, mode=0o700, exist_ok=True)
        top = self._open_top(strict=True)
        ns: _Dir | None = None
        try:
            ns = self._strict_child(top.fd, self._ns_name, self._ns_path)
            for shard in shards:
                os.close(self._strict_child(ns.fd, shard, self.path(shard)).fd)
        except BaseException:
            os.close(top.fd)
            if ns is not None:
                os.close(ns.fd)
            raise
        closing: list[int] = []
        with self._lock:
            for old in (self._top, self._ns):
                if old is not None:
                    self._drop(old, closing)
            self._top, self._ns = top, ns
            if self._closed:
                self._drop(top, closing)
                self._drop(ns, closing)
        _close_all(closing)

    def _strict_child(self, parent: int, name: str, path: str) -> _Dir:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = open_dir(name, parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(
                    f"path: {path!r} exists and is not a directory (or is a symlink)"
                ) from None
            raise
        st = os.fstat(fd)
        problem = private_dir_problem(path, st)
        if problem is not None:
            os.close(fd)
            raise ValueError(problem)
        return _Dir(fd, st)

    def _open_top(self, strict: bool) -> _Dir:
        """``path`` opened (following a symlink there) and checked: ``ValueError``
        (``strict``) or :class:`UnsafeDir` when it is not safe to use."""
        if strict:
            st = check_top_dir(self._top_path)
        else:
            st = os.stat(self._top_path)
            problem = top_dir_problem(self._top_path, st)
            if problem is not None:
                raise UnsafeDir(problem)
        fd = os.open(self._top_path, TOP_FLAGS)
        fst = os.fstat(fd)
        problem = top_dir_problem(self._top_path, fst)
        if problem is None and _ident(fst) != _ident(st):
            problem = f"path: {self._top_path!r} was replaced while it was checked"
        if problem is not None:
            os.close(fd)
            if strict:
                raise ValueError(problem)
            raise UnsafeDir(problem)
        return _Dir(fd, fst)

    # -- lookups of a walk ------------------------------------------------------------------
    def _get(self, walk: DirWalk, shard: str | None, check: bool, make: bool) -> _Dir | None:
        """``shard``'s directory for ``walk`` (None: the namespace directory):
        as kept, or (``check``) checked again once in this walk; made if missing
        (``make``); None when there is none."""
        if walk.unsafe and shard in walk.unsafe:
            raise walk.unsafe[shard]
        if shard in walk.seen:
            known = walk.seen[shard]
            if not check or shard in walk.checked:
                if known is not None or not make:
                    return known
            elif known is not None and shard is not None:  # leased in this walk already
                ns = self._get(walk, None, True, make)
                if ns is not None and self._children_stable(walk, ns) and not known.dropped:
                    walk.checked.add(shard)
                    return known
        if shard is None:
            return self._get_ns(walk, check, make)
        ns = self._get(walk, None, check, make)
        if ns is None:
            walk.seen[shard] = None
            if None in walk.checked:
                walk.checked.add(shard)
            return None
        trusted = not check or self._children_stable(walk, ns)
        cur = self._kept(walk, ns, shard)
        if cur is not None and trusted:
            return self._known(walk, shard, cur, check)
        if None in walk.checked:  # (else what is found here is checked again when asked)
            walk.checked.add(shard)
        found: _Dir | None = None
        try:
            found = self._child(walk, ns, shard, cur, make, self.path(shard))
        except UnsafeDir as exc:
            walk.unsafe[shard] = exc
            raise
        finally:
            self._keep_child(ns, shard, cur, found)
        walk.seen[shard] = found
        return found

    def _get_ns(self, walk: DirWalk, check: bool, make: bool) -> _Dir | None:
        trusted = not check
        top: _Dir | None = None
        verified = False  # top: path still names it
        if check:
            try:
                top, verified = self._get_top(walk, None)
                if not verified and self._top_moved(top):
                    top, _ = self._get_top(walk, top)
            except UnsafeDir as exc:
                walk.unsafe[None] = exc
                raise
            verified = True
            trusted = self._children_stable(walk, top)
        cur = self._kept(walk, None, None)
        if cur is not None and trusted:
            return self._known(walk, None, cur, check)
        walk.checked.add(None)
        found: _Dir | None = None
        try:
            if top is None:
                top, verified = self._get_top(walk, None)
            found = self._child(walk, top, self._ns_name, cur, make, self._ns_path)
            if found is None and not verified and self._top_moved(top):
                top, _ = self._get_top(walk, top)  # path names another directory now
                found = self._child(walk, top, self._ns_name, None, make, self._ns_path)
        except UnsafeDir as exc:
            walk.unsafe[None] = exc
            raise
        finally:
            closing: list[int] = []
            with self._lock:
                if found is not self._ns and (self._ns is cur or found is not None):
                    if self._ns is not None:
                        self._drop(self._ns, closing)
                    self._ns = found
                    if found is not None and self._closed:
                        self._drop(found, closing)
            _close_all(closing)
        walk.seen[None] = found
        return found

    def _kept(self, walk: DirWalk, parent: _Dir | None, name: str | None) -> _Dir | None:
        """The kept directory ``name`` of ``parent`` (None: the namespace
        directory), leased to ``walk``; None when none is kept."""
        with self._lock:
            self._check_open()
            if parent is None or name is None:
                cur = self._ns
            else:
                cur = parent.children.get(name)
                if cur is not None:
                    parent.children.move_to_end(name)
            if cur is not None:
                self._lease(walk, cur)
        return cur

    @staticmethod
    def _known(walk: DirWalk, name: str | None, d: _Dir, check: bool) -> _Dir:
        walk.seen[name] = d
        if check:
            walk.checked.add(name)
        return d

    def _get_top(self, walk: DirWalk, replace: _Dir | None) -> tuple[_Dir, bool]:
        """The tier's ``path``, open (and whether it was opened just now);
        ``replace``: that one is stale, open the one the path names now."""
        closing: list[int] = []
        with self._lock:
            cur = self._top
            if replace is not None and cur is replace:
                self._top = None
                self._drop(replace, closing)
                cur = None
            if cur is not None:
                self._lease(walk, cur)
        _close_all(closing)
        if cur is not None:
            return cur, False
        d = self._open_top(strict=False)
        with self._lock:
            if self._top is not None:
                self._drop(self._top, closing)
            self._top = d
            if self._closed:
                self._drop(d, closing)
            self._lease(walk, d)
        _close_all(closing)
        return d, True

    def _children_stable(self, walk: DirWalk, parent: _Dir) -> bool:
        """Whether the kept children of ``parent`` are still what their names
        lead to, from one ``fstat`` of it per walk (see the module's notes):
        True while its ``ctime`` has not moved since they were known good; when
        it moved (and not within :data:`RACY_NS`), they are dropped and the
        ``ctime`` recorded; False within :data:`RACY_NS` of a change."""
        known = walk.stable.get(parent)
        if known is not None:
            return known
        try:
            ctime = os.fstat(parent.fd).st_ctime_ns
        except OSError:
            ctime = None
        stable = False
        closing: list[int] = []
        with self._lock:
            if ctime is not None and ctime == parent.stable_ctime:
                stable = True
            elif ctime is not None and time.time_ns() - ctime >= RACY_NS:
                for child in parent.children.values():
                    self._drop(child, closing)
                parent.children.clear()
                if parent is self._top and self._ns is not None:
                    self._drop(self._ns, closing)  # the top's one kept child
                    self._ns = None
                parent.stable_ctime = ctime
                stable = True
        _close_all(closing)
        walk.stable[parent] = stable
        return stable

    def _top_moved(self, top: _Dir) -> bool:
        """``path`` no longer names the directory ``top`` has open."""
        try:
            return _ident(os.stat(self._top_path)) != top.ident
        except OSError:
            return True

    def _child(
        self, walk: DirWalk, parent: _Dir, name: str, cur: _Dir | None, make: bool, path: str
    ) -> _Dir | None:
        """Directory ``name`` in ``parent``: ``cur`` when it is still the one
        there, else opened (made first with ``make``; a symlink or other entry
        in its place removed first); None when there is none."""
        try:
            st: os.stat_result | None = os.lstat(name, dir_fd=parent.fd)
        except FileNotFoundError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and cur is not None
            and _ident(st) == cur.ident
        ):
            return cur
        if st is not None and not stat.S_ISDIR(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            self._on_unsafe(path, f"{what} where a directory belongs: removed, never followed")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent.fd)
            st = None
        if st is None:
            if not make:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent.fd)
        try:
            fd = open_dir(name, parent.fd)
        except FileNotFoundError:
            if make:
                raise
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            detail = "swapped for a symlink or a file while opened: not followed"
            self._on_unsafe(path, detail)
            raise UnsafeDir(f"{path}: {detail}") from None
        try:
            fst = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        problem = private_dir_problem(path, fst)
        if problem is not None:
            os.close(fd)
            self._on_unsafe(path, problem)
            raise UnsafeDir(problem)
        d = _Dir(fd, fst)
        with self._lock:
            self._lease(walk, d)
        return d

    def _keep_child(self, ns: _Dir, name: str, cur: _Dir | None, found: _Dir | None) -> None:
        """``found`` is ``name``'s directory in ``ns`` now (was ``cur``): kept
        in its place, the least recently used beyond the limit dropped."""
        if found is cur:
            return
        closing: list[int] = []
        with self._lock:
            old = ns.children.get(name)
            if old is not None and (old is cur or found is not None):
                del ns.children[name]
                self._drop(old, closing)
            if found is not None:
                if ns.dropped or self._closed:
                    self._drop(found, closing)
                else:
                    ns.children[name] = found
                    while len(ns.children) > self._limit:
                        _, victim = ns.children.popitem(last=False)
                        self._drop(victim, closing)
        _close_all(closing)

    # -- leases (call with the lock held) --------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "disk tier closed", self._ns_path)

    def _lease(self, walk: DirWalk, d: _Dir) -> None:
        d.users += 1
        walk.held.append(d)

    def _drop(self, d: _Dir, closing: list[int]) -> None:
        """No longer kept: closed once no walk uses it (with what it kept)."""
        if d.dropped:
            return
        d.dropped = True
        for child in d.children.values():
            self._drop(child, closing)
        d.children.clear()
        if d.users == 0:
            closing.append(d.fd)

    def _release(self, held: list[_Dir]) -> None:
        closing: list[int] = []
        with self._lock:
            for d in held:
                d.users -= 1
                if d.dropped and d.users == 0:
                    closing.append(d.fd)
        _close_all(closing)

    def close(self) -> None:
        """Close every kept descriptor (one still in use when its walk ends)."""
        closing: list[int] = []
        with self._lock:
            self._closed = True
            for d in (self._top, self._ns):
                if d is not None:
                    self._drop(d, closing)
            self._top = self._ns = None
        _close_all(closing)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
