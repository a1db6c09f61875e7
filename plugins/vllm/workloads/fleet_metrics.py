"""The figures ``kvsdk bench fleet`` reads from each engine: vLLM's own
``/metrics`` (its prefix cache's queries and hits, in tokens) and kvsdk's
exporter (``metrics.prometheus_port``: counters and the lookup-wait
histogram, which only the exporter serves; see docs/monitoring.md), read
before and after the workload, the difference kept.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
DROP_LABELS = {"engine", "model_name"}
ASYNC_WAIT = "kvsdk_lookup_delay_seconds"


def parse(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Samples whose name starts with one of ``prefixes``, keyed ``name{labels}``
    (labels sorted, vLLM's engine labels dropped); ``_created`` samples left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith(prefixes) or m.group(1).endswith("_created"):
            continue
        labels = sorted((k, v) for k, v in _LABEL.findall(m.group(2) or "") if k not in DROP_LABELS)
        key = m.group(1) + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
        try:
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def scrape(engine_url: str, exporter_port: int | None) -> dict[str, float]:
    """vLLM's ``vllm:*`` samples and, with kvsdk, the exporter's ``kvsdk_*`` ones."""
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    out = parse(text, ("vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:request_success",
                       "vllm:prompt_tokens", "vllm:kvsdk_"))  # fmt: skip
    if exporter_port is not None:
        exp = httpx.get(f"http://127.0.0.1:{exporter_port}/metrics", timeout=30).text
        out.update(parse(exp, ("kvsdk_",)))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` per sample (gauges too: read them in ``after``)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def total(samples: dict[str, float], name: str, contains: str = "") -> float:
    """The sum of ``name``'s samples (any labels) whose key contains ``contains``."""
    return sum(
        v for k, v in samples.items() if (k == name or k.startswith(name + "{")) and contains in k
    )


def async_wait_histogram(samples: dict[str, float]) -> dict[str, Any]:
    """``kvsdk_lookup_delay_seconds{kind="async"}``: bucket bounds with the count
    in each (not cumulative), the count and the sum (seconds)."""
    cum: dict[float, float] = {}
    for key, v in samples.items():
        if key.startswith(ASYNC_WAIT + "_bucket{") and 'kind="async"' in key:
            le = dict(_LABEL.findall(key[key.index("{") :]))["le"]
            bound = float("inf") if le == "+Inf" else float(le)
            cum[bound] = cum.get(bound, 0.0) + v
    bounds = sorted(cum)
    counts = [cum[b] - (cum[bounds[i - 1]] if i else 0.0) for i, b in enumerate(bounds)]
    return {
        "le": [b if b != float("inf") else "+Inf" for b in bounds],
        "counts": counts,
        "count": total(samples, ASYNC_WAIT + "_count", 'kind="async"'),
        "sum_s": total(samples, ASYNC_WAIT + "_sum", 'kind="async"'),
    }


def by_tier(d: dict[str, float], name: str) -> dict[str, float]:
    """``name``'s samples by their ``tier`` label (kvsdk numbers tiers: 0 is the
    host tier, 1 the next one below it)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if k.startswith(name + "{") and "tier=" in k:
            tier = k.split("tier=")[-1].split(",")[0].strip('"}')
            out[tier] = out.get(tier, 0.0) + v
    return out


def engine_figures(d: dict[str, float]) -> dict[str, Any]:
    """One engine's figures over a run, from its metrics' difference ``d``."""
    return {
        "prefix_queries": total(d, "vllm:prefix_cache_queries_total"),
        "prefix_hits": total(d, "vllm:prefix_cache_hits_total"),
        "external_queries": total(d, "vllm:external_prefix_cache_queries_total"),
        "external_hits": total(d, "vllm:external_prefix_cache_hits_total"),
        "requests": total(d, "vllm:request_success_total"),
        "kvsdk_hit_tokens": total(d, "kvsdk_hit_tokens_total"),
        "kvsdk_backend_errors": total(d, "kvsdk_backend_errors_total"),
        "kvsdk_failed_jobs": total(d, "kvsdk_failed_jobs_total"),
        "kvsdk_corrupt_chunks": total(d, "kvsdk_corrupt_chunks_total"),
        "kvsdk_loaded_bytes": by_tier(d, "kvsdk_loaded_bytes_total"),
        "kvsdk_lookup_hits": by_tier(d, "kvsdk_lookup_hits_total"),
        "lookup_wait_async": async_wait_histogram(d),
    }


def merge_histograms(hists: list[dict[str, Any]]) -> dict[str, Any]:
    """Histograms of the same buckets added up (engines, passes)."""
    hists = [h for h in hists if h["le"]]
    if not hists:
        return {"le": [], "counts": [], "count": 0.0, "sum_s": 0.0}
    return {
        "le": hists[0]["le"],
        "counts": [sum(c) for c in zip(*(h["counts"] for h in hists), strict=True)],
        "count": sum(h["count"] for h in hists),
        "sum_s": sum(h["sum_s"] for h in hists),
    }
