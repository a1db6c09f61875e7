"""The workload of ``kvsdk bench pd``: token-id prompts at a few lengths, each
sent once, one at a time, greedy, streamed; what the client sees recorded.

Every prompt is seeded random token ids of its own (no prompt shares a prefix
with another, nor with an engine's warm-up), so each is computed cold
somewhere: in full on the single engine, on the prefill engine in P/D. The
same prompts go to either deployment, through the same OpenAI endpoint
(``/v1/completions``), so the records compare one to one.

A record holds the time to the first token and the gaps between the
following token-bearing chunks (per token), the greedy token ids and their
logprobs, and ``usage.prompt_tokens_details.cached_tokens`` (the tokens the
answering engine did not compute) as the response says it, None where it
leaves it out. vllm-router's P/D mode answers with the decode engine's
response but does not pass its ``prompt_tokens_details`` on (0 or nothing
arrives), so ``kvsdk bench pd`` takes what each engine computed and loaded
from the engines' counters.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class PDWorkload:
    prompt_tokens: tuple[int, ...] = (1024, 2048, 4096)
    requests: int = 3
    """Prompts per length."""
    max_tokens: int = 32
    seed: int = 0
    vocab_size: int = 32000

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def total(self) -> int:
        return len(self.prompt_tokens) * self.requests

    def max_prompt(self) -> int:
        return max(self.prompt_tokens)


@dataclass(frozen=True)
class Prompt:
    length: int
    index: int
    tokens: list[int]


def prompts(w: PDWorkload) -> list[Prompt]:
    """Per length (in order), ``w.requests`` seeded prompts."""
    rng = random.Random(w.seed)
    return [
        Prompt(n, i, [rng.randrange(3, w.vocab_size) for _ in range(n)])
        for n in w.prompt_tokens
        for i in range(w.requests)
    ]


def request_body(model: str, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    """Greedy, ``max_tokens`` exactly (EOS ignored), streamed with usage,
    token ids and the chosen tokens' logprobs in every chunk."""
    return {
        "model": model,
        "prompt": prompt.tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def _take_chunk(rec: dict[str, Any], chunk: dict[str, Any], now: float, start: float) -> None:
    if "error" in chunk:
        rec["error"] = str(chunk["error"])[:300]
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids") or []
        if not ids:
            continue
        if rec["ttft_ms"] is None:
            rec["ttft_ms"] = 1e3 * (now - start)
        else:
            rec["itl_ms"].extend([1e3 * (now - rec["_last"]) / len(ids)] * len(ids))
        rec["_last"] = now
        rec["tokens"].extend(ids)
        rec["logprobs"].extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
    usage = chunk.get("usage")
    if usage:
        rec["usage_prompt_tokens"] = usage.get("prompt_tokens")
        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def send(client: httpx.Client, model: str, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    """One streamed request; the record (``error`` set on any failure, never raised)."""
    rec: dict[str, Any] = {
        "length": prompt.length,
        "index": prompt.index,
        "ttft_ms": None,
        "itl_ms": [],
        "latency_ms": None,
        "tokens": [],
        "logprobs": [],
        "cached_tokens": None,
        "usage_prompt_tokens": None,
        "error": None,
    }
    start = time.perf_counter()
    try:
        with client.stream(
            "POST", "/v1/completions", json=request_body(model, prompt, max_tokens)
        ) as resp:
            if resp.status_code != 200:
                rec["error"] = (
                    f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}"
                )
                return _clean(rec)
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _take_chunk(rec, json.loads(line[6:]), time.perf_counter(), start)
        rec["latency_ms"] = 1e3 * (time.perf_counter() - start)
        if rec["error"] is None and len(rec["tokens"]) != max_tokens:
            rec["error"] = f"{len(rec['tokens'])} tokens streamed, {max_tokens} asked"
    except (httpx.HTTPError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return _clean(rec)


def _clean(rec: dict[str, Any]) -> dict[str, Any]:
    rec.pop("_last", None)
    return rec


def warm_up(url: str, model: str, w: PDWorkload, tokens: int = 300) -> None:
    """One prompt of ``tokens`` sent twice through ``url`` (a deployment's
    endpoint): the first pays the one-off costs of computing and storing
    (kvsdk's first chunk written, the router's first hand-off), the second
    those of loading. Its tokens are drawn apart from the workload's prompts."""
    rng = random.Random(f"warm-up {w.seed}")
    prompt = Prompt(tokens, -1, [rng.randrange(3, w.vocab_size) for _ in range(tokens)])
    with client(url) as c:
        for _ in range(2):
            rec = send(c, model, prompt, 2)
            if rec["error"] is not None:
                raise RuntimeError(f"warm-up request through {url} failed: {rec['error']}")


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=httpx.Timeout(900.0, connect=10.0))
