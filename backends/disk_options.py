"""The disk tier's options: what a deployment sets for it (directory, capacity,
durability, threads, the deadline of every file-system call), checked when
they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsdk.config import BYTES


@dataclass(frozen=True)
class DiskOptions:
    path: str
    """Directory for the cache (created if missing); may be shared by processes."""
    capacity: int = field(default=64 << 30, metadata=BYTES)
    """Bytes of chunk files this tier keeps (e.g. ``200GiB``); LRU beyond that."""
    fsync: bool = False
    """``fsync`` each file and its directory before it counts as stored."""
    shards: int = 256
    """Subdirectories per namespace (keeps directories small); created at start."""
    io_threads: int = 1
    """Threads for per-file I/O within one batch (1: none). The tiered store already
    runs batches on several threads; on a small machine more threads measured slower."""
    read_timeout: float = 5.0
    """Seconds any file-system call of this tier may take: one chunk read (open, fstat,
    read, verify), a step of `exists` or of a write (framing included), a delete, the
    start-up check and scan. Past it a read or look is a miss (`read_timeouts`), a
    write is dropped (`put_timeouts`), each counted in the tier's errors, so a hung
    network file system never holds the caller longer."""
    read_workers: int = 4
    """Reader threads of this tier (reads, `exists`, start-up), and as many writer
    threads (writes, deletes, clear); callers wait at most `read_timeout`. A call past
    its deadline keeps its thread until the OS returns; while all of a set are held
    so, its calls fail at once without a system call (`read_stalled`, `put_stalled`),
    logged."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: expected a directory path")
        if not 1 <= self.shards <= 65536:
            raise ValueError(f"shards: got {self.shards}; expected 1 to 65536")
        if self.io_threads < 1:
            raise ValueError(f"io_threads: got {self.io_threads}; expected at least 1")
        if not 0 < self.read_timeout < 86400:
            raise ValueError(
                f"read_timeout: got {self.read_timeout}; expected seconds, more than 0 "
                "(every read has a deadline)"
            )
        if not 1 <= self.read_workers <= 256:
            raise ValueError(f"read_workers: got {self.read_workers}; expected 1 to 256")
