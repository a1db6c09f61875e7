"""The connector's scheduler side: vLLM's requests, blocks and step outputs
translated to kvsdk's :class:`~kvsdk.scheduler.OffloadScheduler`, and its
events and stats translated back."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.request import RequestStatus

from kvsdk import plugins_manager
from kvsdk.backend import SlabRequest
from kvsdk.config import AdmissionConfig, ConfigError
from kvsdk.events import RequestTokens
from kvsdk.plugins.vllm.kv_events import VLLMEventTranslator, spec_kinds
from kvsdk.plugins.vllm.layout import EngineLayout
from kvsdk.plugins.vllm.messages import (
    KVSDKConnectorMetadata,
    KVSDKConnectorStats,
    KVSDKHandshake,
    KVSDKWorkerMetadata,
    machine_id,
)
from kvsdk.plugins.vllm.pd_params import (
    Handoff,
    Role,
    engine_role,
    parse_handoff,
    wants_remote_decode,
)
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import StoreHandle, describe_tier
from kvsdk.types import GroupKind, KVGroupSpec, ReqKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvsdk")  # shown by vLLM's own log handler

IDLE_IO_WAIT_SECONDS = 0.002
"""Longest a step with nothing scheduled waits for kvsdk's tier I/O (a request
arriving meanwhile is scheduled at most this much later)."""

PD_POLL_SECONDS = 0.005
"""Longest a step with nothing scheduled sleeps while decode requests wait for
a prefill engine's chunks (each step looks them up again)."""


@dataclasses.dataclass(slots=True)
class _HandoffWait:
    """A decode request waiting for the chunks of its prefill's hand-off."""

    handoff: Handoff
    deadline: float


def _has_event_sinks() -> bool:
    """Whether any installed plugin implements the ``kvsdk_publish_events`` hook."""
    return bool(plugins_manager.plugin_manager().hook.kvsdk_publish_events.get_hookimpls())


def _tail_tokens(req: Request) -> list[int] | None:
    """The prompt's token ids where they alone name its content (no images,
    no prompt embeddings): then its partial last chunk can be an entry of its own."""
    if req.prompt_embeds is not None or req.mm_features or req.prompt_token_ids is None:
        return None
    return req.prompt_token_ids


_NO_SALT = b"salt=\0lora="


def _tail_salt(req: Request) -> bytes:
    """What else vLLM's block hashes mix in that changes a prompt's KV."""
    if not req.cache_salt and req.lora_request is None:
        return _NO_SALT  # (most requests: no string built)
    lora = req.lora_request.lora_name if req.lora_request is not None else ""
    return f"salt={req.cache_salt or ''}\0lora={lora}".encode()


def _computed_at_finish(req: Request) -> int:
    """Tokens of a finished request whose KV the engine computed."""
    if req.status is RequestStatus.FINISHED_ABORTED:
        return int(req.num_computed_tokens)
    return max(req.num_prompt_tokens, req.num_tokens - 1)  # the last sampled token has none


def loads_in_step(vllm_config: Any, groups: Sequence[KVGroupSpec]) -> bool:
    """Whether kvsdk's loads run before the forward pass of the step that
    schedules their request (vLLM's synchronous loads), not in a step of their
    own. On vLLM-CPU a load is a memcpy on the cores that run the model: an
    asynchronous one gains no overlap, and its request would wait a whole
    engine step in ``WAITING_FOR_REMOTE_KVS`` (the forward pass of every other
    request in that step: up to a doubled TTFT).

    Not with Mamba groups: in the step that schedules a request vLLM's 'align'
    mode copies its last state into the running block before that step's loads
    land, so a state loaded in the same step would be read as garbage (the
    hybrid and Mamba2 tests give other tokens than vLLM's own hit)."""
    from vllm.platforms import current_platform

    if any(g.kind is GroupKind.MAMBA for g in groups):
        return False
    return bool(current_platform.is_cpu())


def recompute_failed_loads(vllm_config: Any) -> None:
    """A cache that fails to load is a miss: vLLM must recompute, not fail the
    request. vLLM reads this policy right after building the connector."""
    ktc = vllm_config.kv_transfer_config
    if ktc.kv_load_failure_policy != "recompute":
        log.warning(
            "kvsdk: kv_load_failure_policy %r -> 'recompute' (a failed load from a cache "
            "is a miss; the request is recomputed, never failed)",
            ktc.kv_load_failure_policy,
        )
        ktc.kv_load_failure_policy = "recompute"


def role_layout(layout: EngineLayout, role: Role) -> EngineLayout:
    """The layout a P/D role runs with: prompt tails on (the hand-off covers the
    prompt to its end) and, for a producer, every chunk admitted (a decode
    engine reads what admission would have skipped)."""
    if role is Role.BOTH:
        return layout
    cfg = dataclasses.replace(layout.config, prompt_tail=True)
    if role is Role.PRODUCER:
        cfg = dataclasses.replace(cfg, admission=AdmissionConfig(policy="all", min_lookups=0))
    return dataclasses.replace(layout, config=cfg)


class SchedulerSide:
    def __init__(self, layout: EngineLayout, vllm_config: Any) -> None:
        try:
            self.role = engine_role(vllm_config.kv_transfer_config.kv_role, layout.config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        layout = role_layout(layout, self.role)
        self.layout = layout
        self.handle = StoreHandle(layout.config)  # starts and stops the store
        self.store = self.handle.build_store(
            layout.namespace,
            layout.chunk_bytes,
            # a host tier alone: only the workers copy, so only they walk its pages
            slab=SlabRequest(
                layout.slab_name,
                layout.ranks.num_regions,
                creator_copies=len(layout.config.tiers) > 1,
            ),
        )
        self.world_size = max(1, vllm_config.parallel_config.world_size)
        self.sync_loads = loads_in_step(vllm_config, layout.groups)
        kv_events = getattr(vllm_config, "kv_events_config", None)
        if not (kv_events and kv_events.enable_kv_cache_events) and not _has_event_sinks():
            self.store.events.enabled = False  # nobody would read them: skip the bookkeeping
        self._events = VLLMEventTranslator(
            layout.groups,
            spec_kinds(layout.groups, bool(getattr(vllm_config.model_config, "use_mla", False))),
            {i: f"kvsdk:{t.backend}" for i, t in enumerate(layout.config.tiers)},
        )
        self.store.events.token_source = self._request_tokens
        self.store.events.last_tier = len(layout.config.tiers) - 1
        self._finishing: dict[str, Request] = {}
        """Finished requests until their final stores are built (their tokens name events)."""
        self.core = OffloadScheduler(
            layout.groups,
            layout.namespace,
            self.store,
            tokens_per_hash=layout.tokens_per_hash,
            max_load_tokens=layout.config.max_load_tokens,
            num_workers=self.world_size,
            # model runner V2 zeroes new blocks and applies copy-on-write
            # before handle_preemptions: a flushed store may read rewritten bytes
            blocks_rewritten_before_flush=bool(getattr(vllm_config, "use_v2_model_runner", False)),
            stores=self.role is not Role.CONSUMER,
        )
        self._stores = self.role is not Role.CONSUMER
        self._pd_wait_s = layout.config.pd.wait_s
        self._pd: dict[str, _HandoffWait | bool] = {}
        """P/D requests with a hand-off: waiting (its wait), or settled: True
        (looked up as usual from now on: loaded, or past its deadline), False
        (refused: loads nothing)."""
        self._prompt_tail = layout.config.prompt_tail
        self.requests: dict[str, Request] = {}
        """Requests vLLM may schedule (a finished one leaves at its finish)."""
        self._finished_tokens: dict[str, int] = {}
        """Finished requests not yet in a step's ``finished_req_ids``: tokens to store."""
        m = self.store.metrics
        self._transfer_hists = [
            (
                m.histogram("kvsdk_transfer_seconds", direction=d),
                m.histogram("kvsdk_transfer_bytes", direction=d),
            )
            for d in ("load", "store")
        ]
        self._reported: dict[str, float] = {}
        self._reported_version = -1
        self.preemptions = 0
        self._held: set[str] = set()
        """Finished requests whose blocks vLLM keeps until their stores land."""
        self._releasing: set[str] = set()
        """Held requests handed to the workers to release, not yet freed by vLLM."""
        log.info(
            "kvsdk: KV groups %s, chunk %d tokens / %d B (%d rank region(s)), host tier %s "
            "slots in shared memory %s",
            ",".join(g.kind.value for g in layout.groups),
            layout.groups[0].tokens_per_chunk,
            layout.chunk_bytes,
            layout.ranks.num_regions,
            self.store.host.num_slots,
            layout.slab_name,
        )
        for i, tier in enumerate(layout.config.tiers[1:], 1):
            log.info("kvsdk: tier %d (%s) opened: %s", i, tier.backend, describe_tier(tier))

    def check_workers(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Start-up: every worker attached to this engine's slab, on this machine."""
        here = machine_id()
        ranks = self.layout.ranks
        for (pp_rank, tp_rank), hs in sorted(metadata.items()):
            if not isinstance(hs, KVSDKHandshake):
                continue
            if hs.machine != here:
                raise ConfigError(
                    f"vLLM worker pp={pp_rank} tp={tp_rank} runs on another machine than the "
                    "scheduler: workers on other machines are not supported by kvsdk yet"
                )
            if hs.error:
                raise ConfigError(f"vLLM worker pp={pp_rank} tp={tp_rank}: {hs.error}")
            if hs.region != ranks.region_index(pp_rank, tp_rank):
                raise ConfigError(
                    f"vLLM worker pp={pp_rank} tp={tp_rank} took region {hs.region}, expected "
                    f"{ranks.region_index(pp_rank, tp_rank)}"
                )
        log.info("kvsdk: %d worker(s) attached to %s", len(metadata), self.layout.slab_name)
        attached = sum(isinstance(hs, KVSDKHandshake) for hs in metadata.values())
        if attached == self.world_size:
            self.store.host.seal()  # no process attaches any more: nothing can leak now

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if not self.core.has_request(rid):  # new, or an id reused after its request finished
            self.core.add_request(
                rid,
                num_prompt_tokens=request.num_prompt_tokens,
                block_hashes=request.block_hashes,
                tenant=request.cache_salt or "",
                prompt_token_ids=_tail_tokens(request) if self._prompt_tail else None,
                tail_salt=_tail_salt(request) if self._prompt_tail else b"",
            )
        else:  # e.g. preempted and waiting again, having grown
            self.core.hashes_grew(rid, request.block_hashes)
        self.requests[rid] = request
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        if self.role is not Role.BOTH:
            return self._handoff_matched(request, num_computed_tokens)
        return self._matched(request, num_computed_tokens)

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """What a lookup of ``request`` promises vLLM."""
        hit = self.core.lookup(
            request.request_id, num_computed_tokens, num_tokens=request.num_tokens
        )
        if hit and self.sync_loads:
            # vLLM computes a token in the step that loads: the last one's KV is
            # recomputed (as after an asynchronous load of the whole prompt)
            hit = min(hit, request.num_tokens - 1 - num_computed_tokens)
        return hit, bool(hit) and not self.sync_loads

    def _handoff_outcome(self, rid: str, outcome: str, *, lookups: bool) -> None:
        """Settle ``rid``'s hand-off (counted); ``lookups``: look it up as usual from now on."""
        self._pd[rid] = lookups
        self.store.metrics.inc("kvsdk_pd_handoffs_total", outcome=outcome)

    def _handoff_matched(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A P/D engine's lookup. Without a hand-off in its ``kv_transfer_params``
        a producer loads nothing and a consumer looks up as usual. With one, the
        request waits (None: vLLM asks again next step) until the chunks it
        names are readable, or ``pd.wait_s`` passed; then it loads what the
        lookup verified and recomputes the rest. A hand-off from another key
        space, or naming other chunks than this prompt's, is refused."""
        rid = request.request_id
        if rid not in self._pd:
            h = parse_handoff(request.kv_transfer_params)
            if isinstance(h, str):
                log.warning("kvsdk: request %s: %s; not loading its hand-off", rid, h)
                self._handoff_outcome(rid, "malformed", lookups=False)
            elif h is not None:
                self._check_handoff(rid, request, h)
        wait = self._pd.get(rid)
        if wait is None:  # no hand-off
            if self.role is Role.PRODUCER:
                return 0, False
            return self._matched(request, num_computed_tokens)
        if wait is False:  # refused
            return 0, False
        if wait is True:  # settled (e.g. asked again after a preemption)
            return self._matched(request, num_computed_tokens)
        if num_computed_tokens >= wait.handoff.tokens:
            self._handoff_outcome(rid, "local", lookups=True)  # vLLM's own cache holds it
            return self._matched(request, num_computed_tokens)
        self.core.expect(rid)  # its chunks may land any moment: no remembered miss
        hit, is_async = self._matched(request, num_computed_tokens)
        if hit is not None and num_computed_tokens + hit >= min(
            wait.handoff.tokens, request.num_tokens - 1
        ):
            self._handoff_outcome(rid, "loaded", lookups=True)
            return hit, is_async
        if time.monotonic() < wait.deadline:
            return None, False
        log.info(
            "kvsdk: request %s: its prefill's chunks were not readable within pd.wait_s "
            "(%.1f s); recomputing past %d tokens",
            rid,
            self._pd_wait_s,
            num_computed_tokens + (hit or 0),
        )
        self._handoff_outcome(rid, "timeout", lookups=True)
        return (hit or 0), is_async and bool(hit)

    def _check_handoff(self, rid: str, request: Request, h: Handoff) -> None:
        """Start the wait for ``h``, or refuse it (counted) where it cannot be this prompt's."""
        if h.namespace != self.core.ns_fp.hex():
            log.warning(
                "kvsdk: request %s: its hand-off is keyed under namespace %s, this engine's "
                "is %s (another model, dtype, chunk size, tenant or secret): recomputing",
                rid,
                h.namespace[:16],
                self.core.ns_fp.hex()[:16],
            )
            self._handoff_outcome(rid, "foreign", lookups=False)
            return
        digest = (
            self.core.handoff_digest(rid, h.tokens)
            if h.tokens <= request.num_prompt_tokens
            else None
        )
        if digest is None or digest.hex() != h.ready:
            log.warning(
                "kvsdk: request %s: its hand-off names other chunks than its prompt's "
                "(%d tokens): recomputing",
                rid,
                h.tokens,
            )
            self._handoff_outcome(rid, "mismatch", lookups=False)
            return
        self._pd[rid] = _HandoffWait(h, time.monotonic() + self._pd_wait_s)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self.core.allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)
        # else: nothing to load; the request is scheduled this step, and its
        # blocks reach the core through build_connector_meta (new requests
        # carry their full block lists)

    def build_connector_meta(self, so: SchedulerOutput) -> KVSDKConnectorMetadata:
        new_blocks: dict[str, Sequence[Sequence[int]]] = {}
        resumed = set()
        # tokens computed before this step, read from the step's own lists: a
        # request's object is only read if it may complete a chunk (one of a few)
        before: list[tuple[str, int]] = []
        for data in so.scheduled_new_reqs:
            new_blocks[data.req_id] = data.block_ids
            resumed.add(data.req_id)  # its full block list: replace
            before.append((data.req_id, data.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                new_blocks[rid] = ids
        resumed.update(cached.resumed_req_ids)
        computed: dict[str, int] = {}
        requests, due, scheduled = self.requests, self.core.store_due, so.num_scheduled_tokens
        for rid, done in (
            itertools.chain(before, zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            if self._stores
            else ()
        ):
            upto = done + scheduled[rid]
            if upto >= due.get(rid, upto + 1):  # only requests that may complete a chunk
                req = requests.get(rid)
                if req is None:
                    continue
                computed[rid] = upto if upto < req.num_tokens else req.num_tokens
                self.core.hashes_grew(rid, req.block_hashes)
        finished: dict[str, int] = {}
        for rid in so.finished_req_ids or ():
            if rid in self._finished_tokens:
                finished[rid] = self._finished_tokens.pop(rid)
        copies = [c.dst_block_id for c in (so.kv_cache_block_copies or ())]
        self.preemptions += len(so.preempted_req_ids or ())
        jobs = self.core.build_step(
            computed_after_step=computed,
            new_block_ids=new_blocks,
            replace_block_ids=resumed,
            preempted=so.preempted_req_ids or (),
            finished=finished,
            reallocated_block_ids=copies,
        )
        for rid in so.finished_req_ids or ():
            self._finishing.pop(rid, None)
        if not so.num_scheduled_tokens and self.store.has_pending_work():
            # nothing to compute but tier I/O (lookups waiting on a promotion,
            # writes draining): sleep on it briefly rather than spin empty steps
            self.store.wait_io(IDLE_IO_WAIT_SECONDS)
        elif (
            not so.num_scheduled_tokens
            and self._pd
            and any(isinstance(w, _HandoffWait) for w in self._pd.values())
        ):
            time.sleep(PD_POLL_SECONDS)  # decode requests wait for their prefill's chunks
        if not (jobs.loads or jobs.stores or finished):
            return KVSDKConnectorMetadata(flush=jobs.flush, sync_loads=self.sync_loads)
        job_requests = self.core.job_requests
        loads = {
            j.job_id: (rid, j) for rid, j in zip(job_requests(jobs.loads), jobs.loads, strict=True)
        }
        release: frozenset[str] = frozenset()
        if self._held and finished:
            # their last stores are in this step
            release = frozenset(self._held.intersection(finished))
            self._held -= release
            self._releasing |= release
        return KVSDKConnectorMetadata(
            loads=loads,
            stores=list(jobs.stores),
            store_requests=job_requests(jobs.stores),
            flush=jobs.flush,
            sync_loads=self.sync_loads,
            release=release,
        )

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        if self._releasing and out.finished_sending:
            self._releasing -= out.finished_sending
        meta = out.kv_connector_worker_meta
        if not isinstance(meta, KVSDKWorkerMetadata):
            return
        results = [WorkerResult(j, True, n) for j, n in meta.completed.items()]
        results += [WorkerResult(j, False, n) for j, n in meta.failed.items()]
        self.core.worker_results(results)
        for (secs_hist, bytes_hist), nbytes, secs in (
            (self._transfer_hists[0], meta.load_bytes, meta.load_seconds),
            (self._transfer_hists[1], meta.store_bytes, meta.store_seconds),
        ):
            if nbytes:
                secs_hist.observe(secs)
                bytes_hist.observe(nbytes)
        if meta.load_bytes:
            self.store.metrics.inc("kvsdk_loaded_bytes_total", meta.load_bytes, tier=0)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """``(hold, kv_transfer_params)``. hold True: vLLM keeps the request's
        blocks until a later step's ``release`` (its stores read them; freed
        blocks may be zeroed or rewritten before a flush could run). The params:
        a producer's hand-off to the decode engine, where the request asked for
        a remote decode (see :mod:`kvsdk.plugins.vllm.pd_params`)."""
        rid = request.request_id
        if self.requests.get(rid) is request:
            del self.requests[rid]  # the id may name a new request before the next step
        if self.store.events.enabled:
            self._finishing[rid] = request
        tokens = self._finished_tokens[rid] = _computed_at_finish(request)
        self.core.hashes_grew(rid, request.block_hashes)
        params = None
        if self.role is not Role.BOTH:
            self._pd.pop(rid, None)
            if (
                self.role is Role.PRODUCER
                and wants_remote_decode(request.kv_transfer_params)
                and self.core.has_request(rid)
            ):
                n, digest = self.core.handoff(rid, min(tokens, request.num_prompt_tokens))
                params = Handoff(self.core.ns_fp.hex(), n, digest.hex()).params()
        # finished in the step that loaded it (a synchronous load, reported done
        # after this call): its stores come next step, from blocks held until then
        loading = self.sync_loads and self.core.is_loading(rid)
        if not self.core.request_finished(rid, tokens) and not loading:
            return False, params
        self._held.add(rid)
        return True, params

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = self.core.take_events()
        return self._events.translate(events) if events else ()

    def _request_tokens(self, key: ReqKey) -> RequestTokens | None:
        """The token source of kvsdk's events: a request's hashes and token ids
        (None where its token ids alone do not name its content)."""
        rid = key if isinstance(key, str) else key[0]
        req = self.requests.get(rid) or self._finishing.get(rid)
        if req is None or _tail_tokens(req) is None:
            return None
        lora = req.lora_request.lora_name if req.lora_request is not None else None
        return RequestTokens(req.block_hashes, req.all_token_ids, lora)

    def stats(self) -> KVSDKConnectorStats | None:
        self.store.flush_metrics()
        m = self.store.metrics
        if m.counter_version == self._reported_version:
            return None
        self._reported_version = m.counter_version
        now = m.counters()
        delta = {
            k: v - self._reported.get(k, 0.0)
            for k, v in now.items()
            if v != self._reported.get(k, 0.0)
        }
        self._reported = now
        return KVSDKConnectorStats(data=delta) if delta else None

    def has_pending_work(self) -> bool:
        return bool(self._held or self._releasing) or self.core.has_pending_work()

    def reset(self) -> None:
        self.core.reset()

    def shutdown(self) -> None:
        self.handle.close()
