"""The workload of ``kvsdk bench fleet``: a multi-turn chat sent through the
router's OpenAI endpoint, TTFT measured at the client.

Each user has a system prompt of its own; each turn adds a user message and
the previous turn's answer stays in the history (the answers are seeded
tokens, not the model's: every configuration sends the very same prompts).
Prompts are token ids (the router's ``cache_aware`` matches prefixes on token
ids only). A round's requests are shuffled and sent in that order, a few ms
apart, with at most ``concurrency`` in flight: the router normally sees them
in the same order in every configuration, so round robin assigns them alike
(on a loaded machine two sends can still swap; each row's local hit share
shows where the requests went). The next round starts when the last request
of this one has finished.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Workload:
    users: int = 8
    rounds: int = 5
    system_tokens: int = 1000
    user_tokens: int = 200
    answer_tokens: int = 100
    max_tokens: int = 16
    concurrency: int = 4
    seed: int = 0
    vocab_size: int = 32000
    stagger_s: float = 0.005
    """Between two sends: keeps their order at the router."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def requests(self) -> int:
        return self.users * self.rounds

    def max_prompt(self) -> int:
        return (
            self.system_tokens
            + self.rounds * self.user_tokens
            + (self.rounds - 1) * self.answer_tokens
        )


@dataclass(frozen=True)
class Request:
    user: int
    round: int
    prompt: list[int]


def conversations(w: Workload) -> list[list[Request]]:
    """Per round, every user's request, in the (seeded, shuffled) order sent."""
    rng = random.Random(w.seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, w.vocab_size) for _ in range(n)]

    history = [toks(w.system_tokens) for _ in range(w.users)]
    answers = [toks(w.answer_tokens) for _ in range(w.users * w.rounds)]
    out = []
    for r in range(w.rounds):
        batch = []
        for u in range(w.users):
            prompt = history[u] + toks(w.user_tokens)
            history[u] = prompt + answers[r * w.users + u]  # the answer stays in the history
            batch.append(Request(u, r, prompt))
        rng.shuffle(batch)
        out.append(batch)
    return out


async def _one(
    client: httpx.AsyncClient, model: str, req: Request, w: Workload, order: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": w.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    rec: dict[str, Any] = {
        "user": req.user,
        "round": req.round,
        "order": order,
        "prompt_tokens": len(req.prompt),
        "ttft_ms": None,
        "latency_ms": None,
        "cached_tokens": None,
        "tokens": [],
        "error": None,
    }
    start = time.perf_counter()
    rec["sent_s"] = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:300]
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and rec["ttft_ms"] is None:
                        rec["ttft_ms"] = 1e3 * (time.perf_counter() - start)
                    rec["tokens"].extend(ids)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = details.get("cached_tokens", 0)
        rec["latency_ms"] = 1e3 * (time.perf_counter() - start)
        if rec["error"] is None and len(rec["tokens"]) != w.max_tokens:
            rec["error"] = f"{len(rec['tokens'])} tokens streamed, {w.max_tokens} asked"
    except (httpx.HTTPError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


async def _in_slot(
    one: Any, slots: asyncio.Semaphore, done: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    try:
        rec: dict[str, Any] = await one
    finally:
        slots.release()
    done(rec)
    return rec


async def _run(
    url: str,
    model: str,
    w: Workload,
    rounds: list[list[Request]],
    done: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=w.concurrency + 2)
    records: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        order = 0
        for batch in rounds:
            slots = asyncio.Semaphore(w.concurrency)
            tasks = []
            for req in batch:
                await slots.acquire()  # sends stay in the batch's order
                one = _one(client, model, req, w, order)
                tasks.append(asyncio.create_task(_in_slot(one, slots, done)))
                order += 1
                await asyncio.sleep(w.stagger_s)
            records.extend(await asyncio.gather(*tasks))
    return records


def run_workload(
    url: str, model: str, w: Workload, done: Callable[[dict[str, Any]], None]
) -> tuple[list[dict[str, Any]], float]:
    """Every request's record (sorted by send order) and the wall time (s)."""
    rounds = conversations(w)
    t0 = time.perf_counter()
    records = asyncio.run(_run(url, model, w, rounds, done))
    wall = time.perf_counter() - t0
    for rec in records:
        rec["sent_s"] -= t0
    return sorted(records, key=lambda r: r["order"]), wall


def warm_up(url: str, model: str, vocab_size: int, seed: int) -> None:
    """One short request straight to an engine (not through the router, whose
    state it would change): its first request pays one-off costs."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab_size) for _ in range(64)]
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
