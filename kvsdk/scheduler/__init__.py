"""The engine-agnostic scheduler side of an offloading connector.

An adapter translates its engine's calls into these, in this order per step:

1. ``add_request`` when the engine first sees a request;
2. ``lookup(req_id, num_computed_tokens)`` → tokens loadable from kvsdk
   (``None``: ask again next step);
3. ``allocated(req_id, block_ids, num_external_tokens)`` once the engine
   allocated blocks for the hit → a load job for this step;
4. ``build_step(...)`` with the step's scheduled / preempted / finished
   requests and newly allocated blocks → the step's jobs (loads, stores and
   ids to flush) for the transfer workers;
5. ``worker_results(...)`` with what the workers finished → failed loads'
   engine blocks, so the engine recomputes them;
6. ``request_finished`` when the engine is done with a request.

All inputs are plain data: request ids, engine block hashes, block ids per
KV group, token counts. Keys come from the engine's block hashes (one per
``tokens_per_hash`` tokens) or, if it has none, from the token ids.

Modules: :mod:`~kvsdk.scheduler.offload` (the scheduler), :mod:`~kvsdk.scheduler.request`
(per-request state and chunk arithmetic), :mod:`~kvsdk.scheduler.chunk_keys` (keys
from engine hashes), :mod:`~kvsdk.scheduler.lookup` (hits), :mod:`~kvsdk.scheduler.load_jobs`
(loads in flight), :mod:`~kvsdk.scheduler.store_pacing` (when stores are due),
:mod:`~kvsdk.scheduler.store_jobs` (store jobs), :mod:`~kvsdk.scheduler.tail` (the
prompt's partial last chunk), :mod:`~kvsdk.scheduler.steps` (a step's inputs and outputs).
"""

from kvsdk.scheduler.offload import OffloadScheduler
from kvsdk.scheduler.steps import DECODE_STORE_CHUNKS, StepJobs, WorkerResult

__all__ = ["DECODE_STORE_CHUNKS", "OffloadScheduler", "StepJobs", "WorkerResult"]
