"""Workloads that drive a real vLLM engine with kvsdk: the demo, the fault soak,
the multi-round serve benchmark, the seeded tiny models they run, and the
probes that read the engine's state from other processes.

None of it is part of the connector: ``KVSDKConnector`` runs without this
package, and nothing here imports vLLM or changes the environment at import
time. Each run sets vLLM-CPU's environment defaults (:func:`use_cpu_engine_defaults`)
right before it builds an engine.
"""

from __future__ import annotations

import os


def use_cpu_engine_defaults(kv_cache_gib: int) -> None:
    """vLLM-CPU settings for kvsdk's workloads, unless the caller set them.

    No OpenMP thread pinning (the machine is shared; pinned threads contend),
    and a KV cache of ``kv_cache_gib`` GiB. Engine processes inherit them.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
