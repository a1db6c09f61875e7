"""The job ledger: completion counting, fences, flushes, reset; and a property test
that after any random history, once everything completes, nothing is left."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsdk.ledger import JobLedger


def test_job_completes_when_every_worker_reported() -> None:
    ledger = JobLedger(num_workers=2)
    jid = ledger.add_store("r", [b"k"])
    assert ledger.complete(jid) is None
    job = ledger.complete(jid)
    assert job is not None and job.keys == (b"k",)
    with pytest.raises(KeyError):
        ledger.complete(jid)


def test_load_only_when_request_has_no_jobs() -> None:
    ledger = JobLedger()
    ledger.add_store("r", [b"k"])
    assert ledger.has_jobs("r")
    with pytest.raises(AssertionError):
        ledger.add_load("r", [b"x"])


def test_sliding_window_fence_flushes_store_when_block_is_reallocated() -> None:
    ledger = JobLedger()
    jid = ledger.add_store("r", [b"k"], fenced_block_ids=[7], deferred_fence_block_ids=[3])
    ledger.end_step()
    ledger.blocks_allocated([3])  # full-attention block: the request still holds it
    ledger.collect_fence_flushes()
    assert ledger.end_step() == set()
    ledger.blocks_allocated([7])
    ledger.collect_fence_flushes()
    assert ledger.end_step() == {jid}


def test_deferred_fences_watched_once_request_finishes() -> None:
    ledger = JobLedger()
    jid = ledger.add_store("r", [b"k"], deferred_fence_block_ids=[3])
    ledger.end_step()
    ledger.request_finished("r")
    ledger.blocks_allocated([3])
    ledger.collect_fence_flushes()
    assert ledger.end_step() == {jid}
    ledger.forget("r")
    assert not ledger.is_empty()  # its store is still in flight
    ledger.complete(jid)
    assert ledger.is_empty()


def test_final_store_of_finished_request_flushes_if_its_block_was_just_reused() -> None:
    ledger = JobLedger()
    ledger.blocks_allocated([5])
    ledger.request_finished("r")
    jid = ledger.add_store("r", [b"k"], deferred_fence_block_ids=[5])
    assert ledger.end_step() == {jid}


def test_preemption_flushes_the_requests_stores() -> None:
    ledger = JobLedger()
    jid = ledger.add_store("r", [b"k"])
    ledger.end_step()
    ledger.request_preempted("r")
    assert ledger.end_step() == {jid}


def test_reset_fences_jobs_in_flight_until_every_worker_reported_them() -> None:
    ledger = JobLedger(num_workers=2)
    old = ledger.add_store("r", [b"k"], fenced_block_ids=[1])
    ledger.end_step()
    assert ledger.reset() == {old}
    assert ledger.end_step() == {old}  # workers still get told to flush it
    assert not ledger.has_jobs("r")  # the request owns it no more
    assert ledger.num_jobs == 0 and ledger.num_jobs_before_reset == 1
    new = ledger.add_load("r", [b"k"])
    assert new > old
    assert ledger.complete(old) is None  # one worker of two
    assert not ledger.is_empty()  # its slots are still being written
    job = ledger.complete(old)
    assert job is not None and job.before_reset and job.keys == (b"k",)
    assert ledger.complete(old) is None  # a report nobody waits for is ignored
    ledger.complete(new, 2)
    ledger.request_finished("r")
    ledger.forget("r")
    assert ledger.is_empty()


class LedgerMachine(RuleBasedStateMachine):
    """Random requests, allocations, preemptions, aborts, completions and resets."""

    def __init__(self) -> None:
        super().__init__()
        self.workers = 2
        self.ledger = JobLedger(self.workers)
        self.outstanding: dict[int, int] = {}  # job -> reports still due (incl. stale ones)
        self.live: set[str] = set()
        self.finished: set[str] = set()
        self.n = 0

    @rule()
    def new_request(self) -> None:
        self.n += 1
        self.live.add(f"r{self.n}")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.live)))
        if not self.ledger.has_jobs(req):
            jid = self.ledger.add_load(req, [req.encode()])
            self.outstanding[jid] = self.workers

    @precondition(lambda self: self.live or self.finished)
    @rule(data=st.data(), blocks=st.lists(st.integers(0, 12), max_size=4))
    def store(self, data: st.DataObject, blocks: list[int]) -> None:
        req = data.draw(st.sampled_from(sorted(self.live | self.finished)))
        if any(not self.ledger.job(j).is_store for j in self.ledger.jobs_of(req)):
            return
        half = len(blocks) // 2
        jid = self.ledger.add_store(
            req, [b"k"], fenced_block_ids=blocks[:half], deferred_fence_block_ids=blocks[half:]
        )
        self.outstanding[jid] = self.workers

    @rule(blocks=st.lists(st.integers(0, 12), max_size=4))
    def allocate(self, blocks: list[int]) -> None:
        self.ledger.blocks_allocated(blocks)

    @rule()
    def step(self) -> None:
        self.ledger.collect_fence_flushes()
        self.ledger.end_step()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.ledger.request_preempted(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.live)))
        self.live.discard(req)
        self.finished.add(req)
        self.ledger.request_finished(req)

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def final_stores_done(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.finished)))
        self.finished.discard(req)
        self.ledger.forget(req)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        jid = data.draw(st.sampled_from(sorted(self.outstanding)))
        count = data.draw(st.integers(1, self.outstanding[jid]))
        self.ledger.complete(jid, count)
        self.outstanding[jid] -= count
        if not self.outstanding[jid]:
            del self.outstanding[jid]

    @rule()
    def reset(self) -> None:
        self.ledger.collect_fence_flushes()
        self.ledger.end_step()
        self.ledger.reset()
        self.ledger.end_step()
        self.finished.clear()  # a reset forgets finished requests

    @invariant()
    def jobs_are_a_subset_of_outstanding(self) -> None:
        assert self.ledger.num_jobs <= len(self.outstanding)

    def teardown(self) -> None:
        for req in sorted(self.live):
            self.ledger.request_finished(req)
        for req in sorted(self.live | self.finished):
            self.ledger.forget(req)
        for jid, left in sorted(self.outstanding.items()):
            self.ledger.complete(jid, left)
        self.ledger.end_step()
        assert self.ledger.is_empty(), (
            self.ledger.num_jobs,
            self.ledger.num_fenced_blocks,
            self.ledger.tracked_requests(),
        )


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=1000, stateful_step_count=40, deadline=None)
