"""The mooncake tier's lookups and reads (``exists``, ``get``, ``get_into``,
``get_into_parts``) and removals, a base of
:class:`~kvsdk.backends.mooncake.MooncakeBackend` (whose docstring says what
each does and why).

``get_into`` / ``get_into_parts`` (promotions into host slots) read each
frame straight into place, one ``batch_get_into_multi_buffers``: its header
into a buffer of the tier's own, its payload into the caller's buffers, then
verified there. No size lookup goes first: Mooncake reads an object only into
buffers of its exact size (a larger object answers ``-600``, a smaller one
``-800``), and those keys are read again the staged way below. Such a call is
never abandoned at its deadline, since a transfer left running could write
into a buffer the caller has reused: past the deadline the breaker opens and
the caller waits until Mooncake returns (its own timeouts, 30-60 s for a
frozen holder or master, measured; the tiered store answers lookups of the
chunks a miss after ``PENDING_GIVE_UP_S`` meanwhile). On loopback TCP a
put+get took 0.87-0.94x the time of the staged read below (paired, one
process): no copy out, no size lookup.

``get`` (and a ``get_into`` of a key twice, or of another size) reads the
staged way, within its deadline: the sizes of the objects from the master
(``batch_get_replica_desc``; ``batch_is_exist`` for the keys it does not list,
which tells an absent key from a master that does not answer), then every
frame read whole (``batch_get_into``, one slice per object) into a buffer of
the tier's own, verified there and its payload copied into the caller's
buffers; a staging buffer of a call past its deadline is simply never
reused."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsdk.backend import Buffer
from kvsdk.backends.mooncake_client import (
    BUFFER_OVERFLOW,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    TRANSFER_FAIL,
    Connection,
    Outage,
    address_of,
)
from kvsdk.chunk_format import (
    HEADER_SIZE,
    CorruptChunk,
    PayloadCheck,
    UnverifiableChunk,
    decode_chunk,
)
from kvsdk.types import ChunkKey

PIECE = 256 << 10
"""Bytes verified and copied on at a time (they stay in the CPU's cache between)."""
STAGING_KEPT = 4
"""Staging buffers kept for reuse (more are allocated while more calls run at once)."""
STAGING_KEPT_BYTES = 256 << 20
"""The most bytes of staging buffers kept for reuse; a buffer beyond it is let go."""


class Staging:
    """Reusable read buffers (a fresh one faults its pages in on every call). They
    are numpy arrays: numpy asks for transparent huge pages for large ones, and
    Mooncake's TCP reads into them measured ~20% faster than into a bytearray."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                buf = min(fits, key=len)
                del self._free[next(i for i, b in enumerate(self._free) if b is buf)]
                return buf
        return np.empty(-(-max(nbytes, 1) // (1 << 20)) << 20, np.uint8)  # whole MiB

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)  # keep the largest that fit the limits
            while len(self._free) > STAGING_KEPT or self._kept() > STAGING_KEPT_BYTES:
                self._free.pop(0 if self._kept() > STAGING_KEPT_BYTES else -1)

    def _kept(self) -> int:
        return sum(len(b) for b in self._free)

    def kept_bytes(self) -> int:
        """Bytes of staging buffers kept for reuse."""
        with self._lock:
            return self._kept()


class _Read:
    """What one read call found: the master's codes for keys it did not list, each
    object's size (-1: absent, or not read), the buffer the frames are in with each
    one's offset, and Mooncake's answer per frame read."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.sizes: dict[str, int] = {}
        self.buf: np.ndarray | None = None
        self.offsets: dict[str, int] = {}
        self.got: dict[str, int] = {}
        self.oversized: list[str] = []


class MooncakeReads:
    """Reads, lookups and removals; the tier's state is set by its ``__init__``."""

    _conn: Connection
    _ns: bytes
    _mac: bytes | None
    _max_frame: int | None
    """The largest frame a chunk has (None: the context gave no chunk size)."""
    _prefix: str
    _staging: Staging

    def _mkey(self, key: ChunkKey) -> str:
        return self._prefix + key.hex()

    # -- lookups ---------------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        mkeys = [self._mkey(k) for k in keys]
        try:
            codes = self._conn.call("exists", lambda c: c.batch_is_exist(mkeys))
        except Outage:
            return [False] * len(keys)
        if not self._answered("exists", codes):
            return [False] * len(keys)
        return [c == 1 for c in codes]

    def _answered(self, op: str, codes: Sequence[int]) -> bool:
        """Whether the master answered (no ``-900``): else an outage, breaker opened."""
        if RPC_FAIL in codes:
            self._conn.outage(op, "the master is unreachable (-900)")
            return False
        self._conn.succeeded()
        return True

    # -- reads -----------------------------------------------------------------------------
    def _read(self, op: str, mkeys: Sequence[str], expect: int, staged: bool) -> _Read | None:
        """Every frame of ``mkeys`` (each once) read into one buffer: a staging
        buffer (``staged``: give it back after use) or a new one. ``expect``: the
        bytes the caller expects (for the deadline). None on an outage."""
        unique = list(dict.fromkeys(mkeys))
        limit = self._max_frame
        staging = self._staging

        def read(c: Any) -> _Read:
            r = _Read()
            for k, replicas in c.batch_get_replica_desc(unique).items():
                for rep in replicas:
                    if rep.is_memory_replica():
                        r.sizes[k] = int(rep.get_memory_descriptor().buffer_descriptor.size)
                        break
                else:  # a replica on disk only: ask for the size itself
                    r.sizes[k] = int(c.get_size(k))
            rest = [k for k in unique if k not in r.sizes]
            r.codes = c.batch_is_exist(rest) if rest else []
            if RPC_FAIL in r.codes:
                return r
            names, lens = [], []
            total = 0
            for k in unique:
                size = r.sizes.get(k, -1)
                if size <= 0:
                    continue
                if limit is not None and size > limit:
                    r.oversized.append(k)  # not read: a planted huge value costs nothing
                    continue
                r.offsets[k] = total
                names.append(k)
                lens.append(size)
                total += size
            if not names:
                return r
            r.buf = staging.take(total) if staged else np.empty(total, np.uint8)
            base = address_of(r.buf)
            got = c.batch_get_into(names, [base + r.offsets[k] for k in names], lens)
            r.got = dict(zip(names, got))
            return r

        try:
            found: _Read = self._conn.call(op, read, nbytes=expect)
        except Outage:
            return None
        if not self._answered(op, [*found.codes, *found.got.values()]):
            if staged and found.buf is not None:
                staging.give(found.buf)
            return None
        if found.oversized:
            self._conn.count("oversized", len(found.oversized))
            self._conn.burst.warning("oversized", "mooncake tier: dropping %s: larger than a frame",
                                     found.oversized[0])  # fmt: skip
            self._remove(found.oversized)
        for n in found.got.values():
            if n < 0 and n != OBJECT_NOT_FOUND:  # (gone since the lookup: a plain miss)
                self._conn.call_error(op, n)
        return found

    def _frame(self, found: _Read, mkey: str) -> memoryview | None:
        """The frame read for ``mkey`` (None: absent, not read, or read short)."""
        size = found.sizes.get(mkey, -1)
        off = found.offsets.get(mkey)
        if off is None or found.buf is None or found.got.get(mkey) != size:
            return None
        return found.buf.data[off : off + size]

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        if not keys:
            return []
        mkeys = [self._mkey(k) for k in keys]
        expect = len(keys) * (self._max_frame or HEADER_SIZE)
        found = self._read("get", mkeys, expect, staged=False)  # the payloads are returned
        out: list[Buffer | None] = [None] * len(keys)
        if found is not None:
            bad: list[ChunkKey] = []
            verified: dict[str, memoryview | None] = {}
            for i, mkey in enumerate(mkeys):
                if mkey not in verified:
                    frame = self._frame(found, mkey)
                    verified[mkey] = None if frame is None else self._decode(keys[i], frame, bad)
                out[i] = verified[mkey]
            self._drop(bad)
        hits = sum(v is not None for v in out)
        self._conn.count("hits", hits)
        self._conn.count("misses", len(keys) - hits)
        return out

    def _decode(self, key: ChunkKey, frame: Buffer, bad: list[ChunkKey]) -> memoryview | None:
        """The payload of ``frame`` if it verifies; else None, counted (and ``key``
        added to ``bad`` when it is to be removed)."""
        try:
            return decode_chunk(frame, namespace_fp=self._ns, key=key, mac_key=self._mac)
        except (UnverifiableChunk, CorruptChunk) as exc:
            self._rejected(key, exc, bad)
        return None

    def _rejected(
        self, key: ChunkKey, exc: UnverifiableChunk | CorruptChunk, bad: list[ChunkKey]
    ) -> None:
        """A frame that did not verify: counted and warned of; a corrupt one's
        ``key`` added to ``bad`` (to be removed)."""
        if isinstance(exc, UnverifiableChunk):
            self._conn.count("unverifiable")
            self._conn.burst.warning("unverifiable", "mooncake tier: %s", exc.reason)
            return
        self._conn.count("corrupt")
        self._conn.burst.warning("corrupt", "mooncake tier: dropping %s: %s",
                                 self._mkey(key), exc.reason)  # fmt: skip
        bad.append(key)

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        return self.get_into_parts(keys, [[o] for o in outs])

    def get_into_parts(
        self, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        if not keys:
            return []
        mkeys = [self._mkey(k) for k in keys]
        wanted = [sum(p.nbytes for p in parts) for parts in outs]
        if len(set(mkeys)) < len(mkeys) or not all(wanted):
            done = self._staged_into_parts(keys, mkeys, outs, wanted)  # (rare: one read a key)
        else:
            done = self._direct_into_parts(keys, mkeys, outs, wanted)
        hits = sum(done)
        self._conn.count("hits", hits)
        self._conn.count("misses", len(keys) - hits)
        return done

    def _direct_into_parts(
        self,
        keys: Sequence[ChunkKey],
        mkeys: list[str],
        outs: Sequence[Sequence[memoryview]],
        wanted: list[int],
    ) -> list[bool]:
        """Each frame read straight into place: its header into a buffer of the
        tier's own, its payload into the caller's buffers (one
        ``batch_get_into_multi_buffers``, no size lookup: a frame of the size the
        caller expects is read whole, any other size is refused by Mooncake).
        The call is never abandoned (see :meth:`Connection.call`): the caller's
        buffers are written by nobody once it returns. Keys whose object has
        another size (``-600`` larger, ``-800`` smaller or a holder failing) are
        read again through :meth:`_staged_into_parts`, which tells a good frame
        of another size (kept) from a bad one (removed)."""
        heads = np.empty((len(keys), HEADER_SIZE), np.uint8)
        ptrs = [[address_of(heads[i])] + [address_of(p) for p in parts if p.nbytes]
                for i, parts in enumerate(outs)]  # fmt: skip
        lens = [[HEADER_SIZE] + [p.nbytes for p in parts if p.nbytes] for parts in outs]
        expect = sum(HEADER_SIZE + n for n in wanted)
        try:
            got = self._conn.call(
                "get", lambda c: c.batch_get_into_multi_buffers(mkeys, ptrs, lens), expect,
                abandon=False,
            )  # fmt: skip
        except Outage:
            return [False] * len(keys)
        if not self._answered("get", got):
            return [False] * len(keys)
        done = [False] * len(keys)
        again: list[int] = []
        bad: list[ChunkKey] = []
        for i, n in enumerate(got):
            if n == HEADER_SIZE + wanted[i]:
                done[i] = self._check_parts(keys[i], heads[i].data, outs[i], bad)
            elif n in (BUFFER_OVERFLOW, TRANSFER_FAIL) or n >= 0:
                again.append(i)
            elif n != OBJECT_NOT_FOUND:
                self._conn.call_error("get", n)
        self._drop(bad)
        if again:
            read = self._staged_into_parts([keys[i] for i in again], [mkeys[i] for i in again],
                                           [outs[i] for i in again], [wanted[i] for i in again])  # fmt: skip
            for i, ok in zip(again, read):
                done[i] = ok
        return done

    def _check_parts(
        self, key: ChunkKey, header: memoryview, out: Sequence[memoryview], bad: list[ChunkKey]
    ) -> bool:
        """Verify a frame read into place: ``header``, its payload ``out``."""
        try:
            check = PayloadCheck(header, sum(p.nbytes for p in out),
                                 namespace_fp=self._ns, key=key, mac_key=self._mac)  # fmt: skip
            for part in out:
                check.update(part)
            check.finish()
            return True
        except (UnverifiableChunk, CorruptChunk) as exc:
            self._rejected(key, exc, bad)
        return False

    def _staged_into_parts(
        self,
        keys: Sequence[ChunkKey],
        mkeys: list[str],
        outs: Sequence[Sequence[memoryview]],
        wanted: list[int],
    ) -> list[bool]:
        """Each frame read whole into a staging buffer after a size lookup, then
        verified and copied into the caller's buffers (the call may be abandoned
        at its deadline: a late transfer lands in the staging buffer)."""
        expect = sum(HEADER_SIZE + n for n in wanted)
        found = self._read("get", mkeys, expect, staged=True)
        done = [False] * len(keys)
        if found is not None:
            bad: list[ChunkKey] = []
            failed: set[str] = set()  # frames found bad (counted once)
            for i, mkey in enumerate(mkeys):
                frame = self._frame(found, mkey)
                if frame is None or mkey in failed:
                    continue
                if frame.nbytes == HEADER_SIZE + wanted[i]:
                    done[i] = self._check_copy(keys[i], frame, outs[i], bad)
                elif self._decode(keys[i], frame, bad) is not None:
                    continue  # a good frame of another size: a miss for this buffer, kept
                if not done[i]:
                    failed.add(mkey)
            self._drop(bad)
            if found.buf is not None:
                self._staging.give(found.buf)
        return done

    def _check_copy(
        self, key: ChunkKey, frame: memoryview, out: Sequence[memoryview], bad: list[ChunkKey]
    ) -> bool:
        """Verify ``frame`` and copy its payload into ``out`` a piece at a time, each
        piece copied while still in the CPU's cache after the checksum read it."""
        try:
            check = PayloadCheck(frame[:HEADER_SIZE], frame.nbytes - HEADER_SIZE,
                                 namespace_fp=self._ns, key=key, mac_key=self._mac)  # fmt: skip
            payload = frame[HEADER_SIZE:]
            parts = iter(out)
            part, at = next(parts, None), 0
            for off in range(0, payload.nbytes, PIECE):
                piece = payload[off : off + PIECE]
                check.update(piece)
                done = 0
                while done < piece.nbytes and part is not None:
                    n = min(piece.nbytes - done, part.nbytes - at)
                    part[at : at + n] = piece[done : done + n]
                    done, at = done + n, at + n
                    if at == part.nbytes:
                        part, at = next(parts, None), 0
            check.finish()
            return True
        except (UnverifiableChunk, CorruptChunk) as exc:
            self._rejected(key, exc, bad)
        return False

    # -- removal ---------------------------------------------------------------------------
    def _remove(self, mkeys: list[str]) -> int:
        """Remove objects (forced: past a reader's lease); how many were removed."""
        try:
            codes = self._conn.call("delete", lambda c: c.batch_remove(mkeys, True))
        except Outage:
            return 0
        if not self._answered("delete", codes):
            return 0
        for code in codes:
            if code < 0 and code != OBJECT_NOT_FOUND:
                self._conn.call_error("delete", code)
        return sum(code == 0 for code in codes)

    def _drop(self, bad: list[ChunkKey]) -> None:
        if bad:
            self._remove(list(dict.fromkeys(self._mkey(k) for k in bad)))
