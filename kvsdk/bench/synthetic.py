"""A synthetic engine that drives the core the way a paged-KV engine does.

It owns real paged KV tensors (per group, per layer), a block pool, and a
scheduler loop (chunked prefill, a few decode steps, finish); it calls the
:class:`~kvsdk.scheduler.OffloadScheduler` exactly where an adapter would and
runs the jobs on a real transfer worker. Every block's bytes are a function
of the tokens it covers, so after a load it can check, byte for byte, that
the KV it got is the KV it would have computed. Used by ``kvsdk bench core``
and by the core's end-to-end tests; it never stands in for a real engine in
an engine's integration tests.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvsdk.config import KVSDKConfig, load_config
from kvsdk.keys import GroupLayout, Namespace, token_chunk_hashes
from kvsdk.scheduler import OffloadScheduler, WorkerResult
from kvsdk.store.factory import build_store
from kvsdk.transfer import GroupLayers
from kvsdk.transfer.cpu import CPUTransferWorker
from kvsdk.types import GroupKind, KVGroupSpec, cdiv


@dataclass
class TraceSpec:
    num_requests: int = 200
    num_prefixes: int = 4
    prefix_tokens: int = 1024
    suffix_tokens: tuple[int, int] = (16, 512)
    decode_tokens: int = 4
    max_batched_tokens: int = 2048
    max_running: int = 16
    seed: int = 0


@dataclass
class _Req:
    req_id: str
    tokens: list[int]
    hashes: list[bytes]
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)
    external: int = 0
    decoded: int = 0


@dataclass
class RunStats:
    steps: int = 0
    lookups: int = 0
    looked_up_chunks: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    core_seconds: float = 0.0
    step_core_seconds: list[float] = field(default_factory=list)
    loaded_blocks_checked: int = 0
    mismatched_blocks: int = 0
    failed_load_blocks: int = 0


class SyntheticEngine:
    def __init__(
        self,
        groups: list[KVGroupSpec],
        *,
        num_layers: int = 4,
        block_bytes: int = 4096,
        num_blocks: int = 4096,
        config: KVSDKConfig | dict[str, object] | None = None,
        corrupt_loads: bool = False,
    ) -> None:
        self.groups = groups
        self.cfg = config if isinstance(config, KVSDKConfig) else load_config(config)
        self.block_bytes = block_bytes
        self.kv = [
            [torch.zeros((num_blocks, block_bytes), dtype=torch.uint8) for _ in range(num_layers)]
            for _ in groups
        ]
        self.free = [list(range(num_blocks - 1, 0, -1)) for _ in groups]  # block 0 is null
        layers = [
            GroupLayers(g.index, tuple(self.kv[i]), g.blocks_per_chunk)
            for i, g in enumerate(groups)
        ]
        chunk_bytes = max(gl.chunk_bytes for gl in layers)
        ns = Namespace(
            model="synthetic",
            dtype="uint8",
            groups=tuple(GroupLayout((num_layers, block_bytes), "uint8") for _ in groups),
            tokens_per_chunk=groups[0].tokens_per_chunk,
        )
        self.store = build_store(self.cfg, ns, chunk_bytes)
        self.core = OffloadScheduler(
            groups, ns, self.store, max_load_tokens=self.cfg.max_load_tokens
        )
        self.worker = CPUTransferWorker()
        self.worker.register(layers, self.store.host.slab)
        self.tpb = groups[0].tokens_per_block
        self.corrupt_loads = corrupt_loads
        self.stats = RunStats()

    # -- content: a block's bytes are a function of the tokens it covers -----------------
    def expected_block(self, req: _Req, block_index: int, layer: int, group: int) -> np.ndarray:
        seed = hashlib.blake2b(
            req.hashes[block_index] + bytes([layer, group]), digest_size=64
        ).digest()
        return np.frombuffer(seed * cdiv(self.block_bytes, 64), dtype=np.uint8)[: self.block_bytes]

    def _compute(self, req: _Req, start: int, end: int) -> None:
        for gi in range(len(self.groups)):
            for b in range(start // self.tpb, cdiv(end, self.tpb)):
                if (b + 1) * self.tpb > len(req.hashes) * self.tpb:
                    continue  # partial last block: content not hashed yet
                for li, layer in enumerate(self.kv[gi]):
                    layer[req.blocks[gi][b]] = torch.from_numpy(
                        self.expected_block(req, b, li, gi).copy()
                    )

    def _check_loaded(self, req: _Req, start: int, end: int) -> None:
        for gi, g in enumerate(self.groups):
            needed = g.needed_chunks(start, end)
            first_block = max(start // self.tpb, needed.start * g.blocks_per_chunk)
            for b in range(first_block, end // self.tpb):
                for li, layer in enumerate(self.kv[gi]):
                    got = layer[req.blocks[gi][b]].numpy()
                    self.stats.loaded_blocks_checked += 1
                    if not np.array_equal(got, self.expected_block(req, b, li, gi)):
                        self.stats.mismatched_blocks += 1

    # -- the loop ---------------------------------------------------------------------------
    def run(self, spec: TraceSpec, progress: Callable[[int], None] | None = None) -> RunStats:
        rng = random.Random(spec.seed)
        prefixes = [
            [rng.randrange(32000) for _ in range(spec.prefix_tokens)]
            for _ in range(spec.num_prefixes)
        ]
        waiting: list[_Req] = []
        for i in range(spec.num_requests):
            suffix = [rng.randrange(32000) for _ in range(rng.randint(*spec.suffix_tokens))]
            tokens = rng.choice(prefixes) + suffix
            hashes = token_chunk_hashes(tokens, self.tpb)
            waiting.append(_Req(f"req-{i}", tokens, hashes))
        running: list[_Req] = []
        finished_prev: dict[str, int] = {}
        done = 0
        while waiting or running or self.core.has_pending_work():
            core = 0.0
            budget = spec.max_batched_tokens
            scheduled: dict[str, int] = {}
            new_blocks: dict[str, list[list[int]]] = {}
            # admit waiting requests
            while waiting and len(running) < spec.max_running and budget > 0:
                req = waiting[0]
                c0 = time.perf_counter()
                if not self.core.has_request(req.req_id):
                    self.core.add_request(
                        req.req_id, num_prompt_tokens=len(req.tokens), block_hashes=req.hashes
                    )
                hit = self.core.lookup(req.req_id, 0, num_tokens=len(req.tokens))
                core += time.perf_counter() - c0
                self.stats.lookups += 1
                self.stats.looked_up_chunks += sum(
                    len(req.tokens) // g.tokens_per_chunk for g in self.groups
                )
                if hit is None:
                    break  # ask again next step
                need = cdiv(len(req.tokens) + spec.decode_tokens, self.tpb)
                if any(len(f) < need for f in self.free):
                    break
                waiting.pop(0)
                req.blocks = [[f.pop() for _ in range(need)] for f in self.free]
                req.external = hit
                req.computed = hit
                self.stats.hit_tokens += hit
                self.stats.prompt_tokens += len(req.tokens)
                c0 = time.perf_counter()
                self.core.allocated(req.req_id, req.blocks, hit)
                core += time.perf_counter() - c0
                running.append(req)
            # schedule tokens
            for req in running:
                if req.computed < len(req.tokens):
                    n = min(budget, len(req.tokens) - req.computed)
                    if n <= 0:
                        continue
                    budget -= n
                else:
                    n = 1
                scheduled[req.req_id] = n
            c0 = time.perf_counter()
            jobs = self.core.build_step(
                computed_after_step={
                    r.req_id: min(r.computed + scheduled.get(r.req_id, 0), len(r.tokens))
                    for r in running
                    if r.req_id in scheduled
                },
                new_block_ids=new_blocks,
                finished=finished_prev,
            )
            core += time.perf_counter() - c0
            # stores that read blocks reused this step finish first (vLLM:
            # handle_preemptions), then loads may overwrite those blocks
            early = [j for j in jobs.stores if j.job_id in jobs.flush]
            for job in early:
                self.worker.submit(job)
            self.worker.wait(jobs.flush)
            for job in jobs.loads:
                self.worker.submit(job)
            self.worker.wait(j.job_id for j in jobs.loads)
            # the forward pass: check loaded KV, compute the scheduled tokens
            for req in running:
                if req.external:
                    self._check_loaded(req, 0, req.external)
                    req.external = 0
            if self.corrupt_loads:
                for gi in range(len(self.groups)):
                    for layer in self.kv[gi]:
                        layer[1:].add_(1)
                self.corrupt_loads = False
            for req in running:
                n = scheduled.get(req.req_id, 0)
                if req.computed < len(req.tokens):
                    self._compute(req, req.computed, req.computed + n)
                    req.computed += n
                elif n:
                    req.decoded += 1
            for job in jobs.stores:
                if job.job_id not in jobs.flush:
                    self.worker.submit(job)
            results = [WorkerResult(r.job_id, r.ok) for r in self.worker.poll()]
            c0 = time.perf_counter()
            failed = self.core.worker_results(results)
            self.stats.failed_load_blocks += len(failed)
            # finish requests
            finished_prev = {}
            for req in [r for r in running if r.decoded >= spec.decode_tokens]:
                running.remove(req)
                self.core.request_finished(req.req_id)
                finished_prev[req.req_id] = len(req.tokens)
                for gi, ids in enumerate(req.blocks):
                    self.free[gi].extend(reversed(ids))
                done += 1
                if progress:
                    progress(1)
            core += time.perf_counter() - c0
            if not running and not waiting and self.core.has_pending_work():
                time.sleep(0.0005)  # only transfers left: let the worker finish
            self.stats.steps += 1
            self.stats.core_seconds += core
            self.stats.step_core_seconds.append(core)
        return self.stats

    def close(self) -> None:
        self.worker.shutdown()
        self.store.shutdown()


def default_groups(tokens_per_block: int = 16, blocks_per_chunk: int = 4) -> list[KVGroupSpec]:
    """A hybrid model's groups: full attention plus a sliding window."""
    return [
        KVGroupSpec(0, GroupKind.FULL_ATTENTION, tokens_per_block, blocks_per_chunk),
        KVGroupSpec(
            1,
            GroupKind.SLIDING_WINDOW,
            tokens_per_block,
            blocks_per_chunk,
            sliding_window_tokens=4 * tokens_per_block * blocks_per_chunk,
        ),
    ]
