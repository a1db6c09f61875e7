"""A hit is a promise the engine may cut or decline before it allocates (vLLM
0.33's ``cap_external_hit`` turns a prompt-tail hit into none when auxiliary
outputs are on; a synchronous load takes one token less). kvsdk loads exactly
what the engine took, and counts that as hit tokens: a declined hit loads
nothing into blocks the engine recomputes, and counts nothing."""

from __future__ import annotations

import hashlib

from kvsdk.config import load_config
from kvsdk.keys import GroupLayout, Namespace
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.types import GroupKind, KVGroupSpec

TPB = 4
PROMPT = list(range(10, 21))  # 11 tokens: 2 whole blocks and a 3-token tail


def make() -> OffloadScheduler:
    ns = Namespace("m", "float32", (GroupLayout((2, TPB, 1, 8), "float32"),), TPB)
    store = build_store(load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}), ns, 256)
    return OffloadScheduler([KVGroupSpec(0, GroupKind.FULL_ATTENTION, TPB, 1)], ns, store)


def chain(tokens: list[int]) -> list[bytes]:
    out, prev = [], b""
    for b in range(len(tokens) // TPB):
        prev = hashlib.sha256(prev + bytes(tokens[b * TPB : (b + 1) * TPB])).digest()
        out.append(prev)
    return out


def stored_prompt() -> OffloadScheduler:
    """A scheduler holding PROMPT's two whole chunks and its tail."""
    s = make()
    s.add_request("a", num_prompt_tokens=11, block_hashes=chain(PROMPT), prompt_token_ids=PROMPT)
    assert s.lookup("a", 0) == 0
    jobs = s.build_step(computed_after_step={"a": 11}, new_block_ids={"a": [[1, 2, 3]]},
                        replace_block_ids=["a"])  # fmt: skip
    s.worker_results([WorkerResult(j.job_id) for j in jobs.stores])
    s.request_finished("a", 11)
    s.build_step(computed_after_step={}, finished={"a": 11})
    return s


def hit_tokens(s: OffloadScheduler) -> float:
    return s.metrics.counter("kvsdk_hit_tokens_total")


def ask(s: OffloadScheduler, rid: str) -> int | None:
    s.add_request(rid, num_prompt_tokens=11, block_hashes=chain(PROMPT), prompt_token_ids=PROMPT)
    return s.lookup(rid, 0)


def test_a_declined_tail_hit_loads_nothing_and_counts_nothing() -> None:
    s = stored_prompt()
    assert ask(s, "b") == 11  # the whole chunks and the tail
    s.allocated("b", [[7, 8, 9]], 0)  # vLLM capped the hit to none: it computes all
    jobs = s.build_step(computed_after_step={"b": 11}, new_block_ids={"b": [[7, 8, 9]]},
                        replace_block_ids=["b"])  # fmt: skip
    assert not jobs.loads
    assert not s.is_loading("b")
    assert hit_tokens(s) == 0


def test_a_hit_cut_to_whole_blocks_loads_those_only_and_counts_them() -> None:
    s = stored_prompt()
    assert ask(s, "b") == 11
    s.allocated("b", [[7, 8, 9]], 8)  # the engine took the whole blocks only
    (load,) = s.build_step(computed_after_step={}).loads
    assert [b for c in load.copies for b in c.engine_blocks] == [7, 8]  # not the tail's 9
    assert hit_tokens(s) == 8


def test_a_taken_hit_counts_what_the_engine_took() -> None:
    s = stored_prompt()
    assert ask(s, "b") == 11
    s.allocated("b", [[7, 8, 9]], 10)  # a load in the step: the last token is computed
    (load,) = s.build_step(computed_after_step={}).loads
    assert [b for c in load.copies for b in c.engine_blocks] == [7, 8, 9]
    assert hit_tokens(s) == 10
