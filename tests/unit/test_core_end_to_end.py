"""The whole core (scheduler, planner, ledger, tiered store, CPU transfer worker)
driven by the synthetic paged-KV engine: loaded KV equals computed KV, byte for byte."""

from __future__ import annotations

from kvsdk.bench.synthetic import SyntheticEngine, TraceSpec, default_groups
from kvsdk.types import GroupKind, KVGroupSpec

SPEC = TraceSpec(
    num_requests=40,
    num_prefixes=3,
    prefix_tokens=256,
    suffix_tokens=(8, 128),
    max_batched_tokens=512,
    max_running=6,
    seed=1,
)


def run(groups: list[KVGroupSpec], **kw: object) -> SyntheticEngine:
    engine = SyntheticEngine(
        groups,
        num_layers=2,
        block_bytes=256,
        num_blocks=1024,
        config={"tiers": [{"backend": "cpu", "capacity": "8MiB"}], "chunk_tokens": 64},
        **kw,  # type: ignore[arg-type]
    )
    engine.run(SPEC)
    engine.close()
    return engine


def test_shared_prefixes_are_loaded_and_every_loaded_byte_is_right() -> None:
    engine = run(default_groups(tokens_per_block=16, blocks_per_chunk=2))
    s = engine.stats
    assert s.hit_tokens > 0.5 * SPEC.prefix_tokens * (SPEC.num_requests - SPEC.num_prefixes)
    assert s.loaded_blocks_checked > 0
    assert s.mismatched_blocks == 0
    assert engine.core.ledger.is_empty()
    assert engine.core.num_tracked_requests() == 0
    host = engine.store.host
    assert all(n == 0 for n in [len(host._pins)])


def test_corrupted_kv_is_caught_by_the_check() -> None:
    """Negative control: the byte check above would see wrong KV."""
    engine = SyntheticEngine(
        [KVGroupSpec(0, GroupKind.FULL_ATTENTION, 16, 2)],
        num_layers=1,
        block_bytes=64,
        num_blocks=512,
        config={"tiers": [{"backend": "cpu", "capacity": "1MiB"}]},
    )
    engine.run(
        TraceSpec(
            num_requests=2,
            num_prefixes=1,
            prefix_tokens=128,
            suffix_tokens=(8, 8),
            decode_tokens=1,
            max_running=1,
        )
    )
    slab = engine.store.host.slab
    slab.add_(1)  # every stored byte is now wrong
    engine.run(
        TraceSpec(
            num_requests=2,
            num_prefixes=1,
            prefix_tokens=128,
            suffix_tokens=(8, 8),
            decode_tokens=1,
            max_running=1,
        )
    )
    engine.close()
    assert engine.stats.mismatched_blocks > 0


def test_tiny_host_tier_evicts_and_still_never_loads_wrong_bytes() -> None:
    engine = SyntheticEngine(
        default_groups(16, 1),
        num_layers=2,
        block_bytes=128,
        num_blocks=1024,
        config={"tiers": [{"backend": "cpu", "capacity": "64KiB"}], "eviction": "arc"},
    )
    engine.run(SPEC)
    engine.close()
    assert engine.store.host.stats()["evictions"] > 0
    assert engine.stats.mismatched_blocks == 0
    assert engine.core.ledger.is_empty()
