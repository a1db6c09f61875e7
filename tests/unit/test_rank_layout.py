"""Where each tensor/pipeline rank's part of a chunk lives, and the process
layouts kvsdk refuses (pure data: no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsdk.config import ConfigError
from kvsdk.plugins.vllm.layout import RankLayout, check_process_layout


def test_every_tp_and_pp_rank_owns_its_own_region() -> None:
    ranks = RankLayout(tp_size=2, pp_size=2, replicated_across_tp=False, region_bytes=100)
    assert ranks.num_regions == 4
    regions = {ranks.region_index(pp, tp) for pp in range(2) for tp in range(2)}
    assert regions == {0, 1, 2, 3}
    assert all(ranks.stores_from(tp) for tp in range(2))


def test_mla_keeps_one_region_per_stage_stored_by_tp_rank_zero() -> None:
    ranks = RankLayout(tp_size=4, pp_size=2, replicated_across_tp=True, region_bytes=100)
    assert ranks.num_regions == 2
    assert {ranks.region_index(0, tp) for tp in range(4)} == {0}
    assert {ranks.region_index(1, tp) for tp in range(4)} == {1}
    assert ranks.stores_from(0)
    assert not any(ranks.stores_from(tp) for tp in (1, 2, 3))


@pytest.mark.parametrize(
    ("setting", "value"),
    [("nnodes", 2), ("decode_context_parallel_size", 2), ("prefill_context_parallel_size", 2)],
)
def test_unsupported_process_layouts_fail_closed_naming_the_setting(
    setting: str, value: int
) -> None:
    parallel = SimpleNamespace(
        nnodes=1, decode_context_parallel_size=1, prefill_context_parallel_size=1
    )
    setattr(parallel, setting, value)
    with pytest.raises(ConfigError, match=rf"parallel_config\.{setting}={value} .* not supported"):
        check_process_layout(parallel)


def test_one_machine_layouts_pass() -> None:
    check_process_layout(
        SimpleNamespace(nnodes=1, decode_context_parallel_size=1, prefill_context_parallel_size=1)
    )
