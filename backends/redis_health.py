"""The redis tier's failure accounting: a circuit breaker per server (per node
in Cluster mode), the counters behind ``stats()``, and the warnings, each
logged once per burst with the password kept out."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from redis.exceptions import AuthenticationError, ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvsdk.backends.breaker import Breaker
from kvsdk.backends.redis_options import RedisOptions, mask_url, redact
from kvsdk.burst_log import BurstLog

OUTAGE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    RedisClusterException,
    OSError,
)
"""Errors that mean "the server (node) is not answering": open its breaker."""
COUNTERS = (
    "hits", "misses", "corrupt", "unverifiable", "oversized", "puts", "put_failures", "deletes",
    "skipped", "outages", "timeouts", "command_errors", "topology_refreshes", "errors",
    "write_refusals", "writes_paused", "refused_bytes", "round_trips", "retries",
    "write_timeouts", "writes_yielded",
)  # fmt: skip
"""The counters ``stats()`` reports, in its order."""


class Health:
    """The tier's breakers (one per server name) and counters, under one lock,
    and the burst log every warning of the tier goes through (on ``log``)."""

    def __init__(self, options: RedisOptions, log: logging.Logger) -> None:
        self.options = options
        self.where = (
            f"sentinel:{options.sentinel_master}" if options.sentinels else mask_url(options.url)
        )
        """The URL with its password masked: what messages name the tier by."""
        self.burst = BurstLog(log)
        self._lock = threading.Lock()
        self._breakers: dict[str, Breaker] = {}
        self._write_pauses: dict[str, Breaker] = {}
        """Per server: writes paused after it refused them (OOM, READONLY, NOPERM)."""
        self._write_stalls: dict[str, Breaker] = {}
        """Per server: writes stalled after one timed out (reads go on)."""
        self._counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def redact(self, text: str) -> str:
        return redact(self.options, text)

    def breaker(self, name: str) -> Breaker:
        return self._breaker_in(self._breakers, name)

    def write_pause(self, name: str) -> Breaker:
        """Server ``name``'s write pause: open after it refused writes; reads go on."""
        return self._breaker_in(self._write_pauses, name)

    def write_stall(self, name: str) -> Breaker:
        """Server ``name``'s write stall: open after a write to it timed out."""
        return self._breaker_in(self._write_stalls, name)

    def write_timed_out(self, name: str, seconds: float) -> str:
        """A write to server ``name`` got no complete answer within ``seconds``: a
        busy server, not (yet) an outage. Its writes stall for a backoff while
        its reads go on (its read breaker stays as it is); counted as
        ``write_timeouts``, ``timeouts`` and ``errors``. Returns what happened."""
        pause = self.write_stall(name).failed()
        self.count("write_timeouts")
        self.count("timeouts")
        self.count("errors")
        reason = f"a write got no complete answer within {seconds:.1f} s"
        self.burst.warning(
            f"write-timeout:{name}",
            "redis tier %s: %s: %s; not writing to it for %.1fs, reads go on",
            self.where, name, reason, pause,
        )  # fmt: skip
        return reason

    def _breaker_in(self, breakers: dict[str, Breaker], name: str) -> Breaker:
        b = breakers.get(name)
        if b is None:
            with self._lock:
                b = breakers.setdefault(
                    name, Breaker(self.options.backoff_initial, self.options.backoff_max)
                )
        return b

    def writes_refused(self, name: str, exc: Exception, pause: float) -> None:
        """Server ``name`` refused writes (full, read-only, no permission): counted,
        and said once per burst; writes to it pause for ``pause`` seconds."""
        self.count("write_refusals")
        self.burst.warning(
            f"refused:{name}",
            "redis tier %s: %s refuses writes (%s); not writing to it for %.1fs, reads go on",
            self.where, name, self.redact(str(exc)), pause,
        )  # fmt: skip

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters[name] += n

    def counter(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def outage(self, name: str, client: Any, exc: BaseException) -> None:
        """Server ``name`` did not answer: open its breaker, drop ``client``'s
        sockets (they reconnect after the pause), count and warn."""
        pause = self.breaker(name).failed()
        self.count("outages")
        self.count("errors")
        if client is not None:
            with contextlib.suppress(Exception):  # best effort on a broken pool
                client.connection_pool.disconnect()  # stale sockets: reconnect after the pause
        self.burst.warning(
            f"outage:{name}",
            "redis tier %s: %s %s (%s: %s); serving misses, retry in %.1fs",
            self.where, name, what_failed(exc), type(exc).__name__, self.redact(str(exc)),
            pause,
        )  # fmt: skip

    def missed_deadline(
        self, name: str, client: Any, seconds: float, late: int, threads: int
    ) -> str:
        """A round trip to server ``name`` got no complete answer within
        ``seconds`` (or was not made: all ``threads`` blocked past their
        deadline, ``late`` of them are): an outage, also counted as
        ``timeouts``. Returns what happened, in words."""
        self.count("timeouts")
        reason = (
            f"no complete answer within {seconds:.1f} s (connect_timeout + socket_timeout + "
            f"its bytes at the slowest transfer allowed); {late} of {threads} threads blocked"
        )
        self.outage(name, client, RedisTimeoutError(reason))
        return reason

    def command_error(self, op: str, exc: Exception) -> None:
        """The server refused an ``op`` command (a reply that is an error)."""
        self.count("command_errors")
        self.count("errors")
        self.burst.warning(f"cmd:{op}", "redis tier %s: %s refused: %s",
                           self.where, op.upper(), self.redact(str(exc)))  # fmt: skip

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {k: float(v) for k, v in self._counters.items()}
            out["breakers_open"] = float(sum(b.is_open for b in self._breakers.values()))
            out["writes_paused_servers"] = float(
                len({n for d in (self._write_pauses, self._write_stalls)
                     for n, b in d.items() if b.is_open})
            )  # fmt: skip
        return out

    def available(self) -> bool:
        """False while a server is skipped for its backoff (a breaker open, or its
        writes stalled after a timeout: puts are answered without asking it)."""
        with self._lock:
            return not any(
                b.is_open for d in (self._breakers, self._write_stalls) for b in d.values()
            )


def what_failed(exc: BaseException) -> str:
    """What an outage was, in words: refused credentials and failed TLS
    handshakes are not a server that does not answer."""
    causes: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in causes:  # Cluster errors wrap the node's error
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(c, AuthenticationError) for c in causes):
        return "refused this client's credentials (username, password)"
    text = " ".join(str(c) for c in causes)
    if "SSL" in text or "certificate" in text:
        return "failed the TLS handshake (certificate, tls_ca_file, tls_verify)"
    if not isinstance(exc, OUTAGE):
        return "gave an answer this client cannot use (not a Redis server, or a broken one?)"
    return "is not answering"
