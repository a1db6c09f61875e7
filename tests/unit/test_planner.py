"""The lookup planner against a brute-force oracle, over random group mixes and hit patterns."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsdk.planner import LookupPlanner, PlanRequest
from kvsdk.types import GroupKind, KVGroupSpec, LookupResult, cdiv

H, M, P, R = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY


def key(g: int, c: int) -> bytes:
    return f"{g}:{c}".encode()


def tail_key(g: int, b: int) -> bytes:
    return f"tail{g}:{b}".encode()


@dataclass
class Case:
    groups: list[KVGroupSpec]
    num_tokens: int
    num_prompt_tokens: int
    computed: int
    status: dict[bytes, LookupResult]
    max_new: int | None
    max_load: int | None
    mamba_align: int | None
    being_loaded: set[bytes]

    def request(self) -> PlanRequest:
        return PlanRequest(
            req_id="r",
            num_tokens=self.num_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.computed,
            group_keys=[
                [key(g.index, c) for c in range(self.num_tokens // g.tokens_per_chunk)]
                for g in self.groups
            ],
            max_load_tokens=self.max_load,
            boundary_key=tail_key,
        )

    def lookup(self, k: bytes) -> LookupResult:
        return self.status.get(k, M)

    def lookup_run(self, keys: list[bytes], start: int, stop: int) -> tuple[int, int]:
        """The contract of ``TieredStore.lookup_run``, spelled out key by key."""
        present = start
        while present < stop and self.lookup(keys[present]) is not M:
            present += 1
        hit = start
        while hit < present and self.lookup(keys[hit]) is H:
            hit += 1
        return present, hit


def oracle(case: Case) -> int | None:
    """Largest boundary valid for every group, by trying them all."""
    req = case.request()
    computed = case.computed
    cap = case.num_tokens
    if case.max_new is not None:
        cap = min(cap, computed + case.max_new)
    if case.max_load is not None:
        cap = min(cap, computed + case.max_load)
    if any(g.kind is not GroupKind.FULL_ATTENTION for g in case.groups):
        cap = min(cap, case.num_tokens - 1)
    if case.mamba_align:
        cap -= cap % case.mamba_align

    def needed(g: KVGroupSpec, end: int) -> range:
        rng = g.needed_chunks(computed, end)
        return range(rng.start, rng.stop + int(g.eagle))

    def valid(end: int) -> bool:
        for gi, g in enumerate(case.groups):
            tpc = g.tokens_per_chunk
            if end - computed < tpc:
                return False
            if (g.kind is GroupKind.MAMBA or case.max_load is not None) and end % tpc:
                return False
            rng = needed(g, end)
            if rng.stop > len(req.group_keys[gi]):
                return False
            if any(case.lookup(req.group_keys[gi][c]) is M for c in rng):
                return False
        return True

    best = next((t for t in range(cap, computed, -1) if valid(t)), None)
    if best is None:
        return 0
    for gi, g in enumerate(case.groups):
        if any(case.lookup(req.group_keys[gi][c]) is not H for c in needed(g, best)):
            return None
    for gi, g in enumerate(case.groups):
        if any(req.group_keys[gi][c] in case.being_loaded for c in g.needed_chunks(computed, best)):
            return None
    return best - computed


@st.composite
def cases(draw: st.DrawFn, *, uncertain: bool) -> Case:
    tpb = draw(st.sampled_from([4, 8]))
    n_groups = draw(st.integers(1, 3))
    groups = []
    for i in range(n_groups):
        kind = draw(st.sampled_from(list(GroupKind)))
        bpc = draw(st.integers(1, 2))
        window = draw(st.integers(2, 5 * tpb)) if kind is GroupKind.SLIDING_WINDOW else None
        groups.append(
            KVGroupSpec(
                index=i,
                kind=kind,
                tokens_per_block=tpb,
                blocks_per_chunk=bpc,
                sliding_window_tokens=window,
                eagle=draw(st.booleans()) if kind is not GroupKind.MAMBA else False,
            )
        )
    num_tokens = draw(st.integers(1, 14 * tpb))
    computed = draw(st.integers(0, num_tokens // tpb)) * tpb
    statuses = [H, M, P, R] if uncertain else [H, M]
    weights = st.sampled_from(statuses)
    status: dict[bytes, LookupResult] = {}
    hit_rate = draw(st.sampled_from([0.5, 0.8, 0.95]))
    for g in groups:
        for c in range(num_tokens // g.tokens_per_chunk):
            if draw(st.floats(0, 1)) < hit_rate:
                status[key(g.index, c)] = H
            else:
                status[key(g.index, c)] = draw(weights)
    return Case(
        groups=groups,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        computed=computed,
        status=status,
        max_new=draw(st.none() | st.integers(1, num_tokens + 1)),
        max_load=draw(st.none() | st.integers(1, num_tokens + 1)),
        mamba_align=draw(st.none() | st.sampled_from([tpb, 2 * tpb]))
        if any(g.kind is GroupKind.MAMBA for g in groups)
        else None,
        being_loaded=set(draw(st.lists(st.sampled_from(sorted(status) or [b"x"]), max_size=2)))
        if uncertain
        else set(),
    )


def run(case: Case, *, with_runs: bool = False) -> int | None:
    planner = LookupPlanner(case.groups, mamba_align_tokens=case.mamba_align)
    plan = planner.plan(
        case.request(),
        case.lookup,
        max_num_new_tokens=case.max_new,
        being_loaded=case.being_loaded,
        lookup_run=case.lookup_run if with_runs else None,
    )
    return None if plan is None else plan.num_hit_tokens


@settings(max_examples=1500, deadline=None)
@given(cases(uncertain=False))
def test_planner_matches_oracle_for_definite_answers(case: Case) -> None:
    assert run(case) == oracle(case)


@settings(max_examples=1500, deadline=None)
@given(cases(uncertain=True))
def test_planner_matches_oracle_with_pending_retry_and_loading_chunks(case: Case) -> None:
    assert run(case) == oracle(case)


@st.composite
def prefix_only_cases(draw: st.DrawFn) -> Case:
    """Full-attention groups without EAGLE: the planner's one-run-per-group path."""
    case = draw(cases(uncertain=True))
    case.groups = [
        KVGroupSpec(g.index, GroupKind.FULL_ATTENTION, g.tokens_per_block, g.blocks_per_chunk)
        for g in case.groups
    ]
    case.mamba_align = None
    for g in case.groups:  # re-draw the statuses of keys the original kinds left short
        for c in range(case.num_tokens // g.tokens_per_chunk):
            case.status.setdefault(key(g.index, c), draw(st.sampled_from([H, H, M, P, R])))
    return case


@settings(max_examples=1500, deadline=None)
@given(prefix_only_cases())
def test_prefix_run_path_matches_oracle(case: Case) -> None:
    assert run(case, with_runs=True) == oracle(case) == run(case)


@settings(max_examples=500, deadline=None)
@given(cases(uncertain=True))
def test_lookup_run_is_ignored_where_groups_need_more_than_a_prefix(case: Case) -> None:
    assert run(case, with_runs=True) == oracle(case)


def full(i: int = 0, tpb: int = 4, bpc: int = 1, eagle: bool = False) -> KVGroupSpec:
    return KVGroupSpec(i, GroupKind.FULL_ATTENTION, tpb, bpc, eagle=eagle)


def swa(i: int, window: int, tpb: int = 4, bpc: int = 1) -> KVGroupSpec:
    return KVGroupSpec(i, GroupKind.SLIDING_WINDOW, tpb, bpc, sliding_window_tokens=window)


def make(groups: list[KVGroupSpec], n: int, hits: dict[bytes, LookupResult], **kw: object) -> Case:
    defaults: dict[str, object] = dict(
        num_prompt_tokens=n,
        computed=0,
        max_new=None,
        max_load=None,
        mamba_align=None,
        being_loaded=set(),
    )
    defaults.update(kw)
    return Case(groups=groups, num_tokens=n, status=hits, **defaults)  # type: ignore[arg-type]


def test_prefix_scan_stops_at_first_miss() -> None:
    hits = {key(0, 0): H, key(0, 1): H, key(0, 3): H}
    assert run(make([full()], 16, hits)) == 8


def test_sliding_window_needs_only_the_window_before_the_boundary() -> None:
    # window of 5 tokens -> the last 4 positions; chunk 0 missing does not matter
    hits = {key(0, c): H for c in range(4)} | {key(1, 2): H, key(1, 3): H}
    hits.pop(key(0, 0))
    case = make([full(0), swa(1, 5)], 16, {key(0, c): H for c in range(4)} | hits)
    # full group hits every chunk; the window group needs chunks covering [15-4, 15)
    assert run(case) == 15
    assert oracle(case) == 15


def test_sliding_window_group_tightens_full_group_and_loop_converges() -> None:
    # full attention hits 4 chunks, the window group misses chunk 3 -> boundary moves to 12
    hits = {key(0, c): H for c in range(4)} | {key(1, 1): H, key(1, 2): H}
    assert run(make([full(0), swa(1, 5)], 17, hits)) == 12


def test_eagle_group_needs_one_more_chunk_than_it_claims() -> None:
    hits = {key(0, c): H for c in range(3)}
    assert run(make([full(0, eagle=True)], 16, hits)) == 8


def test_retry_on_a_needed_chunk_defers_and_a_miss_before_it_does_not() -> None:
    assert run(make([full()], 16, {key(0, 0): H, key(0, 1): R})) is None
    assert run(make([full()], 16, {key(0, 0): H, key(0, 1): M, key(0, 2): R})) == 4


def test_chunks_being_loaded_by_another_request_delay_the_request() -> None:
    hits = {key(0, c): H for c in range(4)}
    assert run(make([full()], 16, hits, being_loaded={key(0, 2)})) is None


def test_max_num_new_tokens_caps_the_hit() -> None:
    hits = {key(0, c): H for c in range(4)}
    assert run(make([full()], 16, hits, max_new=6)) == 6


def test_partial_tail_extends_past_the_last_whole_chunk() -> None:
    groups = [full(0, tpb=8)]
    case = make(groups, 20, {key(0, 0): H, key(0, 1): H, tail_key(0, 18): H})
    planner = LookupPlanner(groups, partial_tail_block_tokens=8, tokens_per_hash=2)
    plan = planner.plan(case.request(), case.lookup)
    assert plan is not None
    assert (plan.num_hit_tokens, plan.partial_tail_boundary) == (18, 18)
    # a pending tail with no complete hit defers; with a complete hit it does not
    case.status = {tail_key(0, 6): P}
    assert planner.plan(case.request(), case.lookup) is None


def test_each_key_is_looked_up_at_most_once_per_plan() -> None:
    calls: list[bytes] = []
    hits = {key(0, c): H for c in range(8)} | {key(1, c): H for c in range(8)}
    hits[key(1, 6)] = M

    def lookup(k: bytes) -> LookupResult:
        calls.append(k)
        return hits.get(k, M)

    case = make([full(0), swa(1, 6)], 32, hits)
    LookupPlanner(case.groups).plan(case.request(), lookup)
    assert len(calls) == len(set(calls))
    assert cdiv(32, 4) >= 1
