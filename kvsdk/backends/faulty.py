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

Values are kept in the wrapped tier inside kvsdk's chunk frame
(:mod:`kvsdk.chunk_format`), and every value read back is checked with the
same frame checks the built-in tiers run, *after* the fault is injected: a
corrupted or truncated read is a miss (counted), never a load. Faults are
drawn from a ``random.Random(seed)`` in call order, so a run replays exactly.
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
        self.o = options
        self._ns = context.namespace_fp
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

    def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        self._call_faults()
        out: list[Buffer | None] = []
        for key, value in zip(keys, self.inner.get(keys), strict=True):
            if value is None:
                out.append(None)
                continue
            data = bytearray(value)
            if data and self._draw(self.o.corrupt_read_rate):
                self.injected["corrupt_read"] += 1
                with self._lock:
                    pos = self._rng.randrange(len(data))
                data[pos] ^= 0xFF
            if data and self._draw(self.o.truncate_rate):
                self.injected["truncated_read"] += 1
                del data[len(data) // 2 :]
            try:
                out.append(decode_chunk(data, namespace_fp=self._ns, key=key))
            except CorruptChunk:
                self.injected["caught_by_checks"] += 1
                out.append(None)
        return out

    def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._call_faults()
        keep: list[tuple[ChunkKey, Buffer]] = []
        dropped: set[int] = set()
        for i, (key, value) in enumerate(items):
            if self._draw(self.o.drop_write_rate):
                self.injected["dropped_write"] += 1
                dropped.add(i)
            else:
                keep.append((key, encode_chunk(self._ns, key, value)))
        stored = iter(self.inner.put(keep)) if keep else iter(())
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

    def close(self) -> None:
        self.inner.close()

    @property
    def supports_listing(self) -> bool:  # type: ignore[override]
        return self.inner.supports_listing

    def iter_keys(self) -> Iterator[ChunkKey]:
        return self.inner.iter_keys()


@hookimpl
def kvsdk_backends() -> dict[str, Any]:
    return {"faulty": FaultyBackend}
