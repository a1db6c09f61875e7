"""``mooncake``: chunks in a Mooncake Store cluster, shared by every instance.

Needs the ``[mooncake]`` extra (``mooncake-transfer-engine-non-cuda``, imported
when the tier is built, not before) and ``libibverbs.so.1`` (Debian:
``libibverbs1``), which the client links even for TCP. A master
(``mooncake_master``) keeps the object index; memory is contributed by
long-lived holders (``mooncake_client --global_segment_size=...``). An object
lives in the holder's memory, so a holder that exits takes its objects along:
by default the tier contributes none itself (``global_segment_size: 0``), so an
engine that stops takes nothing with it. See ``docs/deployment.md``.

Keys are ``kvsdk:<namespace_hex>:<key_hex>``, so two models or two tenants never
see each other's entries; each value is a :mod:`kvsdk.chunk_format` frame.

- ``exists`` is one ``batch_is_exist``.
- ``put`` / ``put_parts`` ask ``batch_is_exist`` first and write only absent
  keys (Mooncake keeps the first value of a key anyway, as SGLang's HiCache
  backend relies on), each as one object, header and payload parts written
  from where they lie (``batch_put_from_multi_buffers``, no join). Mooncake
  answers 0 to a put of a key whose first put (another thread's, another
  engine's) is still transferring, and the key reads as absent until it is
  done; so written keys are looked at once more, and one not yet readable is
  waited for (at most ``timeout``) before ``put`` says True. A full
  store refuses puts (``-200``): False, counted in ``write_refusals`` /
  ``refused_bytes`` (not an error: it evicts in the background).
- ``get_into`` / ``get_into_parts`` read each frame straight into place
  (``batch_get_into_multi_buffers``: the header into the tier's own buffer,
  the payload into the caller's) and verify it there; such a read is waited
  for, never abandoned (:mod:`kvsdk.backends.mooncake_reads`). ``get``
  (whose payloads it returns) and a key read into a buffer of another size
  take the keys' sizes from the master (``batch_get_replica_desc``), then
  read each frame whole (``batch_get_into``) into a buffer of the tier's
  own, verify it there and copy the payload on a piece at a time while in
  cache. A stored frame of another size than the caller's buffer is checked
  all the same: a good one is a miss for that buffer (kept), a bad one is
  corrupt. A value larger than a frame of ``chunk_bytes`` is not read but
  removed (``oversized``).
- A value that fails verification is a miss: counted (``corrupt``) and
  removed (forced: a read holds a lease of ~10 s on the object that refuses
  plain removal); ``UnverifiableChunk`` is counted and kept.
- ``delete`` is ``batch_remove(force=True)``; ``clear`` removes this
  namespace's keys with ``remove_by_regex``.

Failures never raise out of ``exists``/``get``/``put``/``delete``: a master
that does not answer (``-900``, or no answer within the call's deadline: see
:mod:`kvsdk.backends.mooncake_client`) gives misses or refused writes, counted
in ``error_count()``, and opens the circuit breaker: calls skip the store for
a backoff (``available()`` False meanwhile). Mooncake's ``health_check()`` is
not used: it reported a healthy store while the master was dead. A master
restart loses every object unless its snapshot or HA options are on; the
tier then serves misses until chunks are written again.

The client is set up on the first call, once the master's port accepts a
connection: Mooncake's ``setup`` holds the GIL while it retries a master that
does not answer (~90 s, freezing every thread of the process), so a master
that is down when the tier starts costs a refused connection, not a setup.
(A master dying between that probe and the setup still costs the freeze; with
``etcd://`` masters there is no port to probe.)

Every call runs on a call thread within its deadline (``timeout`` plus its
bytes at 64 MiB/s); the caller waits no longer, except for a read into its
own buffers (``get_into``), which opens the breaker at the deadline and is
then waited for, so that it never writes into memory the caller has reused.
A ``put`` abandoned past its deadline may still read the caller's buffer
later; a frame built from changed bytes fails verification when read (a
miss, removed).

Zero-copy registration: ``register_buffer`` is not used, and the transport is
TCP only. Over TCP Mooncake reads and writes unregistered memory (measured:
no faster registered). RDMA would need every buffer registered: reads and
writes go from and to the caller's memory, and the host slab the tiered store reads into and writes from is never handed to a
slower tier (``TierContext.slab`` is for the host tier only), so it cannot be
registered once up front; registering each caller buffer per call costs more
than it saves.

Listing: the Mooncake client cannot list keys, so ``supports_listing`` is
False and ``inventory`` is the default (nothing); ``wipe`` removes by key
pattern (``remove_by_regex``) and works.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.backends.mooncake_client import (
    IN_FLIGHT,
    NO_SPACE,
    RPC_FAIL,
    Connection,
    Outage,
    address_of,
)
from kvsdk.backends.mooncake_options import MooncakeOptions
from kvsdk.backends.mooncake_reads import MooncakeReads, Staging
from kvsdk.chunk_format import FP_BYTES, HEADER_SIZE, as_payload, encode_header
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey, Locality, Medium

__all__ = ["MooncakeBackend", "MooncakeOptions", "kvsdk_backends"]

log = logging.getLogger(__name__)

PREFIX = "kvsdk:"

_Framed = tuple[ChunkKey, list[memoryview], str, tuple[int, ...]]
"""A write: the key, the payload as flat byte views, its dtype and shape."""


class MooncakeBackend(MooncakeReads, Backend):
    name = "mooncake"
    Options = MooncakeOptions
    medium = Medium.REMOTE
    locality = Locality.CLUSTER
    supports_get_into = True
    supports_scatter_gather = True

    def __init__(self, options: MooncakeOptions, context: TierContext) -> None:
        if len(context.namespace_fp) != FP_BYTES:
            raise ValueError("mooncake tier: the namespace fingerprint must be 16 bytes")
        self.options = options
        self._ns = context.namespace_fp
        self._mac = context.frame_key
        self._max_frame = HEADER_SIZE + context.chunk_bytes if context.chunk_bytes > 0 else None
        self._prefix = f"{PREFIX}{context.namespace_fp.hex()}:"
        self._conn = Connection(options, log)  # connects on the first call
        self._staging = Staging()

    # -- writes ----------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        framed: list[_Framed] = []
        for key, value in items:
            flat, dtype, shape = as_payload(value)
            framed.append((key, [flat], dtype, tuple(shape)))
        return self._put(framed)

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        framed: list[_Framed] = []
        for key, parts in items:
            flat = [p if p.format == "B" and p.ndim == 1 else p.cast("B") for p in parts]
            framed.append((key, flat, "|u1", (sum(p.nbytes for p in flat),)))
        return self._put(framed)

    def _put(self, items: list[_Framed]) -> list[bool]:
        """Write the absent keys of ``items`` (each once), in one call: the existence
        check, the framing and the write on one call thread, within the deadline."""
        if not items:
            return []
        mkeys = [self._mkey(k) for k, *_ in items]
        nbytes = [HEADER_SIZE + sum(p.nbytes for p in parts) for _, parts, *_ in items]
        fits = [self._max_frame is None or n <= self._max_frame for n in nbytes]
        # (larger than a frame: not written, a reader would drop it)

        def write(c: Any) -> tuple[list[int], list[int], list[int]]:
            codes = c.batch_is_exist(mkeys)
            first: dict[str, int] = {}  # each absent key written once (its first item)
            if RPC_FAIL not in codes:
                for i, (mkey, code) in enumerate(zip(mkeys, codes)):
                    if code != 1 and fits[i]:
                        first.setdefault(mkey, i)
            todo = list(first.values())
            if not todo:
                return codes, todo, []
            names, ptrs, lens, keep = [], [], [], []
            for i in todo:
                key, parts, dtype, shape = items[i]
                header = encode_header(self._ns, key, parts, dtype, shape, mac_key=self._mac)
                body = [p for p in parts if p.nbytes]
                keep.append((header, body))  # alive until Mooncake returns
                names.append(mkeys[i])
                ptrs.append([address_of(header)] + [address_of(p) for p in body])
                lens.append([HEADER_SIZE] + [p.nbytes for p in body])
            written = c.batch_put_from_multi_buffers(names, ptrs, lens)
            return codes, todo, self._settled(c, names, written)

        ok = [False] * len(items)
        try:
            codes, todo, written = self._conn.call("put", write, nbytes=sum(nbytes))
        except Outage:
            codes, todo, written = [], [], []
        if codes and self._answered("put", [*codes, *written]):
            stored = {mkeys[i] for i, code in zip(todo, written) if code == 0}
            ok = [code == 1 or mkey in stored for mkey, code in zip(mkeys, codes)]
            self._refused(
                [nbytes[i] for i, code in zip(todo, written) if code == NO_SPACE],
                [code for code in written if code not in (0, NO_SPACE, IN_FLIGHT)],
            )
        self._conn.count("puts", sum(ok))
        self._conn.count("put_failures", len(items) - sum(ok))
        return ok

    def _settled(self, c: Any, names: list[str], written: list[int]) -> list[int]:
        """``written`` with :data:`IN_FLIGHT` where a put answered 0 but its object
        is not readable: Mooncake answers 0 to a put of a key whose first put (from
        another thread or engine) is still transferring. Such keys are looked at
        again until readable, for at most ``timeout``; the rest count as not stored
        (its writer's put may yet fail)."""
        done = [k for k, code in zip(names, written) if code == 0]
        waiting = [k for k, seen in zip(done, c.batch_is_exist(done) if done else []) if seen != 1]
        until = time.monotonic() + self.options.timeout
        while waiting and time.monotonic() < until:
            time.sleep(0.002)
            seen = c.batch_is_exist(waiting)
            if RPC_FAIL in seen:
                break
            waiting = [k for k, one in zip(waiting, seen) if one != 1]
        if not waiting:
            return written
        self._conn.count("in_flight_elsewhere", len(waiting))
        late = set(waiting)
        return [IN_FLIGHT if k in late else code for k, code in zip(names, written)]

    def _refused(self, full: list[int], other: list[int]) -> None:
        """Count writes a full store refused (``full``: their sizes) and other refusals."""
        for code in other:
            self._conn.call_error("put", code)
        if full:
            self._conn.count("write_refusals", len(full))
            self._conn.count("refused_bytes", sum(full))
            self._conn.burst.warning(
                "full", "mooncake tier %s: the store is full (-200): %d puts refused",
                self._conn.where, len(full),
            )  # fmt: skip

    # -- removal ---------------------------------------------------------------------------
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        mkeys = list(dict.fromkeys(self._mkey(k) for k in keys))
        if not mkeys:
            return 0
        n = self._remove(mkeys)
        self._conn.count("deletes", n)
        return n

    def clear(self) -> None:
        """Remove every object of this namespace (all instances sharing it lose them)."""
        pattern = "^" + re.escape(self._prefix)
        try:
            n = self._conn.call("clear", lambda c: c.remove_by_regex(pattern, True))
        except Outage as exc:
            raise BackendError(f"mooncake tier {self._conn.where}: clear: {exc}") from None
        if n < 0:
            if n == RPC_FAIL:
                self._conn.outage("clear", "the master is unreachable (-900)")
            raise BackendError(f"mooncake tier {self._conn.where}: clear answered {n}")
        self._conn.succeeded()

    # -- the rest --------------------------------------------------------------------------
    def capacity_bytes(self) -> None:
        return None  # the holders' segments are the master's to count; kvsdk sees no budget

    def corrupt_count(self) -> int:
        return self._conn.counter("corrupt")

    def error_count(self) -> int:
        """Outages (a master not answering in time, each one opening the breaker)
        and calls the store refused (not a full store: that is ``write_refusals``)."""
        return self._conn.counter("errors")

    def available(self) -> bool:
        """False while the store is skipped for its backoff (the breaker open)."""
        return self._conn.breaker.allow()

    def stats(self) -> dict[str, float]:
        return {**self._conn.stats(), "staging_bytes": float(self._staging.kept_bytes())}

    def close(self) -> None:
        self._conn.close()

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        """Remove every ``kvsdk:*`` object (or ``kvsdk:<namespace>:*``) with
        ``remove_by_regex``, forced past readers' leases. Connects as the tier does."""
        if namespace is not None and not re.fullmatch(r"[0-9a-f]+", namespace):
            raise ValueError(f"namespace: got {namespace!r}; expected a hex namespace name")
        pattern = "^" + re.escape(PREFIX + (f"{namespace}:" if namespace else ""))
        conn = Connection(options, log)
        try:
            n = int(conn.call("wipe", lambda c: c.remove_by_regex(pattern, True)))
        except Outage as exc:
            raise BackendError(f"mooncake tier {options.master}: wipe: {exc}") from None
        finally:
            conn.close()
        if n < 0:
            raise BackendError(f"mooncake tier {options.master}: wipe answered {n}")
        return n

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.options.master!r}, {self.options.protocol})"


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"mooncake": MooncakeBackend}
