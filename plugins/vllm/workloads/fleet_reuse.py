"""How much of the reusable prefix ``kvsdk bench fleet``'s shared tier returned.

A request's *recomputable prefix* is the part of its prompt that an earlier
request of the same user already computed on either engine: the longest
common prefix with any of that user's earlier prompts (only prompts count:
the seeded answer tokens in the history were never computed), in whole
blocks of ``block_size`` tokens (vLLM's block; 128 on vLLM-CPU), and never
the prompt's last token (vLLM always computes it). Per pass:

- ``kvsdk_share`` = tokens kvsdk loaded / (recomputable tokens - tokens
  vLLM's own prefix cache hit): of what the engine that got the request did
  not hold itself, the share kvsdk returned (None when that is 0);
- ``fleet_share`` = (vLLM's own hits + kvsdk's tokens) / recomputable: the
  share of the recomputable prefix the fleet did not compute again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def recomputable_tokens(requests: Iterable[tuple[int, Sequence[int]]], block_size: int) -> int:
    """The recomputable prefix tokens of ``requests`` (``(user, prompt)`` in the
    order sent, a user's earlier requests finished before its next), summed."""
    seen: dict[int, list[Sequence[int]]] = {}
    total = 0
    for user, prompt in requests:
        reused = max((_common_prefix(prompt, p) for p in seen.get(user, [])), default=0)
        reused = min(reused, len(prompt) - 1)
        total += reused // block_size * block_size
        seen.setdefault(user, []).append(prompt)
    return total


def share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def reuse_shares(recomputable: int, local_hits: float, kvsdk_tokens: float) -> dict[str, Any]:
    """One pass's shares (see the module's docstring) and the figures behind them."""
    return {
        "recomputable_tokens": recomputable,
        "local_hit_tokens": local_hits,
        "kvsdk_tokens": kvsdk_tokens,
        "kvsdk_share": share(kvsdk_tokens, recomputable - local_hits),
        "fleet_share": share(local_hits + kvsdk_tokens, recomputable),
    }
