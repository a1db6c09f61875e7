"""``faulty``: a wrapper tier that injects failures, reproducibly, around any other tier.

It is how kvsdk's own tests, and users evaluating kvsdk, rehearse failures::

    tiers:
      - backend: cpu
        capacity: 1GiB
      - backend: faulty
        seed: 7
        error_rate: 0.05        # the call raises (a backend error)
        timeout_rate: 0.01      # the call hangs for timeout_ms, then raises
        latency_ms: 2           # added to every call
        drop_write_rate: 0.05   # put() says stored, but nothing is kept
        corrupt_read_rate: 0.05 # a byte of the value read back is flipped
        truncate_rate: 0.02     # the value read back is cut short
        wraps:
          backend: disk
          path: /var/cache/kvsdk

The wrapper is transparent: values go to the wrapped tier as they are (it
frames them itself), so a directory or database written through the wrapper
is the bare tier's, and a restart reads what a previous process wrote, with
or without the wrapper; listing, the index, ``get_into``, scatter/gather and
the capabilities are the wrapped tier's. A corrupted or truncated read is
rehearsed on a real frame: the value read is framed again (namespace, key,
MAC key when a deployment secret is set), damaged, and put through the same
frame checks every tier runs; the check rejects it, so it is a miss
(counted as ``caught_by_checks``), never a load. Faults are drawn from a
``random.Random(seed)`` in call order, so a run replays exactly.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsdk.backend import Backend, BackendError, Buffer, TierContext
from kvsdk.chunk_format import CorruptChunk, decode_chunk, encode_chunk
from kvsdk.hooks import hookimpl
from kvsdk.types import ChunkKey


@dataclass(frozen=True)
class FaultyOptions:
    wraps: dict[str, Any] = field(default_factory=dict)
    """The wrapped tier, as a tier mapping (``backend:`` plus its options)."""
    seed: int = 0
    error_rate: float = 0.0
    timeout_rate: float = 0.0
    timeout_ms: float = 200.0
    latency_ms: float = 0.0
    drop_write_rate: float = 0.0
    corrupt_read_rate: float = 0.0
    truncate_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "error_rate",
            "timeout_rate",
            "drop_write_rate",
            "corrupt_read_rate",
            "truncate_rate",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: got {value}; expected a rate from 0 to 1")
        if not self.wraps:
            raise ValueError("wraps: missing; expected the wrapped tier, e.g. {backend: disk, ...}")
        from kvsdk.config import build_tier_config

        build_tier_config(self.wraps, "wraps")  # the wrapped tier's options are checked up front


class FaultyBackend(Backend):
    name = "faulty"
    Options = FaultyOptions

    def __init__(self, options: FaultyOptions, context: TierContext) -> None:
        from kvsdk import plugins_manager
        from kvsdk.config import build_tier_config

        inner_cfg = build_tier_config(options.wraps, f"tiers[{context.tier_index}].wraps")
        self.inner: Backend = plugins_manager.backends()[inner_cfg.backend](
            inner_cfg.options, context
        )
        self.medium = self.inner.medium  # type: ignore[misc]
        self.locality = self.inner.locality  # type: ignore[misc]
        self.supports_listing = self.inner.supports_listing  # type: ignore[misc]
        self.supports_get_into = self.inner.supports_get_into  # type: ignore[misc]
        self.supports_scatter_gather = self.inner.supports_scatter_gather  # type: ignore[misc]
        self.supports_local_index = self.inner.supports_local_index  # type: ignore[misc]
        self.o = options
        self._ns = context.namespace_fp
        self._mac = context.frame_key
        self._rng = random.Random(options.seed)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    # -- fault draws (one lock: reproducible order under a thread pool) -----------------
    def _draw(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def _call_faults(self) -> None:
        if self.o.latency_ms:
            time.sleep(self.o.latency_ms / 1000)
        if self._draw(self.o.timeout_rate):
            self.injected["timeout"] += 1
            time.sleep(self.o.timeout_ms / 1000)
            raise BackendError("injected timeout")
        if self._draw(self.o.error_rate):
            self.injected["error"] += 1
            raise BackendError("injected error")

    # -- Backend --------------------------------------------------------------------------
    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._call_faults()
        return self.inner.exists(keys)

    def _damaged_read(self, key: ChunkKey, value: Any) -> bool:
        """Draw the read faults for one value read; on a fault, run the frame
        checks on a damaged frame of it. True: the value is lost (a miss)."""
        corrupt = self._draw(self.o.corrupt_read_rate)
        truncate = self._draw(self.o.truncate_rate)
        if not (corrupt or truncate):
            return False
        frame = bytearray(encode_chunk(self._ns, key, value, mac_key=self._mac))
        if corrupt:
            self.injected["corrupt_read"] += 1
            with self._lock:
                pos = self._rng.randrange(len(frame))
            frame[pos] ^= 0xFF
        if truncate:
            self.injected["truncated_read"] += 1
            del frame[len(frame) // 2 :]
        try:
            decode_chunk(frame, namespace_fp=self._ns, key=key, mac_key=self._mac)
        except CorruptChunk:
            self.injected["caught_by_checks"] += 1
            return True
        raise AssertionError("a damaged frame passed the frame checks")  # pragma: no cover

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._call_faults()
        return [
            None if value is None or self._damaged_read(key, value) else value
            for key, value in zip(keys, self.inner.get(keys), strict=True)
        ]

    def get_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        self._call_faults()
        done = self.inner.get_into(keys, outs)
        return [ok and not self._damaged_read(k, o) for k, o, ok in zip(keys, outs, done)]

    def get_into_parts(
        self, keys: Sequence[ChunkKey], outs: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        self._call_faults()
        done = self.inner.get_into_parts(keys, outs)
        return [
            ok and not self._damaged_read(k, b"".join(parts))
            for k, parts, ok in zip(keys, outs, done)
        ]

    def _drop_writes(self, n: int) -> set[int]:
        dropped = {i for i in range(n) if self._draw(self.o.drop_write_rate)}
        self.injected["dropped_write"] += len(dropped)
        return dropped

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._call_faults()
        dropped = self._drop_writes(len(items))
        keep = [item for i, item in enumerate(items) if i not in dropped]
        stored = iter(self.inner.put(keep)) if keep else iter(())
        return [True if i in dropped else next(stored) for i in range(len(items))]

    def put_parts(self, items: Sequence[tuple[ChunkKey, Sequence[memoryview]]]) -> list[bool]:
        self._call_faults()
        dropped = self._drop_writes(len(items))
        keep = [item for i, item in enumerate(items) if i not in dropped]
        stored = iter(self.inner.put_parts(keep)) if keep else iter(())
        return [True if i in dropped else next(stored) for i in range(len(items))]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, float]:
        s = dict(self.inner.stats())
        s.update({f"injected_{k}": float(v) for k, v in self.injected.items()})
        s["corrupt"] = s.get("corrupt", 0.0) + self.injected["caught_by_checks"]
        return s

    def capacity_bytes(self) -> int | None:
        return self.inner.capacity_bytes()

    def corrupt_count(self) -> int:
        """The wrapped tier's, plus the injected faults its frame checks caught."""
        return self.inner.corrupt_count() + self.injected["caught_by_checks"]

    def error_count(self) -> int:
        """The wrapped tier's (injected errors raise: the caller counts them)."""
        return self.inner.error_count()

    def may_contain(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.inner.may_contain(keys)  # memory only: no fault, no latency

    def available(self) -> bool:
        return self.inner.available()

    def close(self) -> None:
        self.inner.close()

    @classmethod
    def _inner(cls, options: FaultyOptions) -> tuple[type[Backend], Any]:
        from kvsdk import plugins_manager
        from kvsdk.config import build_tier_config

        cfg = build_tier_config(options.wraps, "wraps")
        return plugins_manager.backends()[cfg.backend], cfg.options

    @classmethod
    def inventory(cls, options: Any) -> list[dict[str, Any]]:
        inner, inner_options = cls._inner(options)
        return inner.inventory(inner_options)

    @classmethod
    def wipe(cls, options: Any, namespace: str | None = None) -> int:
        inner, inner_options = cls._inner(options)
        return inner.wipe(inner_options, namespace)

    def iter_keys(self) -> Iterator[ChunkKey]:
        return self.inner.iter_keys()


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"faulty": FaultyBackend}
