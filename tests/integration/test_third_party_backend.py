"""A third-party backend, for real: ``examples/kvsdk-backend-example`` (the ``sqlite``
backend in its own distribution) is pip-installed into this environment, found
through the ``kvsdk`` entry point, configured by name in YAML, used as the slower
tier of a tiered store, and passes the public conformance suite."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis_server import missing_tool

from kvsdk import plugins_manager
from kvsdk.backend import Backend, TierContext
from kvsdk.config import ConfigError, KVSDKConfig, load_config
from kvsdk.events import EventKind
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.store.factory import build_store
from kvsdk.store.tiered import TieredStore
from kvsdk.testing import run_backend_conformance
from kvsdk.types import ChunkKey, LookupResult

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvsdk-backend-example"
DIST = "kvsdk-backend-sqlite"
PACKAGE = "kvsdk_sqlite"
ENTRY_POINT = ("sqlite", "kvsdk_sqlite.plugin")
CHUNK = 4096
TIMEOUT_S = 10.0


def _installed_matches_source() -> bool:
    """The distribution is installed (not editable), with this entry point and
    exactly the source files of the example: nothing to reinstall."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    if [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "kvsdk"] != [ENTRY_POINT]:
        return False
    installed = {f.as_posix(): f for f in dist.files or () if f.parts[0] == PACKAGE}
    sources = [
        p
        for p in (EXAMPLE / "src" / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    for src in sources:
        rel = src.relative_to(EXAMPLE / "src").as_posix()
        if rel not in installed:
            return False
        if Path(str(dist.locate_file(installed[rel]))).read_bytes() != src.read_bytes():
            return False
    return bool(sources)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``pip install`` the example (a copy, so no build files land in the repo);
    skipped when the installed copy already matches the source."""
    if not _installed_matches_source():
        copy = tmp_path_factory.mktemp("example") / EXAMPLE.name
        shutil.copytree(
            EXAMPLE,
            copy,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*cache"),
        )
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", str(copy)]
        if importlib.util.find_spec("setuptools") is not None:
            cmd[4:4] = ["--no-build-isolation", "--no-index"]  # offline, and faster
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if res.returncode != 0:
            pytest.fail(f"pip install of {EXAMPLE.name} failed:\n{res.stdout}\n{res.stderr}")
        assert _installed_matches_source(), "pip install finished but the installed copy differs"
    importlib.invalidate_caches()  # the new package's directory was not on disk at start
    plugins_manager.plugin_manager.cache_clear()  # plugins are loaded once per process


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    kvsdk = Path(sys.executable).parent / "kvsdk"
    if not kvsdk.exists():
        missing_tool("the kvsdk console script is not installed next to this interpreter")
    return subprocess.run([str(kvsdk), *args], capture_output=True, text=True, timeout=120)


def _config_yaml(db: Path) -> str:
    return (
        "chunk_tokens: 16\n"
        "tiers:\n"
        "  - {backend: cpu, capacity: 64MiB, pin_memory: never}\n"
        f"  - {{backend: sqlite, path: '{db}', capacity: 32MiB}}\n"
    )


def test_kvsdk_plugins_lists_it_with_its_distribution_and_hook(installed: None) -> None:
    res = _cli("plugins")
    assert res.returncode == 0, res.stderr
    assert re.search(r"^sqlite\s+kvsdk-backend-sqlite\s+kvsdk_backends$", res.stdout, re.M), (
        res.stdout
    )
    (backends_line,) = [line for line in res.stdout.splitlines() if line.startswith("backends:")]
    assert "sqlite" in backends_line.split(maxsplit=1)[1].split(", ")


def test_the_plugin_manager_finds_it_after_the_cache_is_cleared(installed: None) -> None:
    cls = plugins_manager.backends()["sqlite"]
    assert cls.__module__ == "kvsdk_sqlite.backend"
    info = {p.name: p for p in plugins_manager.list_plugins()}["sqlite"]
    assert (info.source, info.hooks) == (DIST, ("kvsdk_backends",))


def test_yaml_naming_it_passes_config_check_and_builds(installed: None, tmp_path: Path) -> None:
    file = tmp_path / "kvsdk.yaml"
    file.write_text(_config_yaml(tmp_path / "kv.db"))
    res = _cli("config", "check", str(file))
    assert res.returncode == 0, res.stderr
    assert "OK (tiers: cpu, sqlite;" in res.stdout
    cfg = load_config(file)
    options = cfg.tiers[1].options
    assert (cfg.tiers[1].backend, type(options).__name__) == ("sqlite", "SQLiteOptions")
    assert (options.path, options.capacity) == (str(tmp_path / "kv.db"), 32 << 20)


def test_a_bad_option_of_it_is_a_config_error_naming_the_key(
    installed: None, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.capacity: got 'lots'; expected a size"):
        load_config(_config_yaml(tmp_path / "kv.db").replace("32MiB", "lots"))


# -- as the lower tier of a tiered store -------------------------------------------------------


def _namespace() -> Namespace:
    return Namespace(
        model="third-party-test",
        dtype="uint8",
        groups=(GroupLayout(shape=(CHUNK,), dtype="|u1"),),
        tokens_per_chunk=16,
    )


def _key(i: int) -> ChunkKey:
    return i.to_bytes(16, "little")


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def _pump(store: TieredStore) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while store.has_pending_work():
        assert time.monotonic() < deadline, "I/O did not finish"
        store.step()
        time.sleep(0.001)
    store.step()


@contextlib.contextmanager
def _store(cfg: KVSDKConfig) -> Iterator[TieredStore]:
    store = build_store(cfg, _namespace(), CHUNK)
    try:
        yield store
    finally:
        store.shutdown()


def test_tiered_store_writes_through_to_it_and_promotes_from_it(
    installed: None, tmp_path: Path
) -> None:
    cfg = load_config(_config_yaml(tmp_path / "kv.db"))
    keys = [_key(i) for i in range(5)]
    with _store(cfg) as first:
        plan = first.prepare_store(keys)
        assert plan is not None and plan.keys == tuple(keys)
        slab = first.host.slab.numpy()
        for k, slot in zip(plan.keys, plan.slots):
            slab[slot] = np.frombuffer(_payload(k[0]), dtype=np.uint8)
        first.complete_store(plan.keys)
        _pump(first)
        (lower,) = first.lower
        assert type(lower).__name__ == "SQLiteBackend"
        assert lower.exists(keys) == [True] * 5
        stored = [e for e in first.events.take_events() if e.kind is EventKind.STORED]
        assert [(e.tier, e.keys) for e in stored] == [(0, tuple(keys)), (1, tuple(keys))]
    with _store(cfg) as second:  # a fresh host tier: only the sqlite file has the chunks
        assert second.lookup(keys[2]) is LookupResult.RETRY
        assert second.lookup(_key(99)) is LookupResult.RETRY
        _pump(second)
        assert second.lookup(keys[2]) is LookupResult.HIT
        assert second.lookup(_key(99)) is LookupResult.MISS
        (slot,) = second.prepare_load([keys[2]])
        assert bytes(second.host.slab.numpy()[slot]) == _payload(2)
        second.complete_load([keys[2]])
        assert second.metrics.counter("kvsdk_loaded_bytes_total", tier=1) == CHUNK


# -- the conformance suite ---------------------------------------------------------------------


class _RawRows:
    """The stored frame of a key, through a connection of its own."""

    def _connect(self, backend: Backend) -> sqlite3.Connection:
        return sqlite3.connect(backend.options.path)  # type: ignore[attr-defined]

    def read_raw(self, backend: Backend, key: ChunkKey) -> bytes | None:
        with contextlib.closing(self._connect(backend)) as conn:
            row = conn.execute(
                "SELECT frame FROM kvsdk_chunks WHERE ns = ? AND key = ?",
                (backend.namespace_fp, key),  # type: ignore[attr-defined]
            ).fetchone()
        return None if row is None else bytes(row[0])

    def write_raw(self, backend: Backend, key: ChunkKey, data: bytes) -> None:
        with contextlib.closing(self._connect(backend)) as conn, conn:
            conn.execute(
                "INSERT INTO kvsdk_chunks (ns, key, frame, size, used) VALUES (?, ?, ?, ?, 0) "
                "ON CONFLICT (ns, key) DO UPDATE SET frame = excluded.frame, size = excluded.size",
                (backend.namespace_fp, key, data, len(data)),  # type: ignore[attr-defined]
            )


def test_it_passes_the_conformance_suite_as_kvsdk_builds_it(
    installed: None, tmp_path: Path
) -> None:
    cfg = load_config(_config_yaml(tmp_path / "kv.db"))
    cls: Any = plugins_manager.backends()[cfg.tiers[1].backend]

    def make(ctx: TierContext) -> Backend:
        backend: Backend = cls(cfg.tiers[1].options, ctx)
        return backend

    report = run_backend_conformance(make, persistent=True, shared=True, raw=_RawRows())
    assert report.backend == "SQLiteBackend"
    assert report.skipped == {}  # get_into and put_parts: the base class's copies
    assert {"get_into", "scatter_gather", "corrupt_entries_are_misses"} <= set(report.passed)


def test_its_own_test_suite_passes_where_it_is_installed(installed: None) -> None:
    """What the vendor runs: the example's tests (conformance included), against
    the package installed (so its entry-point test runs too)."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests"],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "package not installed" not in res.stdout, res.stdout[-2000:]
