"""``kvsdk clear`` and ``kvsdk inspect`` of a redis tier that others write to.

- ``kvsdk clear --namespace`` takes a namespace's hex name only, and the tier
  matches it literally (never as a ``SCAN MATCH`` pattern); ``inventory`` and
  ``wipe`` act on each batch of keys as the scan finds it.
- A key under ``kvsdk:`` that is not one of kvsdk's entries (another type, a
  name that is not UTF-8 or not kvsdk's shape) is skipped and counted by
  ``kvsdk inspect``, never a reason to call the tier unreachable.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import redis
import yaml
from redis_server import (  # noqa: F401  (fixtures)
    REDIS_CLI,
    RedisServer,
    needs_redis,
    redis_server_fixture,
    redis_tools_fixture,
)

from kvsdk.backend import TierContext
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.cli import main

pytestmark = [pytest.mark.integration, needs_redis]

NS = hashlib.blake2b(b"model-a", digest_size=16).digest().hex()
NS_B = hashlib.blake2b(b"model-b", digest_size=16).digest().hex()
CHUNK = 4096


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def tier(url: str, ns: str = NS, **options: Any) -> RedisBackend:
    ctx = TierContext(namespace_fp=bytes.fromhex(ns), namespace_hex=ns, chunk_bytes=CHUNK)
    return RedisBackend(RedisOptions(url=url, **options), ctx)


def config(tmp_path: Path, url: str) -> Path:
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "redis", "url": url}]}
        )
    )
    return cfg


def plant(raw: redis.Redis, ns: str, n: int, start: int = 0) -> None:
    for i in range(start, start + n, 1000):
        raw.mset({f"kvsdk:{ns}:{j:032x}": b"x" for j in range(i, min(i + 1000, start + n))})


def count(raw: redis.Redis, ns: str) -> int:
    return sum(1 for _ in raw.scan_iter(match=f"kvsdk:{ns}:*", count=1000))


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# -- kvsdk clear --namespace ------------------------------------------------------------------


@pytest.mark.parametrize(
    "namespace",
    ["*", "", "kvsdk:*", "?" * 32, NS.upper(), NS[:-1] + "*", NS + ":*", NS[:-2]],
    ids=[
        "star",
        "empty",
        "prefix-star",
        "question-marks",
        "uppercase",
        "glob-tail",
        "colon",
        "short",
    ],
)
def test_clear_refuses_a_namespace_that_is_not_32_lowercase_hex_digits(
    tmp_path: Path,
    raw: redis.Redis,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    namespace: str,
) -> None:
    plant(raw, NS, 3)
    plant(raw, NS_B, 2)
    rc = main(["clear", str(config(tmp_path, redis_server.url)), "--namespace", namespace, "--yes"])
    out, err = capsys.readouterr()
    assert rc == 2, out
    assert out == "" and err.count("\n") == 1 and "--namespace" in err, err
    assert "Traceback" not in err and "32 lowercase hex digits" in err
    assert count(raw, NS) == 3 and count(raw, NS_B) == 2


def test_clear_of_one_namespace_deletes_its_keys_only(
    tmp_path: Path, raw: redis.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    plant(raw, NS, 3)
    plant(raw, NS_B, 2)
    assert main(["clear", str(config(tmp_path, redis_server.url)), "--namespace", NS, "--yes"]) == 0
    assert "tier 1: redis: 3 chunks deleted" in capsys.readouterr().out
    assert count(raw, NS) == 0 and count(raw, NS_B) == 2


def test_wipe_matches_the_namespace_literally_never_as_a_pattern(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    plant(raw, NS, 3)
    plant(raw, NS_B, 2)
    for name in (b"kvsdk:*:k", b"kvsdk:[ab]:k", b"kvsdk:a\\b:k", f"kvsdk:{NS}0:k".encode()):
        raw.set(name, b"x")
    opts = RedisOptions(url=redis_server.url)
    assert RedisBackend.wipe(opts, "*") == 1 and not raw.exists(b"kvsdk:*:k")
    assert RedisBackend.wipe(opts, "[ab]") == 1 and not raw.exists(b"kvsdk:[ab]:k")
    assert RedisBackend.wipe(opts, "a\\b") == 1 and not raw.exists(b"kvsdk:a\\b:k")
    assert RedisBackend.wipe(opts, NS[:-1] + "?") == 0
    assert RedisBackend.wipe(opts, NS) == 3
    assert count(raw, NS_B) == 2 and raw.exists(f"kvsdk:{NS}0:k")


class Monitor:
    """``redis-cli monitor`` on ``server``: the commands it ran, in order."""

    def __init__(self, server: RedisServer, out: Path) -> None:
        assert REDIS_CLI is not None
        self._server = server
        self._out = out
        self._file: BinaryIO = out.open("wb")
        self._proc = subprocess.Popen(
            [REDIS_CLI, "-p", str(server.port), "monitor"], stdout=self._file
        )
        self._wait_for("monitor-started")

    def _wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self._server.cli("ECHO", marker)
            if marker in self._out.read_text(errors="replace"):
                return
            time.sleep(0.05)
        raise AssertionError(f"redis-cli monitor never showed {marker}")

    def commands(self) -> list[str]:
        """The command names seen so far (upper case)."""
        self._wait_for(f"monitor-mark-{time.monotonic_ns()}")
        lines = self._out.read_text(errors="replace").splitlines()
        return [line.split('"')[1].upper() for line in lines if line.count('"') >= 2]

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._file.close()


def test_inventory_and_wipe_act_on_each_batch_while_the_scan_goes_on(
    tmp_path: Path, raw: redis.Redis, redis_server: RedisServer
) -> None:
    """Neither holds the keyspace in memory: the first STRLEN (inventory) and the
    first UNLINK (wipe) come before the scan's last page."""
    plant(raw, NS, 6000)
    opts = RedisOptions(url=redis_server.url)
    monitor = Monitor(redis_server, tmp_path / "monitor.txt")
    try:
        (row,) = RedisBackend.inventory(opts)
        assert row["entries"] == 6000
        seen = monitor.commands()
        scans = [i for i, c in enumerate(seen) if c == "SCAN"]
        assert len(scans) > 2 and seen.index("STRLEN") < scans[-1], (len(scans), scans[:3])
        start = len(seen)
        assert RedisBackend.wipe(opts, NS) == 6000
        seen = monitor.commands()[start:]
        scans = [i for i, c in enumerate(seen) if c == "SCAN"]
        assert len(scans) > 2 and seen.index("UNLINK") < scans[-1], (len(scans), scans[:3])
    finally:
        monitor.close()


# -- kvsdk inspect: foreign entries ----------------------------------------------------------


def test_inspect_skips_and_counts_foreign_entries_under_the_prefix(
    tmp_path: Path, raw: redis.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    b = tier(redis_server.url)
    assert b.put([(key(i), bytes([i]) * CHUNK) for i in range(3)]) == [True] * 3
    raw.rpush(f"kvsdk:{NS}:{'ab' * 16}", b"a list")  # another type, a kvsdk-shaped name
    raw.hset(f"kvsdk:{NS_B}:{'cd' * 16}", "field", "a hash")
    raw.set(b"kvsdk:\xff\xfe:\x80", b"a name that is not UTF-8")
    raw.set(b"kvsdk:not-a-namespace", b"a name of another shape")
    cfg = config(tmp_path, redis_server.url)

    assert main(["inspect", str(cfg), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)[1]
    assert err == "" and report["error"] is None
    assert report["foreign_entries"] == 4
    ((row),) = report["namespaces"]
    assert row["namespace"] == NS and row["entries"] == 3 and row["bytes"] > 3 * CHUNK

    assert main(["inspect", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"namespace {NS}: 3 chunks" in out and "4 foreign entries" in out
    assert "unreachable" not in out
