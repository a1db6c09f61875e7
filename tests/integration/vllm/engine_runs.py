"""Running one engine scenario script in its own process (its own process
group, so a timeout takes the EngineCore and workers with it) and comparing
its generations bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_scenario(
    script: Path, scenario: str, model: str, out_dir: Path, *extra: str, timeout: int = 400
) -> dict[str, Any]:
    """``python script scenario model out.json *extra``: its JSON result and ``log``."""
    out = out_dir / f"{scenario}.json"
    proc = subprocess.run(
        [sys.executable, str(script), scenario, model, str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res: dict[str, Any] = json.loads(out.read_text())
    res["log"] = proc.stdout + proc.stderr
    return res


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Greedy tokens and logprobs (float.hex) equal."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
