"""The redis tier against a hostile server (a fake speaking just enough RESP):
one that drips its reply a byte at a time, or answers the handshake with
garbage. Each call is a counted failure within its deadline that opens the
breaker; nothing raises out of ``get``/``put``/``exists``/``delete``."""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, BinaryIO

import pytest
import redis

from kvsdk.backend import BackendError, TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.integration

NS = hashlib.blake2b(b"model-a", digest_size=16).digest().hex()
CHUNK = 4096


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def tier(url: str, **options: Any) -> RedisBackend:
    ctx = TierContext(namespace_fp=bytes.fromhex(NS), namespace_hex=NS, chunk_bytes=CHUNK)
    return RedisBackend(RedisOptions(url=url, **options), ctx)


def _read_command(f: BinaryIO) -> list[bytes] | None:
    """One RESP command (an array of bulk strings), or None at the end."""
    head = f.readline()
    if not head.startswith(b"*"):
        return None
    args = []
    for _ in range(int(head[1:])):
        size = int(f.readline()[1:])
        args.append(f.read(size + 2)[:-2])
    return args


class FakeRedis:
    """A TCP server speaking just enough RESP for redis-py: ``hello`` is its
    answer to the handshake's ``HELLO``; any other command (after ``CLIENT
    SETINFO``, answered ``+OK``) is answered with ``reply`` one byte every
    ``interval`` s, for at most ``give_up`` s. ``client_gone`` is set once a
    client closes a connection the server was dripping into."""

    HELLO = b"%1\r\n+proto\r\n:3\r\n"

    def __init__(
        self,
        hello: bytes = HELLO,
        reply: bytes = b"+" + b"z" * 4096 + b"\r\n",
        interval: float = 0.4,
        give_up: float = 6.0,
    ) -> None:
        self.hello, self.reply, self.interval, self.give_up = hello, reply, interval, give_up
        self.client_gone = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._sock.getsockname()[1]}/0"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f, contextlib.suppress(OSError, ValueError):
            while (cmd := _read_command(f)) is not None:
                name = cmd[0].upper()
                if name == b"HELLO":
                    conn.sendall(self.hello)
                elif name == b"CLIENT":
                    conn.sendall(b"+OK\r\n")
                else:
                    self._drip(conn)
                    return

    def _drip(self, conn: socket.socket) -> None:
        end = time.monotonic() + self.give_up
        for byte in self.reply:
            if time.monotonic() > end or self._stop.is_set():
                return
            readable, _, _ = select.select([conn], [], [], self.interval)
            if readable and not conn.recv(65536, socket.MSG_PEEK):
                self.client_gone.set()
                return
            if readable:
                conn.recv(65536)  # the rest of the pipeline
            conn.sendall(bytes([byte]))

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self._stop.set()
        self._sock.close()


OPS: dict[str, tuple[Callable[[RedisBackend], object], object]] = {
    "get": (lambda b: b.get([key(1)]), [None]),
    "put": (lambda b: b.put([(key(1), b"v" * 100)]), [False]),
    "exists": (lambda b: b.exists([key(1)]), [False]),
    "delete": (lambda b: b.delete([key(1)]), 0),
}
SLOW = {"socket_timeout": 1.0, "connect_timeout": 0.5, "backoff_initial": 5.0, "backoff_max": 5.0}
DEADLINE_S = SLOW["socket_timeout"] + SLOW["connect_timeout"] + 0.1
"""A round trip's deadline here (the transfer allowance of one 4 KiB frame is
well under 0.1 s)."""


@pytest.mark.parametrize("op", list(OPS))
def test_a_dripped_reply_is_a_counted_failure_within_the_call_deadline(op: str) -> None:
    call, miss = OPS[op]
    with FakeRedis() as server:
        b = tier(server.url, **SLOW)
        start = time.monotonic()
        assert call(b) == miss
        took = time.monotonic() - start
        assert took < DEADLINE_S + 0.5, f"{op} held its thread {took:.1f} s"
        s = b.stats()
        assert s["timeouts"] == 1 and s["errors"] == 1 and not b.available()
        assert server.client_gone.wait(2.0), "the connection holding the drip was kept"
        start = time.monotonic()
        assert call(b) == miss  # the breaker is open: no round trip at all
        assert time.monotonic() - start < 0.2
        b.close()


GARBAGE = {
    "integer": b":1\r\n",
    "array": b"*1\r\n:1\r\n",
    "nil": b"_\r\n",
    "bulk": b"$3\r\nabc\r\n",
    "not-resp": b"garbage\r\n",
    "error": b"-ERR no\r\n",
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("op", list(OPS))
def test_a_garbage_handshake_reply_is_a_counted_failure_that_opens_the_breaker(
    op: str, garbage: str
) -> None:
    call, miss = OPS[op]
    with FakeRedis(hello=GARBAGE[garbage]) as server:
        b = tier(server.url, **SLOW)
        assert call(b) == miss
        s = b.stats()
        assert s["errors"] == 1 and s["outages"] == 1 and not b.available()
        b.close()


def test_clear_of_a_server_answering_garbage_is_a_backend_error() -> None:
    with FakeRedis(hello=GARBAGE["integer"]) as server:
        b = tier(server.url, **SLOW)
        with pytest.raises(BackendError, match="redis tier"):
            b.clear()
        with pytest.raises(BackendError, match="redis tier"):
            list(b.iter_keys())
        assert not b.available()
        b.close()


@pytest.mark.parametrize("admin", ["inventory", "wipe"])
def test_inspect_and_clear_of_a_dripping_server_give_up_within_the_deadline(admin: str) -> None:
    with FakeRedis() as server:
        options = RedisOptions(url=server.url, **SLOW)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no complete answer within"):
            getattr(RedisBackend, admin)(options)
        took = time.monotonic() - start
        assert took < DEADLINE_S + 0.5, f"{admin} took {took:.1f} s"


@pytest.mark.parametrize("admin", ["inventory", "wipe"])
def test_inspect_and_clear_of_a_server_answering_garbage_raise_a_redis_error(admin: str) -> None:
    with FakeRedis(hello=GARBAGE["integer"]) as server, pytest.raises(redis.RedisError):
        getattr(RedisBackend, admin)(RedisOptions(url=server.url, **SLOW))
