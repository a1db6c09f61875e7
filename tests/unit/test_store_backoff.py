"""Store back-pressure, the policy alone (a clock the test moves): a tier that
refuses ``after_failures`` write batches in a row pauses, a refused probe
doubles the pause up to ``max_s``, a taken write ends it; the config keys."""

from __future__ import annotations

import pytest

from kvsdk.config import ConfigError, StoreBackoffConfig, load_config
from kvsdk.metrics import Metrics
from kvsdk.store.backoff import StoreBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**cfg: float) -> tuple[StoreBackoff, Clock, Metrics]:
    clock, metrics = Clock(), Metrics()
    b = StoreBackoff({1: "disk"}, StoreBackoffConfig(**cfg), metrics, clock)  # type: ignore[arg-type]
    return b, clock, metrics


def test_a_tier_pauses_after_repeated_refusals_and_the_pause_doubles_to_its_cap() -> None:
    b, clock, metrics = make(after_failures=3, initial_s=1.0, max_s=3.0)
    b.written(1, False)
    b.written(1, False)
    assert b.accepts(1)  # two refusals: still offered
    b.written(1, False)
    assert not b.accepts(1) and b.paused() == [1]
    assert list(b.gauges()) == [("kvsdk_store_paused", {"tier": 1}, 1.0)]
    b.written(1, False)  # a batch sent before the pause began: the pause stands
    clock.now += 0.99
    assert not b.accepts(1)
    clock.now += 0.02
    assert b.accepts(1)  # the pause is over: the next batch is a probe
    b.written(1, False)  # refused: twice as long
    clock.now += 1.99
    assert not b.accepts(1)
    clock.now += 0.02
    b.written(1, False)  # refused again: 4 s, capped at 3 s
    clock.now += 2.99
    assert not b.accepts(1)
    clock.now += 0.02
    assert b.accepts(1)
    assert metrics.counter("kvsdk_store_backoffs_total", tier=1) == 3


def test_a_write_the_tier_takes_ends_the_back_off() -> None:
    b, clock, _ = make(after_failures=2, initial_s=1.0, max_s=60.0)
    for _ in range(2):
        b.written(1, False)
    clock.now += 1.5
    b.written(1, True)  # the probe was taken
    assert b.accepts(1) and b.paused() == []
    b.written(1, False)  # the streak starts over: one refusal does not pause
    assert b.accepts(1)
    b.written(1, False)
    clock.now += 1.01  # and the first pause is the initial one again
    assert b.accepts(1)


def test_zero_failures_never_pauses() -> None:
    b, _, metrics = make(after_failures=0)
    for _ in range(100):
        b.written(1, False)
    assert b.accepts(1)
    b.skipped(1, 0)
    assert metrics.counter("kvsdk_store_backoffs_total") == 0


def test_config_keys_have_defaults_and_bad_values_name_the_key() -> None:
    cfg = load_config({})
    assert cfg.store_backoff == StoreBackoffConfig(after_failures=3, initial_s=1.0, max_s=60.0)
    cfg = load_config({"store_backoff": {"after_failures": 5, "initial_s": 0.5, "max_s": 10}})
    assert cfg.store_backoff.max_s == 10.0
    for bad, key in (
        ({"after_failures": -1}, "store_backoff.after_failures"),
        ({"initial_s": 0}, "store_backoff.initial_s"),
        ({"initial_s": 5, "max_s": 2}, "store_backoff.max_s"),
        ({"max_seconds": 2}, "store_backoff.max_seconds: unknown key"),
        ({"after_failures": "3"}, "store_backoff.after_failures: got '3'"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config({"store_backoff": bad})
