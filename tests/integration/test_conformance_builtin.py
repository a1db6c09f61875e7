"""kvsdk's own slow-tier backends pass the public conformance suite (``kvsdk.testing``),
the same checks a third-party backend runs: disk on a temporary directory, redis
on a real ``redis-server``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from redis_server import (  # noqa: F401  (fixtures)
    RedisServer,
    needs_redis,
    redis_server_fixture,
    redis_tools_fixture,
)

from kvsdk.backend import Backend, Buffer, TierContext
from kvsdk.backends.disk import DiskBackend, DiskOptions
from kvsdk.backends.redis import RedisBackend, RedisOptions
from kvsdk.testing import BackendConformance, BackendFactory, run_backend_conformance
from kvsdk.types import ChunkKey

pytestmark = pytest.mark.integration


class DiskRaw:
    """The disk tier's file for a key (one chunk_format frame per file)."""

    def _file(self, backend: Backend, key: ChunkKey) -> Path:
        assert isinstance(backend, DiskBackend)
        return Path(backend._path(key))

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        path = self._file(backend, key)
        return path.read_bytes() if path.exists() else None

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        self._file(backend, key).write_bytes(data)


class RedisRaw:
    """The redis tier's value for a key, read and written with a plain client."""

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        assert isinstance(backend, RedisBackend)
        with redis.Redis.from_url(backend.options.url) as client:
            value = client.get(backend._rkey(key))
        assert value is None or isinstance(value, bytes)
        return value

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        assert isinstance(backend, RedisBackend)
        with redis.Redis.from_url(backend.options.url) as client:
            client.set(backend._rkey(key), data)


def disk_factory(path: Path) -> BackendFactory:
    return lambda ctx: DiskBackend(DiskOptions(path=str(path), capacity=64 << 20, shards=4), ctx)


def redis_factory(url: str) -> BackendFactory:
    def make(ctx: TierContext) -> Backend:
        return RedisBackend(RedisOptions(url=url, socket_timeout=2.0), ctx)

    return make


class TestDiskConformance(BackendConformance):
    persistent = True
    shared = True
    raw = DiskRaw()

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return disk_factory(tmp_path / "cache")


@needs_redis
class TestRedisConformance(BackendConformance):
    persistent = True  # the server keeps entries after a client closes
    shared = True
    raw = RedisRaw()

    @pytest.fixture
    def backend_factory(self, redis_server: RedisServer) -> Iterator[BackendFactory]:
        yield redis_factory(redis_server.url)


def test_disk_passes_the_whole_suite_as_one_call(tmp_path: Path) -> None:
    report = run_backend_conformance(
        disk_factory(tmp_path / "cache"), persistent=True, shared=True, raw=DiskRaw()
    )
    assert report.backend == "DiskBackend"
    assert report.skipped == {}
    assert "corrupt_entries_are_misses" in report.passed


def test_suite_reports_a_backend_that_breaks_the_contract(tmp_path: Path) -> None:
    """A disk tier whose get() ignores duplicates fails with the check named."""

    class DedupingDisk(DiskBackend):
        def get(self, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
            return super().get(list(dict.fromkeys(keys)))

    def make(ctx: TierContext) -> Backend:
        return DedupingDisk(DiskOptions(path=str(tmp_path / "bad"), shards=1), ctx)

    with pytest.raises(AssertionError, match=r"batch_order_and_duplicates: get\(\)"):
        run_backend_conformance(make, persistent=False, shared=False)


def test_suite_catches_a_capability_the_backend_does_not_have(tmp_path: Path) -> None:
    """A tier declaring scatter/gather I/O while keeping the base class's copies fails."""

    class Boasting(DiskBackend):
        put_parts = Backend.put_parts
        get_into_parts = Backend.get_into_parts

    def make(ctx: TierContext) -> Backend:
        return Boasting(DiskOptions(path=str(tmp_path / "boast"), shards=1), ctx)

    with pytest.raises(AssertionError, match=r"scatter_gather: Boasting.supports_scatter_gather"):
        run_backend_conformance(make, persistent=False, shared=False, checks=["scatter_gather"])
