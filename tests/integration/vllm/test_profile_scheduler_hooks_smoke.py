"""Smoke run of ``benchmarks/profile_scheduler_hooks.py`` at a tiny size: vLLM's
real Scheduler steps kvsdk's and the native connector through the same trace
(two waves: the second loads its prefixes from the connector), with the
caches evicted between steps. The figures are noise at this size; checked is
that both connectors loaded alike, that their hooks were timed, and that every
step is counted once in the split between steps looking requests up and the others,
at two output lengths, written to JSON and a plot."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401  (missing: a failure, never a skip; scripts/setup.sh vllm)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "profile_scheduler_hooks.py"


def test_profile_scheduler_hooks_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--waves", "2", "--requests", "4", "--evict-mib", "1"]
    cmd += ["--max-tokens", "2,16", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    runs = re.findall(
        r"^(kvsdk|native): 2 waves x 4 requests, (\d+) output tokens each, (\d+) steps, "
        r"(\d+) load jobs: scheduler-side hooks (\d+) us/step",
        out,
        re.M,
    )
    assert [(r[0], r[1]) for r in runs] == [
        ("kvsdk", "2"),
        ("native", "2"),
        ("kvsdk", "16"),
        ("native", "16"),
    ], out
    steps = [int(r[2]) for r in runs]
    for _, _, _, loads, us in runs:
        assert int(loads) == 4  # wave 2: each request's prefix from the connector
        assert int(us) > 0
    assert steps[2] > steps[0] + 10 and steps[3] > steps[1] + 10  # 14 more tokens: more steps
    looking_up = [int(n) for n in re.findall(r"^  steps looking requests up: (\d+),", out, re.M)]
    other = [int(n) for n in re.findall(r"^  other steps: (\d+),", out, re.M)]
    assert [a + o for a, o in zip(looking_up, other, strict=True)] == steps
    for n in (2, 16):
        assert re.search(
            rf"^kvsdk/native scheduler-side CPU at {n} output tokens, per step: [\d.]+x;", out, re.M
        ), out
    doc = json.loads((tmp_path / "profile_scheduler_hooks.json").read_text())
    assert [row["max_tokens"] for row in doc["rows"]] == [2, 16]
    assert [row["steps"] for row in doc["rows"]] == [
        {"kvsdk": [steps[0]], "native": [steps[1]]},
        {"kvsdk": [steps[2]], "native": [steps[3]]},
    ]
    assert all(len(row["kvsdk_over_native"]["per_step"]) == 1 for row in doc["rows"])
    assert (tmp_path / "profile_scheduler_hooks.png").stat().st_size > 1000
