"""Moving KV blocks between an engine's paged tensors and host slots.

- :mod:`kvsdk.transfer.base`   the worker contract and job types (re-exported here)
- :mod:`kvsdk.transfer.cpu`    the thread-pool worker for host-memory engines
- :mod:`kvsdk.transfer.cuda`   the CUDA-stream worker
- :mod:`kvsdk.transfer.cuda_runtime` its device seam (streams, events, pinning) and job tracker
- :mod:`kvsdk.transfer.layout` copy plans: engine block views and row runs
"""

from kvsdk.transfer.base import (
    BlockCopies,
    BlockIds,
    Direction,
    GroupLayers,
    TransferJob,
    TransferResult,
    TransferWorker,
    as_index,
    block_bytes_view,
    slab_span,
    slot_views,
)

__all__ = [
    "BlockCopies",
    "BlockIds",
    "Direction",
    "GroupLayers",
    "TransferJob",
    "TransferResult",
    "TransferWorker",
    "as_index",
    "block_bytes_view",
    "slab_span",
    "slot_views",
]
