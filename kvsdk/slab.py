"""Host slabs in named shared memory: one per engine, seen by all its processes.

An engine is several processes (vLLM: a scheduler process and one worker
process per tensor/pipeline rank). kvsdk's scheduler side owns the host
tier's index and writes chunks through to slower tiers and promotes them
back; the workers copy KV blocks in and out. All of them must see the same
bytes, so the host tier's slab is a POSIX shared-memory segment:

- the scheduler side **creates** it (``SharedSlab.create``): ``O_EXCL``,
  mode ``0600``, named after the engine's id and the user, with a header
  naming its creator (pid and start time) and its geometry;
- each worker **attaches** (``SharedSlab.attach``) and checks the header:
  same magic, same owner, geometry as announced; a segment that is absent
  means the worker runs on another machine, which is refused;
- once every worker attached, the creator removes the name (``unlink``):
  the memory lives on in each process's mapping and goes with the last of
  them, so no later kill can leave it behind; the creator keeps one open
  descriptor of it (tools and tests reach it as ``/proc/<pid>/fd/N``);
- otherwise the creator unlinks it when it closes, is collected or its
  process exits (a ``weakref.finalize``, which also runs at exit); a segment
  whose creator died without unlinking (``kill -9``) is reclaimed by the
  next engine that starts (``reclaim_stale``).

A slot holds one chunk of every rank: ``num_regions`` regions of
``region_bytes`` each, rank ``r``'s part at byte ``r * region_bytes`` of the
slot, so writing a slot through to disk or Redis moves every rank's bytes in
one frame, and a chunk read back is whole or a miss. A worker's view of its
own region (``region(r)``) is a strided ``(num_slots, region_bytes)`` tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsdk import prefault as _prefault
from kvsdk.prefault import Prefault

SHM_DIR = Path("/dev/shm")
PREFIX = "kvsdk-"
HEADER_BYTES = 4096
"""The header's page; slots start page-aligned after it."""
_MAGIC = b"KVSDKSLB"
_HEADER = struct.Struct("<8sIIqqqqqI")
"""magic, version, uid, creator pid, creator start time, num_slots, slot_bytes,
region_bytes, num_regions"""
_VERSION = 1


class SlabError(RuntimeError):
    """A shared slab cannot be created or attached; the message is one sentence."""


@dataclass(frozen=True)
class SlabGeometry:
    num_slots: int
    region_bytes: int
    num_regions: int = 1

    @property
    def slot_bytes(self) -> int:
        return self.region_bytes * self.num_regions

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_slots * self.slot_bytes


def segment_name(engine_id: str) -> str:
    """The segment of the engine with this id, for this user (``kvsdk-<uid>-<hash>``)."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=12).hexdigest()
    return f"{PREFIX}{os.geteuid()}-{digest}"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after its closing paren
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, start_time: int) -> bool:
    return _start_time(pid) == start_time


def _read_header(fd: int) -> tuple[int, int, int, SlabGeometry] | None:
    """``(uid, pid, start_time, geometry)`` of a segment, None if it has no valid header."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) < _HEADER.size:
        return None
    magic, version, uid, pid, start, n, slot, region, regions = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION or region * regions != slot:
        return None
    return uid, pid, start, SlabGeometry(n, region, regions)


def reclaim_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink this user's kvsdk segments whose creating process is gone; returns their names."""
    reclaimed = []
    uid = os.geteuid()
    for path in shm_dir.glob(f"{PREFIX}{uid}-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != uid:
                continue
            header = _read_header(fd)
        finally:
            os.close(fd)
        if header is None:
            continue  # being created right now, or not ours to judge
        _, pid, start, _ = header
        if not _alive(pid, start):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            reclaimed.append(path.name)
    return reclaimed


class SharedSlab:
    """A mapped segment: ``tensor`` is the ``uint8 (num_slots, slot_bytes)`` slab."""

    def __init__(
        self,
        name: str,
        path: Path,
        mm: mmap.mmap,
        geometry: SlabGeometry,
        owner: bool,
        fd: int | None = None,
    ):
        self.name = name
        self.path = path
        self.geometry = geometry
        self.owner = owner
        self._mmap = mm
        flat = torch.frombuffer(
            mm, dtype=torch.uint8, count=geometry.nbytes - HEADER_BYTES, offset=HEADER_BYTES
        )
        self.tensor = flat.view(geometry.num_slots, geometry.slot_bytes)
        self._unlink_at_exit = weakref.finalize(self, _unlink_quietly, path) if owner else None
        if fd is not None:
            weakref.finalize(self, os.close, fd)
        self.prefaulting: Prefault | None = None
        """The walk committing this mapping's pages (:mod:`kvsdk.prefault`), if any."""

    def prefault(self, *, inline: bool = False, start: int = 0) -> None:
        """Commit the slab's pages in this process so no store pays a page fault
        (the creator allocates them, each worker maps them): the first ``start``
        bytes now, the rest on a background thread ahead of the stores
        (:meth:`stores_reached`), or with ``inline`` on the storing thread just
        before the stores (a process with no CPU to spare)."""
        if self.prefaulting is None:
            addr = self.tensor.data_ptr() - HEADER_BYTES  # the mapping's start: page-aligned
            self.prefaulting = Prefault(
                addr, self.geometry.nbytes, self._mmap, self.name, inline=inline, start=start
            )

    @property
    def walking(self) -> bool:
        """Whether this process's prefault walk still wants :meth:`stores_reached`."""
        return self.prefaulting is not None and not self.prefaulting.done

    def stores_reached(self, end_slot: int) -> None:
        """Stores in this process have reached the slots below ``end_slot``."""
        if self.prefaulting is not None:
            self.prefaulting.reached(HEADER_BYTES + end_slot * self.geometry.slot_bytes)

    @classmethod
    def create(
        cls, name: str, geometry: SlabGeometry, *, shm_dir: Path = SHM_DIR, prefault: bool = False
    ) -> SharedSlab:
        if not shm_dir.is_dir():
            raise SlabError(
                f"kvsdk needs POSIX shared memory ({shm_dir}) for a host tier shared by the "
                "engine's processes, and this machine has none"
            )
        reclaim_stale(shm_dir)
        free = _free_bytes(shm_dir)
        if geometry.nbytes > free:
            raise SlabError(
                f"tiers[0] capacity needs {geometry.nbytes} B of shared memory but {shm_dir} has "
                f"{free} B free: lower the cpu tier's capacity or enlarge {shm_dir} "
                "(e.g. docker --shm-size)"
            )
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise SlabError(
                f"shared slab {name} belongs to another running engine with the same "
                "kv_transfer_config.engine_id on this machine: give each engine its own engine_id"
            ) from None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, geometry.nbytes)
            me = os.getpid()
            os.pwrite(
                fd,
                _HEADER.pack(
                    _MAGIC,
                    _VERSION,
                    os.geteuid(),
                    me,
                    _start_time(me) or 0,
                    geometry.num_slots,
                    geometry.slot_bytes,
                    geometry.region_bytes,
                    geometry.num_regions,
                ),
                0,
            )
            mm = mmap.mmap(fd, geometry.nbytes)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        slab = cls(name, path, mm, geometry, owner=True, fd=fd)
        if prefault:
            slab.prefault(start=_prefault.START_BYTES)
        return slab

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        shm_dir: Path = SHM_DIR,
        prefault: bool = False,
        prefault_inline: bool = False,
    ) -> SharedSlab:
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SlabError(
                f"kvsdk's shared host slab {name} is not on this machine: a worker on another "
                "machine than the engine's scheduler is not supported yet"
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise SlabError(
                    f"shared slab {path} is not private to this user (uid {st.st_uid}, mode "
                    f"{oct(st.st_mode & 0o777)}): refusing to attach"
                )
            header = _read_header(fd)
            if header is None or header[0] != os.geteuid():
                raise SlabError(f"shared slab {path} has no valid kvsdk header: refusing to attach")
            geometry = header[3]
            if st.st_size < geometry.nbytes:
                raise SlabError(f"shared slab {path} is truncated: refusing to attach")
            mm = mmap.mmap(fd, geometry.nbytes)
        finally:
            os.close(fd)
        slab = cls(name, path, mm, geometry, owner=False)
        if prefault:
            slab.prefault(inline=prefault_inline, start=_prefault.START_BYTES)
        return slab

    def region(self, index: int) -> torch.Tensor:
        """Rank ``index``'s part of every slot: ``(num_slots, region_bytes)``, row stride a slot."""
        g = self.geometry
        if not 0 <= index < g.num_regions:
            raise SlabError(f"region {index} of a slab with {g.num_regions} region(s)")
        r = g.region_bytes
        return self.tensor[:, index * r : (index + 1) * r]

    def unlink(self) -> None:
        """Remove the name (the creator, at shutdown); mappings stay valid."""
        _unlink_quietly(self.path)
        if self._unlink_at_exit is not None:
            self._unlink_at_exit.detach()


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
