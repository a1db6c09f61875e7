"""Eviction policies: LRU order, ARC scan resistance, the can_evict predicate,
and a state machine checking that no policy invents or loses a resident key."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvsdk import plugins_manager
from kvsdk.eviction import ARCPolicy, EvictionPolicy, LRUPolicy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def run_cache(policy: EvictionPolicy, capacity: int, accesses: Iterable[bytes]) -> list[bool]:
    """Drive ``policy`` as a tier of ``capacity`` entries would; return hit or miss per access."""
    resident: set[bytes] = set()
    hits: list[bool] = []
    for key in accesses:
        hits.append(key in resident)
        if key in resident:
            policy.touch(key)
            continue
        if len(resident) >= capacity:
            (victim,) = policy.victims(1, lambda _k: True)
            policy.evicted(victim)
            resident.remove(victim)
        policy.insert(key)
        resident.add(key)
    return hits


# -- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy()
    for i in range(4):
        lru.insert(k(i))
    lru.touch(k(0))
    assert list(lru.candidates()) == [k(1), k(2), k(3), k(0)]
    assert lru.victims(2, lambda _k: True) == [k(1), k(2)]


def test_lru_reinsert_counts_as_most_recent() -> None:
    lru = LRUPolicy()
    for i in range(3):
        lru.insert(k(i))
    lru.insert(k(0))
    assert list(lru.candidates()) == [k(1), k(2), k(0)]


def test_lru_forgets_removed_and_evicted_keys() -> None:
    lru = LRUPolicy()
    for i in range(3):
        lru.insert(k(i))
    lru.remove(k(1))
    lru.evicted(k(0))
    assert list(lru.candidates()) == [k(2)]
    assert len(lru) == 1
    lru.touch(k(1))  # touching an absent key does not resurrect it
    assert list(lru.candidates()) == [k(2)]


# -- ARC --------------------------------------------------------------------------------------


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    capacity = 8
    hot = [k(i) for i in range(4)]
    scan = [k(1000 + i) for i in range(100)]
    workload = [*hot, *hot, *scan, *hot]  # reuse the hot set, scan once, reuse again

    lru = run_cache(LRUPolicy(), capacity, workload)
    arc = run_cache(ARCPolicy(capacity=capacity), capacity, workload)

    second_pass = slice(len(hot), 2 * len(hot))
    assert all(lru[second_pass]) and all(arc[second_pass])  # both keep a reused set...
    assert not any(lru[-len(hot) :])  # ...but LRU lets the one-time scan flush it
    assert all(arc[-len(hot) :])  # while ARC keeps it


def test_arc_treats_a_recently_evicted_key_as_frequent() -> None:
    arc = ARCPolicy(capacity=2)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.evicted(k(1))  # k(1) goes to the recency ghost list
    arc.insert(k(1))  # a ghost hit: it returns as a frequent key
    arc.insert(k(3))
    # the once-seen keys go before the returning one
    assert arc.victims(3, lambda _k: True) == [k(2), k(3), k(1)]


def test_arc_clear_forgets_everything() -> None:
    arc = ARCPolicy(capacity=4)
    for i in range(6):
        arc.insert(k(i))
    arc.touch(k(5))
    arc.evicted(k(0))
    arc.clear()
    assert list(arc.candidates()) == []
    assert len(arc) == 0
    assert arc.p == 0


# -- victims() and the predicate --------------------------------------------------------------


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(capacity=8)], ids=["lru", "arc"])
def test_victims_skip_keys_the_tier_may_not_evict(make: Callable[[], EvictionPolicy]) -> None:
    policy = make()
    for i in range(6):
        policy.insert(k(i))
    pinned = {k(0), k(2), k(3)}
    victims = policy.victims(2, lambda key: key not in pinned)
    assert len(victims) == 2
    assert not pinned & set(victims)
    # fewer evictable keys than asked for: all of them, no more
    assert sorted(policy.victims(10, lambda key: key not in pinned)) == [k(1), k(4), k(5)]
    assert policy.victims(3, lambda _k: False) == []
    assert policy.victims(0, lambda _k: True) == []


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(capacity=8)], ids=["lru", "arc"])
def test_victims_do_not_remove_anything(make: Callable[[], EvictionPolicy]) -> None:
    policy = make()
    for i in range(4):
        policy.insert(k(i))
    before = list(policy.candidates())
    policy.victims(2, lambda _k: True)
    assert list(policy.candidates()) == before


def test_built_in_policies_are_registered_as_plugins() -> None:
    policies = plugins_manager.eviction_policies()
    assert isinstance(policies["lru"](capacity=4), LRUPolicy)
    assert isinstance(policies["arc"](capacity=4), ARCPolicy)


# -- state machine: never a key that is not resident, never a lost key -----------------------

KEYS = st.integers(min_value=0, max_value=11).map(k)


class PolicyMachine(RuleBasedStateMachine):
    make: Callable[[], EvictionPolicy]

    def __init__(self) -> None:
        super().__init__()
        self.policy = type(self).make()
        self.resident: set[bytes] = set()

    @rule(key=KEYS)
    def insert(self, key: bytes) -> None:
        if key not in self.resident:
            self.policy.insert(key)
            self.resident.add(key)

    @rule(key=KEYS)
    def touch(self, key: bytes) -> None:
        self.policy.touch(key)  # absent keys included: must stay absent

    @rule(key=KEYS)
    def remove(self, key: bytes) -> None:
        self.policy.remove(key)
        self.resident.discard(key)

    @rule(n=st.integers(min_value=0, max_value=5), blocked=st.sets(KEYS, max_size=6))
    def evict(self, n: int, blocked: set[bytes]) -> None:
        victims = self.policy.victims(n, lambda key: key not in blocked)
        assert len(victims) == len(set(victims))
        assert set(victims) <= self.resident
        assert not set(victims) & blocked
        assert len(victims) == min(n, len(self.resident - blocked))
        for key in victims:
            self.policy.evicted(key)
            self.resident.remove(key)

    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.resident.clear()

    @invariant()
    def candidates_are_exactly_the_resident_keys(self) -> None:
        candidates = list(self.policy.candidates())
        assert len(candidates) == len(set(candidates))
        assert set(candidates) == self.resident
        assert len(self.policy) == len(self.resident)  # type: ignore[arg-type]


class LRUMachine(PolicyMachine):
    make = LRUPolicy


class ARCMachine(PolicyMachine):
    @staticmethod
    def make() -> EvictionPolicy:  # type: ignore[override]
        return ARCPolicy(capacity=4)


_settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestLRUNeverInventsOrLosesKeys = _settings(LRUMachine).TestCase
TestARCNeverInventsOrLosesKeys = _settings(ARCMachine).TestCase
