"""The ``cpu`` host tier: slab sizing, the reserve/commit/pin lifecycle, the
bytes API, and a state machine over random operation sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsdk import plugins_manager
from kvsdk.backend import HostTier, TierContext
from kvsdk.backends.cpu import CPUBackend, CPUOptions
from kvsdk.eviction import ARCPolicy
from kvsdk.types import Locality, Medium

SLOT = 16


def make(slots: int = 4, slot_bytes: int = SLOT, policy: object = None) -> CPUBackend:
    ctx = TierContext(
        namespace_fp=bytes(16),
        namespace_hex="00" * 16,
        chunk_bytes=slot_bytes,
        policy_factory=policy,
    )
    return CPUBackend(CPUOptions(capacity=slots * slot_bytes, pin_memory="never"), ctx)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(b: CPUBackend, slot: int, byte: int) -> None:
    """What a transfer worker does: write a chunk straight into a slot."""
    b.slab[slot].fill_(byte)


def store(b: CPUBackend, keys: list[bytes]) -> list[int]:
    reserved = b.reserve(keys)
    assert reserved is not None
    slots, _ = reserved
    for key, slot in zip(keys, slots):
        fill(b, slot, key[0])
    b.commit(keys, ok=True)
    return slots


# -- sizing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "chunk", "slots"),
    [(1000, 64, 15), (1024, 64, 16), (64, 64, 1), (4 << 20, 4096, 1024)],
)
def test_capacity_in_bytes_becomes_a_slot_count(capacity: int, chunk: int, slots: int) -> None:
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=chunk)
    b = CPUBackend(CPUOptions(capacity=capacity, pin_memory="never"), ctx)
    assert b.num_slots == slots
    assert tuple(b.slab.shape) == (slots, chunk)
    assert b.slab.dtype == torch.uint8
    assert b.stats()["capacity_bytes"] == slots * chunk


def test_capacity_below_one_chunk_is_refused() -> None:
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=64)
    with pytest.raises(ValueError, match="holds no chunk"):
        CPUBackend(CPUOptions(capacity=63, pin_memory="never"), ctx)


def test_unknown_chunk_size_is_refused() -> None:
    ctx = TierContext(namespace_fp=bytes(16), namespace_hex="00" * 16, chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk size"):
        CPUBackend(CPUOptions(capacity=1024, pin_memory="never"), ctx)


def test_cpu_backend_is_a_registered_host_tier() -> None:
    assert plugins_manager.backends()["cpu"] is CPUBackend
    assert issubclass(CPUBackend, HostTier)
    assert (CPUBackend.medium, CPUBackend.locality) == (Medium.CPU, Locality.PROCESS)


def test_policy_factory_is_used_with_the_slot_count() -> None:
    seen: list[int] = []

    def factory(capacity: int) -> ARCPolicy:
        seen.append(capacity)
        return ARCPolicy(capacity=capacity)

    make(slots=5, policy=factory)
    assert seen == [5]


# -- reserve / commit / pin -------------------------------------------------------------------


def test_reserved_entry_is_present_but_not_readable_until_committed() -> None:
    b = make()
    reserved = b.reserve([k(1)])
    assert reserved is not None
    (slot,), evicted = reserved
    assert evicted == []
    assert b.contains(k(1))
    assert b.slot_of(k(1)) is None
    assert b.exists([k(1)]) == [False]
    assert b.get([k(1)]) == [None]
    fill(b, slot, 7)
    b.commit([k(1)], ok=True)
    assert b.slot_of(k(1)) == slot
    assert b.exists([k(1)]) == [True]
    assert bytes(b.get([k(1)])[0]) == bytes([7]) * SLOT  # type: ignore[arg-type]


def test_failed_commit_frees_the_slot() -> None:
    b = make(slots=1)
    reserved = b.reserve([k(1)])
    assert reserved is not None
    b.commit([k(1)], ok=False)
    assert not b.contains(k(1))
    assert b.num_used == 0
    assert b.reserve([k(2)]) is not None


def test_reserve_evicts_least_recently_used_ready_entries() -> None:
    b = make(slots=3)
    store(b, [k(1), k(2), k(3)])
    b.touch([k(1)])
    reserved = b.reserve([k(4), k(5)])
    assert reserved is not None
    _, evicted = reserved
    assert evicted == [k(3), k(2)]  # stored together: the tail first
    assert b.slot_of(k(1)) is not None
    assert b.stats()["evictions"] == 2


def test_pinned_entries_are_never_evicted() -> None:
    b = make(slots=2)
    store(b, [k(1), k(2)])
    b.pin([k(1)])
    reserved = b.reserve([k(3)])
    assert reserved is not None and reserved[1] == [k(2)]
    assert b.reserve([k(4)]) is None  # k(1) pinned, k(3) still being written
    assert b.slot_of(k(1)) is not None


def test_pins_nest_and_unpin_releases_only_at_zero() -> None:
    b = make(slots=1)
    store(b, [k(1)])
    b.pin([k(1)])
    b.pin([k(1)])
    b.unpin([k(1)])
    assert b.reserve([k(2)]) is None
    b.unpin([k(1)])
    reserved = b.reserve([k(2)])
    assert reserved is not None and reserved[1] == [k(1)]


def test_writing_entries_are_never_evicted() -> None:
    b = make(slots=2)
    assert b.reserve([k(1), k(2)]) is not None
    assert b.reserve([k(3)]) is None
    assert b.contains(k(1)) and b.contains(k(2))


def test_reserve_returns_none_and_reserves_nothing_when_short_of_room() -> None:
    b = make(slots=3)
    store(b, [k(1), k(2)])
    b.pin([k(1), k(2)])
    assert b.reserve([k(3), k(4)]) is None  # one free slot, two wanted, none evictable
    assert not b.contains(k(3)) and not b.contains(k(4))
    assert b.num_used == 2
    assert b.reserve([k(3)]) is not None


def test_delete_or_clear_during_a_write_makes_the_late_commit_a_no_op() -> None:
    b = make(slots=2)
    assert b.reserve([k(1), k(2)]) is not None
    assert b.delete([k(1)]) == 1
    b.clear()
    b.commit([k(1), k(2)], ok=True)
    assert b.num_used == 0
    assert b.exists([k(1), k(2)]) == [False, False]


# -- the bytes API ----------------------------------------------------------------------------


def test_put_get_exists_delete_clear_round_trip() -> None:
    b = make(slots=4)
    assert (
        b.put([(k(1), b"hello"), (k(2), bytearray(b"world!")), (k(3), memoryview(b"x" * SLOT))])
        == [True] * 3
    )
    assert b.exists([k(1), k(2), k(3), k(4)]) == [True, True, True, False]
    got = b.get([k(1), k(2), k(3), k(4)])
    assert [None if g is None else bytes(g) for g in got] == [
        b"hello",
        b"world!",
        b"x" * SLOT,
        None,
    ]
    assert sorted(b.iter_keys()) == [k(1), k(2), k(3)]
    assert b.delete([k(2), k(4)]) == 1
    assert b.exists([k(2)]) == [False]
    b.clear()
    assert b.exists([k(1), k(3)]) == [False, False]
    assert b.num_used == 0
    assert list(b.iter_keys()) == []


def test_put_refuses_a_value_larger_than_a_slot() -> None:
    b = make()
    assert b.put([(k(1), b"x" * (SLOT + 1)), (k(2), b"ok")]) == [False, True]
    assert b.exists([k(1)]) == [False]


def test_put_of_a_stored_key_keeps_the_first_value() -> None:
    b = make()
    b.put([(k(1), b"first")])
    assert b.put([(k(1), b"second")]) == [True]
    assert bytes(b.get([k(1)])[0]) == b"first"  # type: ignore[arg-type]


def test_put_reports_false_when_nothing_can_be_evicted() -> None:
    b = make(slots=1)
    b.put([(k(1), b"a")])
    b.pin([k(1)])
    assert b.put([(k(2), b"b")]) == [False]
    assert b.exists([k(2)]) == [False]


def test_delete_skips_pinned_entries() -> None:
    b = make()
    b.put([(k(1), b"a"), (k(2), b"b")])
    b.pin([k(1)])
    assert b.delete([k(1), k(2)]) == 1
    assert b.exists([k(1), k(2)]) == [True, False]


def test_bytes_written_into_a_slot_are_what_get_returns() -> None:
    b = make()
    reserved = b.reserve([k(9)])
    assert reserved is not None
    payload = np.arange(SLOT, dtype=np.uint8)
    b.slab[reserved[0][0]] = torch.from_numpy(payload)
    b.commit([k(9)], ok=True)
    assert bytes(b.get([k(9)])[0]) == payload.tobytes()  # type: ignore[arg-type]


def test_put_with_a_repeated_key_does_not_leak_a_slot() -> None:
    b = make(slots=4)
    b.put([(k(1), b"a"), (k(1), b"bb")])
    b.clear()
    assert b.put([(k(i), b"x") for i in range(4)]) == [True] * 4


def test_put_reports_already_stored_keys_as_stored_when_new_ones_do_not_fit() -> None:
    b = make(slots=1)
    b.put([(k(1), b"a")])
    b.pin([k(1)])
    assert b.put([(k(1), b"a"), (k(2), b"b")]) == [True, False]


# -- random operation sequences ---------------------------------------------------------------

NUM_SLOTS = 4
POOL = [k(i) for i in range(10)]
KEYS = st.sampled_from(POOL)


class CPUBackendMachine(RuleBasedStateMachine):
    """Model: each key is absent, writing or ready; pins counted; bytes known."""

    def __init__(self) -> None:
        super().__init__()
        self.b = make(slots=NUM_SLOTS)
        self.writing: dict[bytes, int] = {}  # key -> reserved slot
        self.ready: dict[bytes, bytes] = {}  # key -> its bytes
        self.pins: dict[bytes, int] = {}

    def _present(self) -> set[bytes]:
        return set(self.writing) | set(self.ready)

    def _evictable(self) -> set[bytes]:
        return {key for key in self.ready if not self.pins.get(key)}

    def _drop(self, key: bytes) -> None:
        self.writing.pop(key, None)
        self.ready.pop(key, None)
        self.pins.pop(key, None)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3, unique=True))
    def reserve(self, keys: list[bytes]) -> None:
        keys = [key for key in keys if key not in self._present()]
        if not keys:
            return
        shortfall = len(keys) - (NUM_SLOTS - len(self._present()))
        result = self.b.reserve(keys)
        if result is None:
            assert shortfall > len(self._evictable())
            return
        slots, evicted = result
        assert len(evicted) == max(0, shortfall)
        assert set(evicted) <= self._evictable()
        for key in evicted:
            self._drop(key)
        for key, slot in zip(keys, slots):
            fill(self.b, slot, key[0] + 1)
            self.writing[key] = slot

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def commit(self, data: st.DataObject, ok: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.writing)), min_size=1, unique=True))
        self.b.commit(keys, ok)
        for key in keys:
            del self.writing[key]
            if ok:
                self.ready[key] = bytes([key[0] + 1]) * SLOT
            else:
                self.pins.pop(key, None)  # a failed write frees the slot, pins included

    @rule(key=KEYS)
    def pin(self, key: bytes) -> None:
        if key in self._present():
            self.b.pin([key])
            self.pins[key] = self.pins.get(key, 0) + 1

    @rule(key=KEYS)
    def unpin(self, key: bytes) -> None:
        if self.pins.get(key):
            self.b.unpin([key])
            self.pins[key] -= 1

    @rule(key=KEYS)
    def touch(self, key: bytes) -> None:
        self.b.touch([key])

    @rule(items=st.dictionaries(KEYS, st.binary(min_size=1, max_size=SLOT), max_size=3))
    def put(self, items: dict[bytes, bytes]) -> None:
        before = dict(self.ready)
        result = self.b.put(list(items.items()))
        # Entries put() evicted to make room must have been ready and unpinned.
        for key in before:
            if not self.b.exists([key])[0]:
                assert key in self._evictable()
                self._drop(key)
        for (key, value), ok in zip(items.items(), result):
            if ok and key not in self._present():
                self.ready[key] = value
            elif key in self.writing:
                assert not ok

    @rule(keys=st.lists(KEYS, max_size=3, unique=True))
    def delete(self, keys: list[bytes]) -> None:
        expected = [key for key in keys if key in self._present() and not self.pins.get(key)]
        assert self.b.delete(keys) == len(expected)
        for key in expected:
            self._drop(key)

    @rule()
    def clear(self) -> None:
        self.b.clear()
        self.writing.clear()
        self.ready.clear()
        self.pins.clear()

    @invariant()
    def used_plus_free_is_every_slot(self) -> None:
        assert self.b.num_used == len(self._present())
        assert self.b.num_used + len(self.b._free) == self.b.num_slots

    @invariant()
    def no_slot_is_shared(self) -> None:
        used = list(self.b._slot.values())
        assert len(used) == len(set(used))
        assert not set(used) & set(self.b._free)
        assert set(used) | set(self.b._free) == set(range(self.b.num_slots))
        for key, slot in self.writing.items():
            assert self.b._slot[key] == slot

    @invariant()
    def only_committed_keys_have_a_readable_slot(self) -> None:
        for key in POOL:
            assert (self.b.slot_of(key) is not None) == (key in self.ready)
            assert self.b.contains(key) == (key in self._present())
        assert set(self.b.iter_keys()) == set(self.ready)

    @invariant()
    def ready_keys_return_their_bytes(self) -> None:
        keys = sorted(self.ready)
        got = self.b.get(keys)
        assert [None if g is None else bytes(g) for g in got] == [self.ready[k] for k in keys]


TestCPUBackendRandomOperations = settings(max_examples=200, stateful_step_count=30, deadline=None)(
    CPUBackendMachine
).TestCase
