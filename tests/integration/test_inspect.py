"""``kvsdk inspect``: what a config's tiers hold, per namespace, from outside the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from redis_server import RedisServer, redis_server_fixture  # noqa: F401  (fixture)

from kvsdk.config import load_config
from kvsdk.keys import FORMAT_VERSION, GroupLayout, Namespace
from kvsdk.store.factory import build_store

CHUNK = 4096


def fill(cfg_path: Path, model: str, n: int) -> None:
    ns = Namespace(model, "uint8", (GroupLayout((CHUNK,), "uint8"),), 16)
    store = build_store(load_config(cfg_path), ns, CHUNK)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    plan = store.prepare_store(keys)
    assert plan is not None
    store.complete_store(plan.keys)
    deadline = time.monotonic() + 30
    while store.has_pending_work() and time.monotonic() < deadline:
        store.step()
        time.sleep(0.005)
    store.shutdown()


def test_inspect_lists_chunks_per_namespace_on_disk_and_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"backend": "cpu", "capacity": "1MiB"},
                    {"backend": "disk", "path": str(tmp_path / "disk")},
                    {"backend": "redis", "url": redis_server.url},
                ]
            }
        )
    )
    fill(cfg, "model-a", 5)
    fill(cfg, "model-b", 3)
    out = subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", "inspect", str(cfg), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    assert [t["backend"] for t in report] == ["cpu", "disk", "redis"]
    for tier in report[1:]:
        assert sorted(row["entries"] for row in tier["namespaces"]) == [3, 5]
        assert all(row["bytes"] >= row["entries"] * CHUNK for row in tier["namespaces"])
    assert report[1]["namespaces"][0]["format_version"] == FORMAT_VERSION
    text = subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", "inspect", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "tier 1: disk (disk, node)" in text and "5 chunks" in text


def test_inspect_exits_1_naming_an_unreachable_tier(tmp_path: Path) -> None:
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"tiers": [{"backend": "cpu"}, {"backend": "redis", "url": "redis://127.0.0.1:1/0"}]}
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", "inspect", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "unreachable" in out.stdout  # the other tiers are still listed
    assert f"{cfg}: tiers[1] (redis): ConnectionError" in out.stderr


def test_inspect_exits_1_naming_a_disk_path_that_cannot_be_created(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    cfg = tmp_path / "kvsdk.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"backend": "cpu"},
                    {"backend": "disk", "path": str(not_a_dir / "kvsdk")},
                    {"backend": "disk", "path": str(tmp_path / "not-yet" / "kvsdk")},
                ]
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvsdk.cli", "inspect", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert f"tiers[1] (disk): path '{not_a_dir / 'kvsdk'}' cannot be created" in out.stderr
    assert "tiers[2]" not in out.stderr  # a directory created at the first start is fine
