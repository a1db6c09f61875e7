"""The Grafana dashboard in examples/ names only metrics kvsdk exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvsdk.metrics import COUNTERS, GAUGES, HISTOGRAMS

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "kvsdk-vllm.json"


def test_dashboard_queries_name_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    names = {m for e in exprs for m in re.findall(r"(?:vllm:)?kvsdk_[a-z_]+", e)}
    known = {f"vllm:{n}" for n in COUNTERS} | {f"{n}_bucket" for n in HISTOGRAMS} | set(GAUGES)
    assert names and names <= known, names - known
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
