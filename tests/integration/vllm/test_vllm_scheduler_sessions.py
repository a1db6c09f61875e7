"""vLLM's streaming-input sessions on its real Scheduler, with kvsdk.

A session (``resumable=True``) pauses after each input; the next input
replaces the last sampled token (never computed), and vLLM drops the hash of
the block that held it and hashes that block again with the new token (0.32
cuts at the computed tokens, 0.33 at all tokens but the last). kvsdk's copy of
a session's hashes is always a prefix of vLLM's, its stores are keyed by the
hashes vLLM holds, and a prompt with the dropped token (the first turn's
content) is not served the session's KV. Run against each vLLM's Scheduler
(no model: the test plays the model runner).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from test_vllm_scheduler_holds_blocks import (  # noqa: E402
    BLOCK,
    CHUNK,
    TOKEN,
    Engine,
    model_dir,
)

__all__ = ["model_dir"]  # the fixture, shared with test_vllm_scheduler_holds_blocks

from kvsdk.keys import chunk_key  # noqa: E402

TURN1 = [100 + i for i in range(CHUNK - 1)]  # the sampled token completes block 1
TURN2 = [300 + i for i in range(4 * CHUNK)]  # stored when computed (kvsdk batches it as decode)


def session_input(tokens: list[int], max_tokens: int) -> Request:
    return Request(
        "s",
        list(tokens),  # vLLM extends a session's prompt list in place
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        resumable=True,
    )


class Session:
    def __init__(self, e: Engine) -> None:
        self.e = e
        self.core = e.connector.sched.core
        self.stored: list[bytes] = []

    def check_prefix(self) -> None:
        """kvsdk holds no hash of the session that vLLM does not."""
        r = self.core._requests.get("s")
        vr = self.e.scheduler.requests.get("s")
        if r is None or vr is None:
            return
        assert r.hashes == [bytes(h) for h in vr.block_hashes[: len(r.hashes)]]

    def steps(self, n: int) -> None:
        for _ in range(n):
            so, meta = self.e.schedule()
            self.check_prefix()
            for job in meta.stores:
                self.stored += self.core.ledger.job(job.job_id).keys
            self.e.output(so, completed={j.job_id: 1 for j in meta.stores})
            self.check_prefix()


def test_a_session_rewind_never_files_kv_under_a_dropped_hash(model_dir: str) -> None:
    e = Engine(model_dir, f"kvsdk-test-sessions-{uuid.uuid4()}", prompt_tail=True)
    try:
        s = Session(e)
        e.scheduler.add_request(session_input(TURN1, max_tokens=1))
        s.steps(2)
        vr = e.scheduler.requests["s"]
        assert vr.status is RequestStatus.WAITING_FOR_STREAMING_REQ
        dropped = bytes(vr.block_hashes[1])  # block 1 = TURN1's last 15 tokens + the sampled one
        assert len(vr.all_token_ids) == CHUNK and vr.all_token_ids[-1] == TOKEN

        e.scheduler.add_request(session_input(TURN2, max_tokens=1))  # the next input
        assert len(vr.all_token_ids) == CHUNK - 1 + len(TURN2)  # the sampled token dropped
        assert bytes(vr.block_hashes[1]) != dropped
        s.check_prefix()
        s.steps(4)
        ns_fp = s.core.ns_fp
        assert chunk_key(ns_fp, dropped, 0) not in s.stored
        assert chunk_key(ns_fp, bytes(vr.block_hashes[1]), 0) in s.stored  # its chunk 0, rehashed

        # the first turn's content with its sampled token: vLLM's own block 0 only,
        # nothing from kvsdk (its chunk 0 is not the session's)
        other = Request(
            "o",
            [*TURN1, TOKEN, *TURN2[1:]],
            SamplingParams(max_tokens=1, ignore_eos=True),
            None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        e.scheduler.add_request(other)
        so, meta = e.schedule()
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == BLOCK  # vLLM's own cache: block 0
        assert not meta.loads
        e.output(so, completed={j.job_id: 1 for j in meta.stores})
    finally:
        e.scheduler.shutdown()
