"""The mooncake tier's connection to the store: the ``MooncakeDistributedStore``
client (imported and set up lazily), every call made on a thread of the tier's
own with a deadline, the circuit breaker, and the counters behind ``stats()``.

Mooncake's calls block in C++ (releasing the GIL) and return status codes
rather than raising; a dead master costs ~4 s per call before ``-900``. Here a
call runs on one of ``call_threads`` threads and its caller waits at most its
deadline; a call past it keeps its thread until Mooncake returns, the caller
gets misses, and the breaker opens: later calls skip the store (no thread, no
wait) for a backoff that doubles per failure. The first success closes it."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from kvsdk.backend import BackendError
from kvsdk.backends.breaker import Breaker
from kvsdk.backends.mooncake_options import MooncakeOptions
from kvsdk.burst_log import BurstLog

T = TypeVar("T")

PACKAGE = "mooncake-transfer-engine-non-cuda"
"""The distribution that provides ``mooncake.store`` (the ``[mooncake]`` extra)."""

# Mooncake's status codes (mooncake-store's ErrorCode), the ones the tier tells apart.
NO_SPACE = -200
"""No segment has room for the object (a full store; it evicts in the background)."""
BUFFER_OVERFLOW = -600
"""The destination is smaller than the object."""
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
"""Removal refused: the object was read within its lease (``--default_kv_lease_ttl``)."""
TRANSFER_FAIL = -800
RPC_FAIL = -900
"""The master did not answer."""

IN_FLIGHT = 1
"""Not a Mooncake code: a put answered 0 while another writer's put of the key was
still transferring, and the object did not become readable within ``timeout``."""

MIN_TRANSFER_RATE = 64 << 20
"""Bytes per second a transfer is allowed at the slowest, on top of ``timeout``."""

COUNTERS = (
    "hits", "misses", "corrupt", "unverifiable", "oversized", "puts", "put_failures",
    "deletes", "skipped", "outages", "timeouts", "call_errors", "errors",
    "write_refusals", "refused_bytes", "in_flight_elsewhere", "calls",
)  # fmt: skip
"""The counters ``stats()`` reports, in its order."""


class Outage(BackendError):
    """The store did not answer a call in time (or at all)."""


def load_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``; a ValueError in one sentence
    (a config error at start-up) when the package or a library it links is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            raise ValueError(
                "the mooncake tier needs libibverbs.so.1, which the Mooncake client links "
                "even for TCP: install it (Debian/Ubuntu: apt-get install libibverbs1)"
            ) from None
        raise ValueError(
            f"the mooncake tier needs the {PACKAGE} package ({text}): pip install 'kvsdk[mooncake]'"
        ) from None
    return MooncakeDistributedStore


def address_of(buf: Any) -> int:
    """The address of a flat, contiguous byte buffer (``bytes`` included: Mooncake
    only reads it then)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class Connection:
    """One tier's Mooncake client, its call threads, breaker and counters."""

    def __init__(self, options: MooncakeOptions, log: logging.Logger) -> None:
        self.options = options
        self.where = options.master
        self.burst = BurstLog(log)
        self.breaker = Breaker(options.backoff_initial, options.backoff_max)
        self._store_class = load_store_class()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._pool = cf.ThreadPoolExecutor(
            options.call_threads, thread_name_prefix="kvsdk-mooncake"
        )
        self._client: Any = None
        self._connecting: cf.Future[Any] | None = None
        self._closed = False

    # -- counters ----------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters[name] += n

    def counter(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counters.items()}
        out["breaker_open"] = 0.0 if self.breaker.allow() else 1.0
        out["connected"] = 1.0 if self._client is not None else 0.0
        return out

    # -- failures ----------------------------------------------------------------------
    def outage(self, op: str, why: str) -> None:
        """The store did not answer ``op``: open the breaker, count, warn once per burst."""
        pause = self.breaker.failed()
        self.count("outages")
        self.count("errors")
        self.burst.warning(
            "outage", "mooncake tier %s: %s failed (%s); serving misses, retry in %.1fs",
            self.where, op, why, pause,
        )  # fmt: skip

    def call_error(self, op: str, code: int, n: int = 1) -> None:
        """The store refused ``n`` items of ``op`` with status ``code`` (not an outage)."""
        self.count("call_errors", n)
        self.count("errors", n)
        self.burst.warning(f"err:{op}:{code}", "mooncake tier %s: %s answered %d",
                           self.where, op, code)  # fmt: skip

    def deadline(self, nbytes: int = 0) -> float:
        return self.options.timeout + nbytes / MIN_TRANSFER_RATE

    # -- calls -------------------------------------------------------------------------
    def _probe(self) -> None:
        """Whether the master accepts a TCP connection (:class:`Outage` if not).
        Mooncake's ``setup`` holds the GIL while it retries a master that does not
        answer (~90 s here, every Python thread of the process frozen), so it is
        called only once the master's port answered."""
        if self.options.master.startswith("etcd://"):
            return  # the elected master is found through etcd: nothing to probe
        host, _, port = self.options.master.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), self.options.timeout).close()
        except OSError as exc:
            raise Outage(
                f"the master does not accept connections ({exc.strerror or exc})"
            ) from None

    def _setup(self) -> Any:
        o = self.options
        self._probe()
        client = self._store_class()
        rc = client.setup(
            o.local_hostname, o.metadata_server, o.global_segment_size, o.local_buffer_size,
            o.protocol, "", o.master,
        )  # fmt: skip
        if rc != 0:
            try:
                client.close()
            finally:
                raise Outage(f"setup answered {rc} (is the master at {o.master} running?)")
        with self._lock:
            if self._closed:
                client.close()
                raise Outage("the tier is closed")
            self._client = client
        return client

    def _connect(self, deadline: float) -> Any:
        with self._lock:
            if self._client is not None:
                return self._client
            if self._closed:
                raise Outage("the tier is closed")
            if self._connecting is None or self._connecting.done():
                self._connecting = self._pool.submit(self._setup)
            fut = self._connecting
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            self.count("timeouts")
            raise Outage(f"no connection within {self.options.timeout:.1f} s") from None
        except Outage:
            raise
        except Exception as exc:  # a failed setup of any kind is an outage
            raise Outage(f"setup failed: {type(exc).__name__}: {exc}") from None

    def call(self, op: str, fn: Callable[[Any], T], nbytes: int = 0, abandon: bool = True) -> T:
        """``fn(client)`` on a call thread, waiting at most the deadline (``timeout``
        plus ``nbytes`` at :data:`MIN_TRANSFER_RATE`). Raises :class:`Outage` when
        the breaker is open, connecting fails or time is up (the breaker then opens).

        Without ``abandon`` (``fn`` writes into the caller's memory) a call past
        its deadline is not left behind: the breaker opens then, as for any
        outage, and the caller waits until Mooncake returns (its own transfer
        and RPC timeouts: ~30 s for a frozen holder or master, measured), so
        nothing is written into the caller's buffers after this returns."""
        if not self.breaker.allow():
            self.count("skipped")
            raise Outage("skipped: the breaker is open")
        self.count("calls")
        end = time.monotonic() + self.deadline(nbytes)
        try:
            client = self._connect(end)
            fut = self._pool.submit(fn, client)
        except Outage as exc:
            self.outage(op, str(exc))
            raise
        except RuntimeError as exc:  # a pool shut down by close()
            raise Outage(str(exc)) from None
        try:
            return fut.result(timeout=max(0.0, end - time.monotonic()))
        except cf.TimeoutError:
            pass
        except RuntimeError as exc:
            raise Outage(str(exc)) from None
        self.count("timeouts")
        late = Outage(f"no answer within {self.deadline(nbytes):.1f} s")
        self.outage(op, str(late))
        if not abandon:
            cf.wait([fut])  # (its answer comes too late: a miss all the same)
        raise late

    def succeeded(self) -> None:
        self.breaker.succeeded()

    def close(self) -> None:
        """Stop the call threads and close the client once they are done (waiting
        at most ``timeout``; a call still inside Mooncake then closes it later)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if client is None:
            return

        def finish() -> None:
            self._pool.shutdown(wait=True)
            try:
                client.close()
            except Exception as exc:  # closing a client whose master is gone
                self.burst.warning("close", "mooncake tier %s: close: %s", self.where, exc)

        closer = threading.Thread(target=finish, name="kvsdk-mooncake-close", daemon=True)
        closer.start()
        closer.join(self.options.timeout)
