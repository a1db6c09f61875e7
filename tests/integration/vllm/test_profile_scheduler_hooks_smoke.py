"""Smoke run of ``benchmarks/profile_scheduler_hooks.py`` at a tiny size: vLLM's
real Scheduler steps kvsdk's and the native connector through the same trace
(two waves: the second loads its prefixes from the connector), with the
caches evicted between steps. The figures are noise at this size; checked is
that both connectors loaded alike, that their hooks were timed, and that every
step is counted once in the split between steps looking requests up and the others."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "profile_scheduler_hooks.py"


def test_profile_scheduler_hooks_smoke() -> None:
    cmd = [sys.executable, str(SCRIPT), "--waves", "2", "--requests", "4", "--evict-mib", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    runs = re.findall(
        r"^(kvsdk|native): 2 waves x 4 requests, (\d+) steps, (\d+) load jobs: "
        r"scheduler-side hooks (\d+) us/step",
        out,
        re.M,
    )
    assert [r[0] for r in runs] == ["kvsdk", "native"], out
    (_, k_steps, k_loads, k_us), (_, n_steps, n_loads, n_us) = runs
    assert int(k_loads) == int(n_loads) == 4  # wave 2: each request's prefix from the connector
    assert int(k_us) > 0 and int(n_us) > 0
    looking_up = [int(n) for n in re.findall(r"^  steps looking requests up: (\d+),", out, re.M)]
    other = [int(n) for n in re.findall(r"^  other steps: (\d+),", out, re.M)]
    assert [a + o for a, o in zip(looking_up, other, strict=True)] == [int(k_steps), int(n_steps)]
    assert re.search(r"^kvsdk/native scheduler-side CPU, per step: [\d.]+x;", out, re.M), out
