"""``kvsdk bench serve``'s conversations: real-looking prompt lengths (not multiples
of a block), each turn repeating the conversation so far, within the model's length;
and the interval its report puts around a TTFT ratio."""

from __future__ import annotations

import itertools

import pytest

from kvsdk.plugins.vllm.workloads.bench_serve import (
    MAX_PROMPT_TOKENS,
    _paired_median,
    _ratio_interval,
    conversations,
)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_prompt_lengths_fall_anywhere_within_a_block() -> None:
    for reuse in (0.0, 0.5, 0.9):
        lengths = [len(p) for rnd in conversations(reuse, 4, 4, seed=0) for p in rnd]
        assert len(lengths) == 16
        # a length is a multiple of a block by chance only (1 in 16 for 16-token blocks)
        for block, most in ((16, 4), (32, 2), (128, 1)):
            assert sum(n % block == 0 for n in lengths) <= most, (reuse, block, lengths)
        assert max(lengths) <= MAX_PROMPT_TOKENS


def test_each_turn_repeats_the_conversation_so_far() -> None:
    rounds = conversations(0.9, 4, 4, seed=1)
    for prev, cur in itertools.pairwise(rounds):
        for u, (p, c) in enumerate(zip(prev, cur)):
            assert c[: len(p)] == p, u  # the whole previous prompt, then the answer, then new
            assert 0.8 < len(p) / len(c) < 0.95
    fresh = conversations(0.0, 4, 2, seed=1)
    prompts = [p for rnd in fresh for p in rnd]
    assert all(_shared_prefix(a, b) < 4 for i, a in enumerate(prompts) for b in prompts[i + 1 :])


def test_a_conversation_outgrowing_the_model_starts_again() -> None:
    rounds = conversations(0.25, 2, 4, seed=2)
    system = rounds[0][0][:600]
    for rnd in rounds:
        for p in rnd:
            assert len(p) <= MAX_PROMPT_TOKENS
            assert p[:600] == system  # every conversation starts with the system prompt


def _run(ttfts: list[float]) -> dict[str, dict[str, list[float]]]:
    return {"0.9": {"ttfts_ms": sorted(ttfts)}}


def test_the_ratio_interval_is_tight_when_every_pass_agrees() -> None:
    base = [_run([10.0 + i + k for k in range(32)]) for i in range(4)]
    slower = [_run([1.2 * t for t in b["0.9"]["ttfts_ms"]]) for b in base]
    lo, hi = _ratio_interval(slower, base, "0.9")
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)


def test_the_ratio_interval_widens_with_passes_that_disagree() -> None:
    base = [_run([10.0] * 32) for _ in range(6)]
    noisy = [_run([f * 10.0] * 32) for f in (0.8, 0.9, 1.0, 1.1, 1.2, 1.3)]
    lo, hi = _ratio_interval(noisy, base, "0.9")
    assert lo < 1.0 < hi
    assert lo >= 0.8 and hi <= 1.3


def _ordered(ttfts: list[float]) -> dict[str, dict[str, list[float]]]:
    return {"0": {"ttfts_in_order_ms": ttfts, "ttfts_ms": sorted(ttfts)}}


def test_the_paired_ratio_compares_each_request_with_itself() -> None:
    # the two passes' slow rounds fall in different places; within a pass each
    # request is 5 % slower than the same request in the baseline's run
    base = [_ordered([1300.0, 1800.0, 1300.0, 1800.0]), _ordered([1800.0, 1300.0, 1800.0, 1300.0])]
    slower = [_ordered([1.05 * t for t in b["0"]["ttfts_in_order_ms"]]) for b in base]
    assert _paired_median(slower, base, "0") == pytest.approx(1.05)
    assert _paired_median(base, base, "0") == pytest.approx(1.0)


def test_the_paired_ratio_refuses_runs_of_different_requests() -> None:
    with pytest.raises(ValueError):
        _paired_median([_ordered([1.0, 2.0])], [_ordered([1.0])], "0")
