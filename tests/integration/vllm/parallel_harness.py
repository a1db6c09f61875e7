"""Helpers for the tests that run ``tier_scenarios.py`` engines under vLLM's
default executor: start an engine in a process group of its own, wait for its
results, kill the whole group (``kill -9``: EngineCore and workers too), check
the engine's shared host segment (nameless while it runs, nothing left once it
is gone), and prepare a slower tier for a restarted engine (remove or rewrite
frames).

Not a test module; ``test_vllm_tiers.py`` and ``test_vllm_parallel.py`` import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from engine_segments import segment_holders, segment_snapshot  # noqa: E402

MODEL = "tiny-llama"
"""Every engine loads the model by this relative name from its own working
directory, so the model's name is the same for all of them and only its
weights can tell two models apart."""
PROMPT_TOKENS = 192
"""Each prompt has 200 tokens: six full 32-token chunks."""
CHUNKS = PROMPT_TOKENS // 32
CHUNK_BYTES = 131072
"""One host slot of the tiny Llama (4 layers x 2 KV heads x 64 x K,V x 32 tokens
x float32), split into rank regions under TP/PP but the same size in all."""
ENGINE_TIMEOUT_S = 400


def kvsdk_config(*lower: dict[str, Any], host: str = "64MiB") -> dict[str, Any]:
    """32-token chunks and no prompt tail: these tests compare kvsdk's whole
    chunks, through every tier and process layout, with vLLM's own prefix cache
    (which stops at the last whole block); the tail, kvsdk's default, is tested
    under the defaults in test_vllm_connector.py and test_openai_server.py."""
    return {
        "chunk_tokens": 32,
        "prompt_tail": False,
        "tiers": [{"backend": "cpu", "capacity": host}, *lower],
    }


def disk_tier(path: Path) -> dict[str, Any]:
    return {"backend": "disk", "path": str(path), "capacity": "256MiB"}


def redis_tier(url: str) -> dict[str, Any]:
    # generous timeouts: on a 2-CPU machine the engine's busy processes can keep
    # redis-server from answering within the default second, and a write-through
    # that times out is dropped (best effort), which is not what these tests test
    return {"backend": "redis", "url": url, "socket_timeout": 120.0, "connect_timeout": 120.0}


def diagnose(run: dict[str, Any]) -> str:
    """kvsdk's counters and the warnings its tiers logged, for an assertion message."""
    lines = [
        ln
        for ln in run.get("log", "").splitlines()
        if ("kvsdk" in ln and ("WARNING" in ln or "ERROR" in ln))
        or (" tier " in ln and ("not answering" in ln or "failed" in ln))
    ]
    return f"counters {run.get('counters')}; kvsdk warnings: {lines[-20:]}"


FORCE_KILLED = "force killing remaining process EngineCore"
"""vLLM's client log line when it SIGKILLs the EngineCore after its 5 s grace."""


def check_running_segment(run: dict[str, Any], workers: int, snap: dict[str, Any]) -> None:
    """A running engine's host segment (``snap``: ``engine_segments.segment_snapshot``):
    once its ``workers`` attached (the log says so) it has no name in /dev/shm;
    it is the only kvsdk segment open among the engine's processes, private
    to the user, and held by the EngineCore and each worker, by nothing else."""
    name = run["segment"]
    assert f"kvsdk: {workers} worker(s) attached to {name}" in run["log"]
    assert snap["named"] == [], f"{snap['named']} still in /dev/shm while the engine runs"
    assert snap["open"] == [name], snap
    assert snap["modes"] == ["0o600"], snap
    assert snap["holders"] == workers + 1 and snap["outside"] == 0, snap


def check_nothing_left(run: dict[str, Any], after: dict[str, Any]) -> None:
    """Once an engine is gone (``after``: ``Engine.after_exit()``), however it
    ended: its segment has no name in /dev/shm and no process holds it."""
    assert after["group"] == {}, f"engine processes left: {after['group']}"
    assert after["named"] is False, f"/dev/shm/{run['segment']} outlived the engine"
    assert after["holders"] == {}, f"{run['segment']} still held: {after['holders']}"


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Greedy tokens and logprobs (``float.hex``) equal, bit for bit."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


class Engine:
    """One ``tier_scenarios.py`` run: its own session (process group), so its
    EngineCore and worker processes can be killed with it."""

    def __init__(
        self,
        name: str,
        out_dir: Path,
        cwd: Path,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.out = out_dir / f"{name}.json"
        self.log_path = out_dir / f"{name}.log"
        self.spec = spec
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "tier_scenarios.py"), MODEL, str(self.out),
                 json.dumps(spec)],
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )  # fmt: skip

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait(self, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """The run's results, or ``{"error": ...}`` with the end of its log."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            return {"error": f"{self.name}: no exit within {timeout} s\n{self.log_tail()}"}
        if self.proc.returncode != 0:
            return {"error": f"{self.name}: exit {self.proc.returncode}\n{self.log_tail()}"}
        res: dict[str, Any] = json.loads(self.out.read_text())
        res["log"] = self.log_path.read_text(errors="replace")
        return res

    def wait_held(self, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """For a ``hold`` run: its results once it is ready to be killed (still running)."""
        ready = Path(self.spec["hold"])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                return {"error": f"{self.name}: exit {self.proc.returncode}\n{self.log_tail()}"}
            if time.monotonic() > deadline:
                self.kill_group()
                return {"error": f"{self.name}: not ready within {timeout} s\n{self.log_tail()}"}
            time.sleep(0.2)
        res: dict[str, Any] = json.loads(self.out.read_text())
        res["log"] = self.log_path.read_text(errors="replace")
        return res

    def group(self) -> dict[int, str]:
        """The processes of this run's group: pid -> command line."""
        return group_processes(self.proc.pid)

    def running_segment(self) -> dict[str, Any]:
        """This (held, running) engine's segment as seen from the test process."""
        from kvsdk.slab import segment_name

        return segment_snapshot(segment_name(self.spec["engine_id"]), self.proc.pid)

    def after_exit(self, timeout: float = 30) -> dict[str, Any]:
        """Once the run's client exited (or was killed): its group's processes
        left after at most ``timeout`` s, then whether its segment still has a
        name in /dev/shm and which processes still hold it."""
        from kvsdk.slab import segment_name

        deadline = time.monotonic() + timeout
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.1)
        name = segment_name(self.spec["engine_id"])
        return {
            "group": self.group(),
            "named": segment_path(name).exists(),
            "holders": segment_holders(name),
        }

    def cleanup(self) -> None:
        """At the end of a module: no process of this run left, nor its segment
        (a test that found it left behind has failed already)."""
        if self.group():
            self.kill_group()
        from kvsdk.slab import segment_name

        segment_path(segment_name(self.spec["engine_id"])).unlink(missing_ok=True)

    def kill_group(self) -> None:
        """``kill -9`` every process of the group, and wait until none is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while group_processes(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


SLOW_WORKER_EXIT = """\
# Written by tests/integration/vllm/parallel_harness.py; imported at start-up by
# every process of the engine (vLLM-CPU spawns them, so this is the only way in).
# kvsdk's worker-side shutdown (the CPU transfer worker's) takes
# KVSDK_TEST_SLOW_WORKER_EXIT_S seconds more, as vLLM-CPU's own TP=2 / PP=2
# workers often take more than vLLM's 5 s to exit on a 2-CPU machine.
import importlib.abc
import importlib.util
import os
import sys
import time

_DELAY = float(os.environ.get("KVSDK_TEST_SLOW_WORKER_EXIT_S", "0"))


class _SlowWorkerExit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvsdk.transfer.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            shutdown = module.CPUTransferWorker.shutdown

            def slow_shutdown(self):
                time.sleep(_DELAY)
                shutdown(self)

            module.CPUTransferWorker.shutdown = slow_shutdown

        spec.loader.exec_module = exec_module
        return spec


if _DELAY:
    sys.meta_path.insert(0, _SlowWorkerExit())
"""


def slow_worker_exit_env(tmp: Path, seconds: float) -> dict[str, str]:
    """Environment for an engine whose workers take ``seconds`` more to exit."""
    site = tmp / "slow-worker-exit"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_WORKER_EXIT)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KVSDK_TEST_SLOW_WORKER_EXIT_S": str(seconds)}


def group_processes(pgid: int) -> dict[int, str]:
    """Live (not zombie) processes in process group ``pgid``: pid -> command line."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out[int(entry.name)] = cmd.strip()
    return out


def segment_path(name: str) -> Path:
    from kvsdk.slab import SHM_DIR

    return SHM_DIR / name


# -- slower tiers: what a writer left behind, and how a test changes it -------------------
def disk_files(root: Path) -> dict[str, Path]:
    """Chunk key (hex) -> frame file, over every namespace under ``root``."""
    return {p.stem: p for p in root.rglob("*.kvc")}


def redis_keys(url: str) -> dict[str, bytes]:
    """Chunk key (hex) -> Redis key, of every ``kvsdk:*`` key in the url's database."""
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    try:
        return {k.decode().rsplit(":", 1)[1]: k for k in client.scan_iter("kvsdk:*")}
    finally:
        client.close()


def delete_redis_keys(url: str, keys: list[bytes]) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    try:
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def rewrite_with_noise(path: Path, seed: int) -> None:
    """Replace a disk frame's payload with noise (plausible float32 values, the
    KV's dtype) under a *valid* frame: same namespace, key, dtype and shape,
    checksum recomputed with kvsdk's own frame code. kvsdk's verification
    accepts it; only the comparison of the outputs can tell."""
    from kvsdk.chunk_format import decode_chunk, encode_chunk, parse_header

    raw = path.read_bytes()
    header = parse_header(raw)
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(header.length // 4, dtype=np.float32).tobytes()
    assert len(noise) == header.length
    frame = encode_chunk(
        header.namespace_fp,
        header.key,
        noise,
        header.dtype,
        header.shape,
        checksum=header.checksum_algorithm,
    )
    # the frame is valid for kvsdk: its own decoder returns the noise
    assert bytes(decode_chunk(frame, namespace_fp=header.namespace_fp, key=header.key)) == noise
    assert bytes(decode_chunk(raw, namespace_fp=header.namespace_fp, key=header.key)) != noise
    tmp = path.with_name(path.name + ".noise")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(frame)
    os.replace(tmp, path)


def prepare_restart(
    writer: dict[str, Any], disk_dir: Path, redis_url: str | None
) -> dict[str, Any]:
    """After a writer served ``via_redis``, ``via_disk``, ``corrupted`` (and maybe
    ``flood``): returns each prompt's chunk keys per tier (``corrupted``'s are
    those of the writer's namespace left over: the writer did not wait for
    them, its exit had to land them), then makes the restarted engine's
    sources unambiguous:

    - ``via_redis``: its disk files are removed, so only Redis has it;
    - ``corrupted``: its disk frames are rewritten with noise under valid
      checksums, and its Redis keys removed, so only the noisy frames have it;
    - ``via_disk``: untouched (disk is asked before Redis).
    """
    all_files = disk_files(disk_dir)
    keys: dict[str, dict[str, list[str]]] = {n: dict(k) for n, k in writer["keys"].items()}
    (ns,) = {all_files[k].parent.parent.name for k in keys[writer["prompts"][0]]["disk"]}
    files = {k: p for k, p in all_files.items() if p.parent.parent.name == ns}
    rkeys = redis_keys(redis_url) if redis_url else {}
    redis_namespaces = sorted({k.decode().split(":")[1] for k in rkeys.values()})
    rkeys = {k: r for k, r in rkeys.items() if r.decode().split(":")[1] == ns}
    if "corrupted" not in keys:
        keys["corrupted"] = {
            "disk": sorted(set(files) - {k for n in keys.values() for k in n.get("disk", [])})
        }
        if redis_url:
            known = {k for n in keys.values() for k in n.get("redis", [])}
            keys["corrupted"]["redis"] = sorted(set(rkeys) - known)
    for key in keys.get("via_redis", {}).get("disk", []):
        files[key].unlink()
    for i, key in enumerate(keys["corrupted"]["disk"]):
        rewrite_with_noise(files[key], seed=i)
    removed = 0
    if redis_url:
        removed = delete_redis_keys(redis_url, [rkeys[k] for k in keys["corrupted"]["redis"]])
    return {
        "keys": keys,
        "namespace": ns,
        "disk_namespaces": sorted({p.parent.parent.name for p in all_files.values()}),
        "redis_namespaces": redis_namespaces,
        "disk_files_after_writer": len(files),
        "redis_keys_after_writer": len(rkeys),
        "redis_keys_removed": removed,
    }
